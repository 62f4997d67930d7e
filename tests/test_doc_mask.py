"""Document-masked burst_attn against a float64 reference with a block-diagonal mask."""

import pytest
import torch

import burst
from burst.kernels import TorchCPUKernel, select_kernel
from tests.distributed import run_on_ranks
from tests.test_burst_attn import TOLERANCE, make_inputs


def reference(q, k, v, dout, boundaries, causal, sees=None):
    """float64 attention where each query sees only keys of its own document (and, with `sees`, per row
    the earlier document each document also sees whole, or -1)."""
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    qh = qr.transpose(1, 2)
    kh, vh = (t.repeat_interleave(groups, 2).transpose(1, 2) for t in (kr, vr))
    scores = qh @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5  # [b, h, s, s]
    n = q.shape[1]
    masks = []
    for row, offsets in enumerate(boundaries):
        doc = torch.bucketize(torch.arange(n), torch.tensor(offsets[1:-1]), right=True)
        visible = doc[:, None] == doc[None, :]
        if causal:
            visible &= torch.ones(n, n, dtype=torch.bool).tril()
        if sees is not None:
            visible |= torch.tensor(sees[row])[doc][:, None] == doc[None, :]
        masks.append(visible)
    scores = scores.masked_fill(~torch.stack(masks)[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = (torch.softmax(scores, -1) @ vh).transpose(1, 2)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad


def boundary_cases(world_size):
    """name -> per-row boundaries over a sequence of 2W chunks of 12 tokens."""
    chunk, seq = 12, 2 * world_size * 12
    return {
        "short docs": [[0, 3, 5, 11, 13, seq - 1, seq], [0, 1, seq]],
        "chunk edges": [list(range(0, seq + 1, chunk)), [0, chunk, seq - chunk // 2, seq]],
        "one doc": [[0, seq], [0, seq]],
        "mixed rows": [[0, seq // 2 + 1, seq], [0, 7, 8, 9, 2 * chunk - 1, seq]],
    }


def check_case(world_size, boundaries, causal, heads, dtype, mode):
    seq = 2 * world_size * 12
    q, k, v, dout = make_inputs(seq, *heads, dtype, seed=1)
    expected = reference(q, k, v, dout, boundaries, causal)
    lq, lk, lv = (burst.shard_sequence(t).requires_grad_() for t in (q, k, v))
    doc_boundaries = [torch.tensor(b) for b in boundaries]
    out, lse = burst.burst_attn(lq, lk, lv, causal=causal, backward=mode, doc_boundaries=doc_boundaries,
                                return_lse=True)
    out.backward(burst.shard_sequence(dout))
    got = [burst.gather_sequence(out.detach()), burst.gather_sequence(lse, dim=2)]
    got += [burst.gather_sequence(t.grad) for t in (lq, lk, lv)]
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        err = (g.double() - e).abs().max().item()
        assert err <= TOLERANCE[dtype], f"{name}: {err:.2e} (world {world_size}, {boundaries}, {causal=}, " \
                                        f"{heads=}, {dtype}, {mode})"


def _all_cases(rank, world_size):
    for boundaries in boundary_cases(world_size).values():
        for mode in ("burst", "ring"):
            check_case(world_size, boundaries, True, (4, 2), torch.float32, mode)
        check_case(world_size, boundaries, True, (4, 4), torch.bfloat16, "burst")
    check_case(world_size, boundary_cases(world_size)["short docs"], False, (4, 4), torch.float32, "burst")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_doc_mask_matches_reference(world_size):
    if world_size == 1:
        _all_cases(0, 1)
    else:
        run_on_ranks(_all_cases, world_size)


def _count_kernel_calls(rank, world_size):
    calls = []
    select_kernel(torch.device("cpu"), torch.float32, head_dim=8)  # its one-time self-check runs uncounted
    forward = TorchCPUKernel.forward

    def counting(self, q, k, v, causal, scale):
        calls.append((q.shape[1], k.shape[1], causal))
        return forward(self, q, k, v, causal, scale)

    TorchCPUKernel.forward = counting
    try:
        # four documents, one per zigzag chunk: every rank only meets its own two chunks
        q = torch.randn(1, 12, 2, 8)
        burst.burst_attn(q, q, q, doc_boundaries=[torch.tensor([0, 6, 12, 18, 24])])
    finally:
        TorchCPUKernel.forward = forward
    assert calls == [(6, 6, True), (6, 6, True)], calls


def test_fully_masked_blocks_cost_no_kernel_call():
    run_on_ranks(_count_kernel_calls, 2)


@pytest.mark.parametrize("boundaries, message", [
    ([[0, 5, 12]], "rise strictly from 0 to the global sequence length 24"),
    ([[0, 12, 12, 24]], "rise strictly"),
    ([[0, 24], [0, 24]], "has 2 rows but the batch has 1"),
])
def test_bad_boundaries_are_refused(boundaries, message):
    q = torch.randn(1, 24, 2, 8)
    with pytest.raises(ValueError, match=message):
        burst.burst_attn(q, q, q, doc_boundaries=boundaries)
