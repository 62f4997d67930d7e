"""burst_attn against a float64 single-process reference, on 1-4 gloo ranks."""

import pytest
import torch
import torch.distributed as dist

import burst
from burst.attention import input_signature
from burst.cost import backward_bytes_per_hop, plan_bytes
from burst.layout import zigzag_layout
from burst.plan import AttentionPlan
from tests.distributed import run_on_ranks

# max |error| allowed against float64, for inputs ~ N(0, 1)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 4e-2}


def reference(q, k, v, dout, causal):
    """float64 attention over the whole sequence: out, lse, dq, dk, dv."""
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    qh = qr.transpose(1, 2)
    kh, vh = (t.repeat_interleave(groups, 2).transpose(1, 2) for t in (kr, vr))
    scores = qh @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = (torch.softmax(scores, -1) @ vh).transpose(1, 2)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad


def make_inputs(seq, q_heads, kv_heads, dtype, seed=0, batch=2, head_dim=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, q_heads, head_dim, generator=g)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=g)
    v = torch.randn(batch, seq, kv_heads, head_dim, generator=g)
    dout = torch.randn(batch, seq, q_heads, head_dim, generator=g)
    return [t.to(dtype) for t in (q, k, v, dout)]


CASES = [(causal, heads, dtype, mode)
         for causal in (True, False)
         for heads in ((4, 4), (4, 2))
         for dtype in (torch.float32, torch.bfloat16)
         for mode in ("burst", "ring")]


def check_against_reference(world_size, causal, heads, dtype, mode, kernel="auto"):
    seq = 2 * world_size * 12
    q, k, v, dout = make_inputs(seq, *heads, dtype)
    expected = reference(q, k, v, dout, causal)
    lq, lk, lv = (burst.shard_sequence(t).requires_grad_() for t in (q, k, v))
    out, lse = burst.burst_attn(lq, lk, lv, causal=causal, backward=mode, kernel=kernel, return_lse=True)
    assert out.dtype == dtype and out.shape == lq.shape and lse.dtype == torch.float32
    out.backward(burst.shard_sequence(dout))
    got = [burst.gather_sequence(t) for t in (out.detach(), lse, lq.grad, lk.grad, lv.grad)]
    got[1] = burst.gather_sequence(lse, dim=2)
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        err = (g.double() - e).abs().max().item()
        assert err <= TOLERANCE[dtype], f"{name}: max error {err:.2e} (world {world_size}, {causal=}, {heads=}, " \
                                        f"{dtype}, {mode})"
    return lq, lk


def check_bytes(world_size, q, k, causal, mode):
    """Every block in full without a causal mask; with one, the rows the plan's calls touch: under zigzag
    half a block where the queries see only the earlier of the block's two chunks, and so on."""
    hops, rank = world_size - 1, dist.get_rank()
    agreement = hops * len(input_signature(q, k, k, True, mode, "auto", None)) * 8  # the int64 all-gather
    plan = AttentionPlan([zigzag_layout(q.shape[1] * world_size, world_size)] * q.shape[0], causal, None)
    forward, _, backward, _ = plan_bytes(plan, "flat", q, k, mode, world_size, rank)
    assert burst.SENT.last_forward == forward + agreement
    assert burst.SENT.last_backward == backward
    if not causal:
        assert forward == hops * 2 * k.numel() * k.element_size()
        assert backward == hops * backward_bytes_per_hop(q, k, mode)
    elif rank == 0 < hops:  # the later ranks' queries see only the first of rank 0's two chunks
        assert forward == hops * k.numel() * k.element_size()


def _all_cases(rank, world_size):
    for case in CASES:
        lq, lk = check_against_reference(world_size, *case)
        check_bytes(world_size, lq, lk, case[0], case[-1])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matches_float64_reference_on_ranks(world_size):
    run_on_ranks(_all_cases, world_size)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_float64_reference_single_process(case):
    check_against_reference(1, *case)
    assert burst.SENT.last_forward == 0 and burst.SENT.last_backward == 0


def _math_kernel(rank, world_size):
    check_against_reference(world_size, True, (4, 2), torch.float32, "burst", kernel="math")
    check_against_reference(world_size, False, (4, 4), torch.float32, "ring", kernel="math")


def test_math_kernel_on_ranks():
    run_on_ranks(_math_kernel, 3)


def test_auto_picks_the_cheaper_side():
    q = torch.empty(1, 8, 8, 64, dtype=torch.bfloat16)
    assert burst.choose_backward(q, torch.empty(1, 8, 8, 64, dtype=torch.bfloat16), "auto") == "burst"
    assert burst.choose_backward(q, torch.empty(1, 8, 4, 64, dtype=torch.bfloat16), "auto") == "ring"
    assert burst.choose_backward(q, torch.empty(1, 8, 2, 64, dtype=torch.bfloat16), "auto") == "ring"
    assert burst.choose_backward(q, torch.empty(1, 8, 2, 64, dtype=torch.bfloat16), "burst") == "burst"


def bad_inputs():
    ok = torch.zeros(1, 8, 4, 16)
    return [
        ((torch.zeros(1, 7, 4, 16),) * 3, {}, "multiple of 2 x world"),
        ((torch.zeros(1, 0, 4, 16),) * 3, {}, "multiple of 2 x world"),
        ((ok, torch.zeros(1, 8, 3, 16), torch.zeros(1, 8, 3, 16)), {}, "multiple of kv heads"),
        ((ok, ok, torch.zeros(1, 8, 2, 16)), {}, "same shape"),
        ((ok, torch.zeros(1, 4, 4, 16), torch.zeros(1, 4, 4, 16)), {}, "must agree"),
        ((ok, ok.bfloat16(), ok.bfloat16()), {}, "share one dtype"),
        ((torch.zeros(8, 4, 16), ok, ok), {}, "must be \\[batch"),
        ((ok, ok, ok), {"backward": "sideways"}, "unknown backward mode"),
        ((ok, ok, ok), {"kernel": "cuda-magic"}, "unknown attention kernel"),
    ]


def _bad_inputs_raise(rank, world_size):
    for args, kwargs, message in bad_inputs():
        with pytest.raises(ValueError, match=message):
            burst.burst_attn(*args, **kwargs)
    dist.barrier()  # every rank raised and none is stuck in a send


def test_bad_inputs_raise_on_every_rank():
    run_on_ranks(_bad_inputs_raise, 2, timeout_s=30)


def disagreeing_inputs(rank):
    """(args, kwargs, expected message) where the ranks' inputs differ."""
    x, shorter = torch.zeros(1, 8, 4, 16), torch.zeros(1, 4, 4, 16)
    odd = torch.zeros(1, 7, 4, 16)  # invalid on rank 1 only: it must not raise alone and leave rank 0 waiting
    return [
        ((x,) * 3 if rank == 0 else (shorter,) * 3, {}, r"q shape: rank 0 \[1, 8, 4, 16\], rank 1 \[1, 4"),
        ((x,) * 3 if rank == 0 else (odd,) * 3, {}, "q shape"),
        ((x,) * 3, {"causal": rank == 0}, "causal: rank 0 True, rank 1 False"),
        ((x.double(),) * 3 if rank else (x,) * 3, {}, "dtypes: rank 0 float32/float32/float32, rank 1 float64"),
        ((x,) * 3, {"backward": "burst" if rank else "ring"}, "backward: rank 0 ring, rank 1 burst"),
        ((x,) * 3, {"doc_boundaries": [[0, 5 + rank, 16]]}, "doc_boundaries: rank 0 fingerprint"),
    ]


def _disagreement_raises(rank, world_size):
    for args, kwargs, message in disagreeing_inputs(rank):
        with pytest.raises(ValueError, match="different inputs on the ranks") as raised:
            burst.burst_attn(*args, **kwargs)
        assert raised.match(message)
    same = torch.randn(1, 8, 4, 16)
    burst.burst_attn(same, same, same, doc_boundaries=[torch.tensor([0, 5, 16])])  # agreeing ranks still run
    dist.barrier()


def test_ranks_that_disagree_get_the_same_error_not_a_hang():
    run_on_ranks(_disagreement_raises, 2, timeout_s=60)


def test_autocast_does_not_lower_the_reference_kernel_precision():
    q, k, v, dout = make_inputs(32, 4, 2, torch.float32)
    expected = reference(q, k, v, dout, True)
    q.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = burst.burst_attn(q, k, v, kernel="math")
    out.backward(dout)
    assert out.dtype == torch.float32
    assert (out.double() - expected[0]).abs().max() < TOLERANCE[torch.float32]
    assert (q.grad.double() - expected[2]).abs().max() < TOLERANCE[torch.float32]


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_kernel_folding_is_bit_identical_to_the_plain_op_call(kv_heads, causal):
    """The CPU kernel folds kv heads into the batch for speed; on the chunk views the ring
    passes (rows of heads-first memory, batch 2) it must give exactly the plain op's results."""
    from burst.kernels import TorchCPUKernel
    from burst.operator import heads_first

    ops = torch.ops.aten
    torch.manual_seed(0)
    q, dout = (heads_first(torch.randn(2, 512, 4, 32, dtype=torch.bfloat16))[:, 256:] for _ in range(2))
    k, v = (heads_first(torch.randn(2, 512, kv_heads, 32, dtype=torch.bfloat16))[:, 256:] for _ in range(2))
    seq_major_to_op = lambda *ts: [t.transpose(1, 2) for t in ts]  # noqa: E731
    out, lse = ops._scaled_dot_product_flash_attention_for_cpu(*seq_major_to_op(q, k, v), 0.0, causal, scale=0.2)
    grads = ops._scaled_dot_product_flash_attention_for_cpu_backward(
        *seq_major_to_op(dout, q, k, v), out, lse, 0.0, causal, scale=0.2)

    kernel = TorchCPUKernel()
    got_out, got_lse = kernel.forward(q, k, v, causal, 0.2)
    got_grads = kernel.backward(dout, q, k, v, out.transpose(1, 2), lse, causal, 0.2)
    assert torch.equal(got_out, out.transpose(1, 2)) and torch.equal(got_lse, lse)
    for got, expected in zip(got_grads, grads, strict=True):
        assert got.shape == expected.transpose(1, 2).shape
        assert torch.equal(got, expected.transpose(1, 2))
