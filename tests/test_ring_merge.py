"""merge_block and row_dot: exactly the per-head results, in a number of tensor ops that does not grow with heads."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from burst import ring
from burst.ring import merge_block, output_with_delta, row_dot


def merge_one_head_at_a_time(out, lse, block_out, block_lse):
    """The former implementation: the reference the grouped one must match bit for bit."""
    weight = torch.sigmoid(block_lse - lse).nan_to_num_(0.0)
    for h in range(out.shape[2]):
        out[:, :, h].lerp_(block_out[:, :, h].float(), weight[:, h].unsqueeze(-1))
    lse.copy_(torch.logaddexp(lse, block_lse))


def row_dot_one_head_at_a_time(a, b):
    return torch.stack([(a[:, :, h].float() * b[:, :, h].float()).sum(-1) for h in range(a.shape[2])], dim=1)


def merge_inputs(heads, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(2, 24, heads, 16, generator=g)
    lse = torch.randn(2, heads, 24, generator=g)
    lse[0, :, :3] = float("-inf")  # rows that have seen no key yet
    block_out = torch.randn(2, 24, heads, 16, generator=g).to(dtype)
    block_lse = torch.randn(2, heads, 24, generator=g)
    block_lse[1, :, 5:9] = float("-inf")  # rows the block masks fully
    block_lse[0, :, 1] = float("-inf")  # both -inf
    return out, lse, block_out, block_lse


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [64 * 2**20, 3 * 24 * 16 * 4 * 2])  # one group; groups of 3 heads
def test_merge_and_row_dot_equal_the_per_head_reference(dtype, budget, monkeypatch):
    monkeypatch.setattr(ring, "FLOAT32_TEMPORARY_BYTES", budget)
    out, lse, block_out, block_lse = merge_inputs(8, dtype)
    want_out, want_lse = out.clone(), lse.clone()
    for rows in (slice(4, None), slice(0, 4)):  # on views of the accumulators, as the ring passes them
        merge_block(out[:, rows], lse[:, :, rows], block_out[:, rows], block_lse[:, :, rows])
        merge_one_head_at_a_time(want_out[:, rows], want_lse[:, :, rows], block_out[:, rows], block_lse[:, :, rows])
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    a, b = block_out, torch.randn(block_out.shape).to(dtype)
    assert torch.equal(row_dot(a, b), row_dot_one_head_at_a_time(a, b))


def ops_per_call(heads: int) -> tuple[int, int, int]:
    out, lse, block_out, block_lse = merge_inputs(heads, torch.bfloat16)
    delta = torch.randn(2, heads, 24)
    counts = []
    for call in (lambda: merge_block(out, lse, block_out, block_lse), lambda: row_dot(block_out, block_out),
                 lambda: output_with_delta(block_out, delta)):
        with CountOps() as counter:
            call()
        counts.append(counter.count)
    return tuple(counts)


def test_op_count_does_not_grow_with_heads():
    assert ops_per_call(4) == ops_per_call(16)
