"""Documents in one launch (burst/varlen.py): a step's rectangles packed with cumulative offsets, checked on CPU
with a varlen kernel of the math kernel's semantics that asserts what the real ones need, against per-block
computation and the float64 reference at 1, 2 and 4 ranks; the offsets built from the plan's rectangles; and
the varlen self-check that turns a wrong varlen path off."""

import logging

import pytest
import torch

from burst.kernels import MathKernel, TorchCUDAFlashKernel
from burst.kernels.choice import enable_varlen
from burst.kernels.selfcheck import varlen_self_check
from burst.layout import row_layouts
from burst.plan import AttentionPlan
from burst.varlen import backward_blocks, forward_blocks
from tests.distributed import run_on_ranks
from tests.test_doc_mask import boundary_cases, check_case
from tests.test_kernel_contract import using_kernel
from tests.test_prefix_sharing import check_shared, pair_rows

CPU = torch.device("cpu")


def _sequences(cu: torch.Tensor, max_len: int, total: int) -> list[slice]:
    """The packed rows of each sequence, after asserting the offsets are what a varlen kernel takes."""
    assert cu.dtype == torch.int32 and cu.dim() == 1 and cu[0] == 0 and cu[-1] == total, cu
    lengths = cu.diff()
    assert (lengths > 0).all() and lengths.max() == max_len, (cu, max_len)
    return [slice(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]


class PackedMathKernel(MathKernel):
    """A varlen kernel with the math kernel's semantics: packed [T, h, d] rows, lse [h, T]; counts its calls."""

    name = "packed-math"
    use_varlen = True

    def __init__(self):
        self.varlen_calls = 0

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        assert q.dim() == 3 and q.is_contiguous() and k.is_contiguous()
        self.varlen_calls += 1
        out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0])
        for rows, cols in zip(_sequences(cu_q, max_q, q.shape[0]), _sequences(cu_k, max_k, k.shape[0]), strict=True):
            o, s = self.forward(q[None, rows], k[None, cols], v[None, cols], causal, scale)
            out[rows], lse[:, rows] = o[0], s[0]
        return out, lse

    def backward_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
        self.varlen_calls += 1
        grads = [torch.empty_like(t) for t in (q, k, v)]
        for rows, cols in zip(_sequences(cu_q, max_q, q.shape[0]), _sequences(cu_k, max_k, k.shape[0]), strict=True):
            for grad, part, where in zip(grads, self.backward(dout[None, rows], q[None, rows], k[None, cols],
                                                              v[None, cols], out[None, rows], lse[None, :, rows],
                                                              causal, scale), (rows, cols, cols), strict=True):
                grad[where] = part[0]
        return tuple(grads)


class ShiftedLseKernel(PackedMathKernel):
    """A varlen path whose log-sum-exp is read one row off (a kernel returning a padded lse would be)."""

    def forward_varlen(self, *args):
        out, lse = super().forward_varlen(*args)
        return out, lse.roll(1, dims=1)


def _blocks(seed: int = 0):
    """A step's blocks as the ring forms them: causal squares and prefix-shared rectangles, several batch rows."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, 64, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    rects = [(slice(0, 2), slice(0, 10), slice(0, 10), True), (slice(1, 2), slice(10, 40), slice(10, 40), True),
             (slice(0, 1), slice(40, 64), slice(0, 10), False), (slice(0, 1), slice(10, 40), slice(0, 10), False)]
    return [(q[b, r], k[b, c], v[b, c], causal) for b, r, c, causal in rects], dout, rects


def test_packed_blocks_match_per_block_computation():
    blocks, dout, rects = _blocks()
    kernel, math = PackedMathKernel(), MathKernel()
    results = forward_blocks(kernel, blocks, 0.3)
    assert kernel.varlen_calls == 2  # one per causal flag
    backward = []
    for (q, k, v, causal), (out, lse), (b, r, _, _) in zip(blocks, results, rects, strict=True):
        ref_out, ref_lse = math.forward(q, k, v, causal, 0.3)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse.to(lse.dtype))
        backward.append((dout[b, r], q, k, v, ref_out, ref_lse.float(), causal))
    for block, grads in zip(backward, backward_blocks(kernel, backward, 0.3), strict=True):
        for got, expected in zip(grads, math.backward(*block[:6], block[6], 0.3), strict=True):
            torch.testing.assert_close(got, expected)
    assert kernel.varlen_calls == 4


def test_a_kernel_without_a_checked_varlen_path_gets_one_call_per_block():
    blocks, _, _ = _blocks()
    kernel = PackedMathKernel()
    kernel.use_varlen = False
    forward_blocks(kernel, blocks, 0.3)
    assert kernel.varlen_calls == 0


def _documents_in_one_launch(rank, world_size):
    with using_kernel(PackedMathKernel()) as kernel:
        for mode in ("burst", "ring"):
            check_case(world_size, boundary_cases(world_size)["short docs"], True, (4, 2), torch.float32, mode)
            check_shared(world_size, *pair_rows(48 * world_size), mode)
    assert kernel.varlen_calls > 0


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_documents_in_one_launch_match_the_reference(world_size):
    if world_size == 1:
        _documents_in_one_launch(0, 1)
    else:
        run_on_ranks(_documents_in_one_launch, world_size)


def test_offsets_come_from_the_plans_rectangles(monkeypatch):
    """PyTorch's varlen flash op gets cu_seqlens that list the plan's rectangles of one block, row by row."""
    seq, boundaries = 48, [[0, 5, 20, 21, 48], [0, 30, 48]]
    plan = AttentionPlan(row_layouts("zigzag", boundaries, seq, 1, 2, None), True, boundaries)
    segments = plan(0, 0)
    captured = []

    def fake_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, *, scale=None):
        captured.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k, causal))
        out, lse = PackedMathKernel().forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        return out, lse, None, None, None

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake_forward)
    x = torch.randn(2, seq, 2, 8)
    kernel = TorchCUDAFlashKernel()
    kernel.use_varlen = True
    forward_blocks(kernel, [(x[s.batch, s.q_rows], x[s.batch, s.kv_rows], x[s.batch, s.kv_rows], s.causal)
                            for s in segments], 0.3)
    for causal in (True, False):
        rects = [(len(range(2)[s.batch]), s.q_rows.stop - s.q_rows.start, s.kv_rows.stop - s.kv_rows.start)
                 for s in segments if s.causal == causal]
        if len(rects) < 2:
            continue
        q_lengths = [q for n, q, _ in rects for _ in range(n)]
        k_lengths = [k for n, _, k in rects for _ in range(n)]
        expected = ([sum(q_lengths[:i]) for i in range(len(q_lengths) + 1)],
                    [sum(k_lengths[:i]) for i in range(len(k_lengths) + 1)], max(q_lengths), max(k_lengths), causal)
        assert expected in captured
    assert captured, "the plan's documents went to the kernel one call each"


def test_the_varlen_self_check_accepts_a_right_path_and_turns_a_wrong_one_off(caplog):
    assert varlen_self_check(PackedMathKernel(), CPU, torch.float32, 16, 2) is None
    problem = varlen_self_check(ShiftedLseKernel(), CPU, torch.float32, 16, 2)
    assert problem.startswith("varlen forward lse differs from the math kernel") and "\n" not in problem
    wrong = ShiftedLseKernel()
    with caplog.at_level(logging.WARNING, logger="burst.kernels"):
        enable_varlen(wrong, CPU, torch.float32, 16, 2, "flash")
    assert wrong.use_varlen is False
    assert [r.getMessage() for r in caplog.records] == [
        f"burst: attention kernel 'flash' takes documents one call each for float32 head_dim 16 GQA group 2: its "
        f"varlen path failed its self-check: {problem}"]
