"""A sliding window taken natively by the local kernels: one call per visible rectangle, whatever its size.

The CPU kernel's band path (strips of query rows inside one call) and FlashAttention's window offsets against a
float64 reference, on blocks along the diagonal, off it and at the window's edges; the plan's whole band segments
(one per rectangle, the rows the strips touch); the strips a kernel without a window still gets, exact; and the
kernel calls `burst bench attention --window` counts, which are the calls the ranks make."""

import random
from unittest import mock

import torch

import burst
import burst.operator
from bench.attention import AttentionBenchConfig
from bench.window import count_plan
from burst.kernels import TorchCPUKernel
from burst.kernels.contract import BottomRightCausal
from burst.kernels.cpu import band_strips
from burst.kernels.flash_attn import BandByWindow
from burst.layout import zigzag_layout
from burst.plan import ALL, AttentionPlan, Rows, band_segments
from tests.distributed import run_on_ranks
from tests.test_burst_attn import make_inputs
from tests.test_window import compare, reference, visible_mask

# (q_len, kv_len, band): row r of the block sees key c iff lo <= r - c <= hi
BLOCKS = {
    "a window of 40 along a diagonal": (300, 300, (0, 39)),
    "a window of 1": (200, 200, (0, 0)),
    "the keys just before the queries (the window's far edge)": (150, 150, (-149, 0)),
    "off the diagonal, cut on both sides": (130, 260, (-200, 25)),
    "more queries than keys": (400, 90, (-30, 330)),
    "a window as wide as the block": (100, 100, (0, 99)),
}


def band_reference(q, k, v, dout, band, scale):
    """float64 (out, lse, dq, dk, dv) of one block under a band, by autograd over the dense mask."""
    r, c = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
    visible = (r - c >= band[0]) & (r - c <= band[1])
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    kh, vh = (t.repeat_interleave(groups, 2).transpose(1, 2) for t in (kr, vr))
    scores = (qr.transpose(1, 2) @ kh.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = (torch.softmax(scores, -1) @ vh).transpose(1, 2)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad


def block_inputs(q_len: int, kv_len: int, seed: int):
    """q, k, v, dout as the ring passes them: row slices of heads-first shards, 4 query heads on 2 kv heads."""
    q, k, v, dout = make_inputs(max(q_len, kv_len) + 7, 4, 2, torch.float32, seed=seed, head_dim=8)
    q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))
    return q[:, 7:7 + q_len], k[:, 3:3 + kv_len], v[:, 3:3 + kv_len], dout[:, 7:7 + q_len]


def test_the_cpu_kernel_takes_a_whole_band_in_one_call():
    """forward_band and backward_band on bands of any size (strips of query rows inside the call, the keys they see
    each): out, lse and the gradients of the float64 reference, the backward given the row's lse and output."""
    kernel, scale = TorchCPUKernel(), 0.3
    for seed, (what, (q_len, kv_len, band)) in enumerate(BLOCKS.items()):
        q, k, v, dout = block_inputs(q_len, kv_len, seed)
        expected = band_reference(q, k, v, dout, band, scale)
        out, lse = kernel.forward_band(q, k, v, band, scale)
        grads = kernel.backward_band(dout, q, k, v, expected[0].float(), expected[1].float(), band, scale)
        compare([out, lse, *grads], expected, what)
        assert [g.dtype for g in grads] == [torch.float32] * 3
        if q_len >= 300:
            assert len(band_strips(q_len, kv_len, band)) > 1  # the strips are what this block checks


def test_the_cpu_strips_stay_small_and_cover_the_band():
    """Each strip's keys are those its queries see, so a strip computes at most (height + width - 1) / width of
    the pairs it sees: about 1.12x at a window of 512, its mask within 512 x (width + 511) entries."""
    strips = band_strips(4096, 4096, (0, 511))
    assert max(r.stop - r.start for r, _, _ in strips) == 64
    computed = sum((r.stop - r.start) * (c.stop - c.start) for r, c, _ in strips)
    assert computed <= 1.13 * sum(min(i + 1, 512) for i in range(4096))


class WindowedMath(BandByWindow, BottomRightCausal):
    """FlashAttention's calls as its documentation states them, in float64: causal and window_size (left, right)
    aligned bottom-right, key c seen by query r iff r + kv_len - q_len - left <= c <= r + kv_len - q_len + right."""

    def block_forward(self, q, k, v, causal, scale, window=(-1, -1)):
        q_len, kv_len = q.shape[1], k.shape[1]
        r, c = torch.arange(q_len)[:, None] + kv_len - q_len, torch.arange(kv_len)[None, :]
        left, right = (x if x >= 0 else q_len + kv_len for x in window)
        visible = (c >= r - left) & (c <= r + right) & ((c <= r) if causal else True)
        groups = q.shape[2] // k.shape[2]
        kh, vh = (t.double().repeat_interleave(groups, 2).transpose(1, 2) for t in (k, v))
        scores = (q.double().transpose(1, 2) @ kh.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
        return (torch.softmax(scores, -1) @ vh).transpose(1, 2), torch.logsumexp(scores, -1)


def test_flash_attention_window_offsets_fit_blocks_off_the_diagonal():
    """A band block given to a FlashAttention kernel (flash-attn, FA3, FA4: `BandByWindow`) as bottom-right window
    sizes sees exactly the band's keys, on and off the diagonal, with more queries or more keys."""
    for seed, (what, (q_len, kv_len, band)) in enumerate(BLOCKS.items()):
        q, k, v, dout = block_inputs(q_len, kv_len, seed)
        out, lse = WindowedMath().forward_band(q, k, v, band, 0.3)
        expected = band_reference(q, k, v, dout, band, 0.3)
        assert (out - expected[0]).abs().max() < 1e-12 and (lse - expected[1]).abs().max() < 1e-12, what


def test_whole_band_segments_cover_the_band_once_and_touch_the_strips_rows():
    """For a kernel taking the window, one segment per rectangle holds exactly its visible pairs, its rows and
    columns all seeing one; the rows it touches are those the strips touch (what travels is the same either way,
    so ranks whose kernels differ still agree)."""
    rng = random.Random(1)
    for _ in range(300):
        rows, cols, distance = rng.randint(1, 300), rng.randint(1, 300), rng.randint(-40, 700)
        window = rng.choice([rng.randint(1, 40), rng.randint(1, 400), rng.randint(100, 1200)])
        d = distance + torch.arange(rows)[:, None] - torch.arange(cols)[None, :]
        visible = (d >= 0) & (d < window)
        whole = band_segments(ALL, slice(0, rows), slice(0, cols), distance, True, window, whole=True)
        strips = band_segments(ALL, slice(0, rows), slice(0, cols), distance, True, window)
        assert len(whole) == int(visible.any())
        for s in whole:
            n_r, n_c = s.q_rows.stop - s.q_rows.start, s.kv_rows.stop - s.kv_rows.start
            r, c = torch.arange(n_r)[:, None], torch.arange(n_c)[None, :]
            lo, hi = s.band if s.band is not None else ((0, n_r) if s.causal else (-n_c, n_r))
            covered = torch.zeros(rows, cols, dtype=torch.bool)
            covered[s.q_rows, s.kv_rows] = (r - c >= lo) & (r - c <= hi)
            assert torch.equal(covered, visible), (rows, cols, distance, window)
            assert covered[s.q_rows, s.kv_rows].any(1).all() and covered[s.q_rows, s.kv_rows].any(0).all()
        for side in ("q_rows", "kv_rows"):
            assert Rows.union([getattr(s, side) for s in whole], 1000) == \
                Rows.union([getattr(s, side) for s in strips], 1000)


def test_a_kernel_without_a_window_gets_strips_and_stays_exact():
    """A kernel whose band path is off (PyTorch's cuDNN and memory-efficient ops take no window) gets the band in
    strips, its small band blocks computed by the math kernel: the float64 reference's results, with documents."""
    seq, window, boundaries = 400, 100, [[0, 150, 400], [0, 400]]
    q, k, v, dout = make_inputs(seq, 4, 2, torch.float32, seed=9, head_dim=8)
    expected = reference(q, k, v, dout, [visible_mask(seq, window, b) for b in boundaries])
    kernel = TorchCPUKernel()
    kernel.use_band = False
    with mock.patch.object(burst.operator, "select_kernel", lambda *args, **kwargs: kernel):
        lq, lk, lv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = burst.local_attn(lq, lk, lv, window=window, return_lse=True,
                                    doc_boundaries=[torch.tensor(b) for b in boundaries])
        out.backward(dout)
    compare([out.detach(), lse, lq.grad, lk.grad, lv.grad], expected, "strips")


class CountingKernel:
    """The CPU kernel, counting the calls the ring makes of the kernel interface (forward or forward_band, backward
    or backward_band); the calls the kernel makes inside them are its own."""

    def __init__(self, kernel):
        self.kernel, self.name, self.contract = kernel, kernel.name, kernel.contract
        self.use_band, self.calls = kernel.use_band, {"forward": 0, "backward": 0}

    def _count(self, direction, call, *args):
        self.calls[direction] += 1
        return call(*args)

    def forward(self, *args):
        return self._count("forward", self.kernel.forward, *args)

    def forward_band(self, *args):
        return self._count("forward", self.kernel.forward_band, *args)

    def backward(self, *args):
        return self._count("backward", self.kernel.backward, *args)

    def backward_band(self, *args):
        return self._count("backward", self.kernel.backward_band, *args)


SEQ, WINDOW = 1024, 50


def _count_calls(rank, world_size, counted):
    """Each rank's kernel calls in forward and in backward ("ring": its own queries' calls) against the bench's."""
    real = burst.select_kernel(torch.device("cpu"), torch.float32, "cpu", head_dim=8)
    assert real.use_band  # its band path passed its self-check: it takes the window natively
    kernel = CountingKernel(real)
    q, k, v, dout = (burst.shard_sequence(t) for t in make_inputs(SEQ, 2, 2, torch.float32, batch=1, head_dim=8))
    q.requires_grad_()
    with mock.patch.object(burst.operator, "select_kernel", lambda *args, **kwargs: kernel):
        burst.burst_attn(q, k, v, window=WINDOW, backward="ring", kernel="cpu").backward(dout)
    assert kernel.calls == {"forward": counted[rank], "backward": counted[rank]}, (rank, kernel.calls)


def test_the_bench_counts_the_calls_the_ranks_make():
    config = AttentionBenchConfig(nproc=4, seq_len=SEQ, heads=2, head_dim=8, dtype="fp32", window=WINDOW,
                                  modes=["ring"])
    plan = AttentionPlan([zigzag_layout(SEQ, 4)], True, None, window=WINDOW)
    counted = [rank.calls for rank in count_plan(plan, config, "ring")]
    # zigzag, chunks of 128 under a window of 50: a chunk against itself and against the chunk before it, rank 3
    # holding chunks 3 and 4 as one stretch (and rank 0 chunk 0, with nothing before it)
    assert counted == [3, 4, 4, 2]
    run_on_ranks(_count_calls, 4, args=(counted,))
