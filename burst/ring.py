"""BurstAttention's forward and backward passes along a `Schedule` (burst/topology.py).

Shapes (per rank, each holding its zigzag shard of `shard_len` tokens):
    q, dout, out  [batch, shard_len, q_heads, head_dim]
    k, v          [batch, shard_len, kv_heads, head_dim]
    lse, delta    [batch, q_heads, shard_len]  float32

One loop, `circulate`, serves both passes and every topology. A *visitor* packet tours the
ranks while the *home* tensors stay put; in backward the visitor's gradient accumulates in
float32 as it travels behind it and ends at its owner. Forward: the visitor is K/V and each
rank merges block results into a float32 (out, lse) by log-sum-exp; nothing travels back.

    "burst" (the paper's): visitor = (q, dout, lse, delta); home = k, v, dk, dv.
    "ring":                visitor = (k, v);               home = q, dout, out, lse, dq.

Kernel calls take row slices of these tensors. Slices of [b, s, h, d] tensors keep a contiguous
last dimension, which is all the kernels need of them; an lse slice [b, h, rows] is not dense,
and flash-attn reads lse as a dense buffer, so it is copied at the call (rows floats per head,
cheap) to meet the kernels' contract (burst/kernels.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from burst.comm import Pending
from burst.kernels import AttentionKernel
from burst.plan import AttentionPlan
from burst.topology import Schedule


def as_result(accumulator: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 accumulator as a contiguous [b, s, h, d] result in `dtype`, converted in one pass.

    Contiguous, whatever the accumulator's memory layout: autograd would otherwise copy a
    gradient whose strides differ from its input's, and the model reshapes the output.
    """
    if accumulator.dtype == dtype:  # `to` would return it as it is, strides and all
        return accumulator.contiguous()
    return accumulator.to(dtype, memory_format=torch.contiguous_format)


# Merge and delta work on float32 copies of blocks held in a lower precision. They are made a
# group of heads at a time, each copy at most this many bytes (or one head, if a head is larger):
# a bounded temporary, and a number of tensor ops (one kernel launch each on a GPU) that does
# not grow with the head count.
FLOAT32_TEMPORARY_BYTES = 64 * 2**20


def head_groups(x: torch.Tensor) -> list[slice]:
    """Slices of the heads of x [b, s, h, d] whose float32 copy fits `FLOAT32_TEMPORARY_BYTES`."""
    batch, seq, heads, dim = x.shape
    per_head = batch * seq * dim * 4
    size = max(1, min(heads, FLOAT32_TEMPORARY_BYTES // max(per_head, 1)))
    return [slice(start, start + size) for start in range(0, heads, size)]


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running float32 (out, lse), in place.

    out [b, s, h, d] float32, lse [b, h, s] float32 (views into the accumulators are fine).
    Stable forms: out += sigmoid(lse_blk - lse) * (out_blk - out); lse = logaddexp(lse, lse_blk).
    Rows that have seen no key yet hold lse = -inf; a block that is fully masked for a row
    (lse_blk = -inf) leaves it unchanged.
    """
    weight = torch.sigmoid(block_lse - lse).nan_to_num_(0.0).transpose(1, 2).unsqueeze(-1)  # [b, s, h, 1]
    for heads in head_groups(block_out):  # one group unless the float32 copy would pass the budget
        out[:, :, heads].lerp_(block_out[:, :, heads].float(), weight[:, :, heads])
    lse.copy_(torch.logaddexp(lse, block_lse))


def ring_forward(schedule: Schedule, kernel: AttentionKernel, plan: AttentionPlan, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse float32) of this rank's queries against the whole sequence."""
    batch, shard_len, q_heads, _ = q.shape
    out = torch.zeros_like(q, dtype=torch.float32)
    lse = torch.full((batch, q_heads, shard_len), float("-inf"), dtype=torch.float32, device=q.device)

    def step(kv: list[torch.Tensor], owner: int) -> GradPieces:
        for seg in plan(schedule.rank, owner):
            block_out, block_lse = kernel.forward(q[seg.batch, seg.q_rows], kv[0][seg.batch, seg.kv_rows],
                                                  kv[1][seg.batch, seg.kv_rows], seg.causal, scale)
            merge_block(out[seg.batch, seg.q_rows], lse[seg.batch, :, seg.q_rows], block_out, block_lse)
        return []

    circulate(schedule, [k, v], 0, step)
    return as_result(out, q.dtype), lse


# step(visitor, owner) -> [(batch rows, sequence rows, gradients of the visitor there), ...];
# it accumulates the home gradients itself.
GradPieces = list[tuple[slice, slice, list[torch.Tensor]]]
StepFn = Callable[[list[torch.Tensor], int], GradPieces]


def circulate(schedule: Schedule, visitor: list[torch.Tensor], num_grads: int, step: StepFn) -> list[torch.Tensor]:
    """Tour `visitor` along `schedule`, calling `step` at every stop; return the float32
    gradients of this rank's own visitor (shaped like visitor[:num_grads]), summed over ranks.

    Inside a round (a node's tour) a gradient travels one step behind its visitor: computed
    at step s, it arrives at the next rank during step s + 1 and leaves at the start of step
    s + 2. The round's first stop (the entry rank) keeps its share, and the rest arrives back
    at it one hop after the round's last step: the tour's sum. The owner's tour sum is its own
    (round 0); every later node's is added to the previous nodes' and passed on to the next
    node's entry rank over `outer`, so the sum of rounds 1..I-1 reaches the owner after the
    last one, having crossed I - 1 node boundaries, each hop hidden behind a whole round.
    One round (flat, ulysses): today's ring, W - 1 hops for a visitor and for its gradient.
    """
    rounds, steps = schedule.rounds, schedule.steps
    grad_like, f32 = visitor[:num_grads], [torch.float32] * num_grads

    def zeros() -> list[torch.Tensor]:
        return [torch.zeros_like(t, dtype=torch.float32) for t in grad_like]

    def finish_tour(round_: int, arrived: list[torch.Tensor], chain: Pending) -> Pending:
        """Add the tour's returning part (none for a one-stop tour) to its entry share; pass the sum
        on unless it is the owner's."""
        if arrived:
            for acc, grad in zip(entry, arrived, strict=True):
                acc += grad
        if round_ == 0:
            return chain  # `entry` is `own`
        if round_ > 1:
            for acc, grad in zip(entry, chain.wait(), strict=True):
                acc += grad
        return schedule.outer.exchange(entry, grad_like, f32)  # receives the next visitor's sum so far

    own = zeros()
    entry, traveling = own, []  # this round's entry share; the gradient computed at the last step
    chain = next_round = Pending()  # the previous nodes' gradient sum; the next round's first visitor
    for round_ in range(rounds):
        for s in range(steps):
            if s == 0 and round_ + 1 < rounds:
                next_round = schedule.outer.exchange(visitor, visitor)  # overlaps the whole round
            passing = visitor if s + 1 < steps else []
            pending = schedule.inner.exchange(passing + traveling, passing + (grad_like if traveling else []),
                                              [x.dtype for x in passing] + (f32 if traveling else []))
            pieces = step(visitor, schedule.owner(round_, s))
            received = pending.wait()
            next_visitor, arrived = received[:len(passing)], received[len(passing):]
            if s == 0:
                if arrived:  # the previous round's tour is back at its entry rank
                    chain = finish_tour(round_ - 1, arrived, chain)
                entry = own if round_ == 0 else zeros()
                target = entry
            else:
                target = arrived or zeros()
            for batch, rows, grads in pieces:
                for acc, grad in zip(target, grads, strict=True):
                    acc[batch, rows] += grad
            traveling = target if s > 0 else []
            if steps == 1:  # a tour of one stop is complete at once
                chain = finish_tour(round_, [], chain)
            visitor = next_visitor or (next_round.wait() if round_ + 1 < rounds else visitor)
    if traveling:
        chain = finish_tour(rounds - 1, schedule.inner.exchange(traveling, grad_like, f32).wait(), chain)
    if rounds > 1:
        for acc, grad in zip(own, chain.wait(), strict=True):
            acc += grad
    return own


def output_with_delta(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A stand-in O' with rowsum(dout * O') = delta, for kernels that take O to form delta.

    dout [b, s, h, d], delta [b, h, s] -> [b, s, h, d] in dout's dtype. O' = dout * delta /
    rowsum(dout^2): the products dout * O' share one sign, so the kernel's float32 row sum
    has no cancellation. Rows with dout = 0 have delta = 0 and get O' = 0.
    """
    norm = torch.linalg.vector_norm(dout, dim=-1, dtype=torch.float32).square_()  # [b, s, h]
    factor = torch.where(norm > 0, delta.transpose(1, 2) / norm, torch.zeros_like(norm))
    # multiplied in float32 element by element and stored in dout's dtype: no float32 copy of dout
    return torch.mul(dout, factor.unsqueeze(-1), out=torch.empty_like(dout))


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """rowsum(a * b) in float32: [b, s, h, d] x2 -> [b, h, s], in head groups so that the float32
    temporaries stay within `FLOAT32_TEMPORARY_BYTES`."""
    result = torch.empty(a.shape[0], a.shape[2], a.shape[1], dtype=torch.float32, device=a.device)  # [b, h, s]
    for heads in head_groups(a):
        torch.sum(a[:, :, heads].float() * b[:, :, heads].float(), dim=-1, out=result.transpose(1, 2)[:, :, heads])
    return result


def burst_backward(schedule: Schedule, kernel: AttentionKernel, plan: AttentionPlan, dout, q, k, v, out, lse,
                   scale: float):
    """The paper's backward: K, V and their gradients stay home; Q, dO, lse, delta travel."""
    delta = row_dot(dout, out)  # [b, h, s]
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)

    def step(visitor: list[torch.Tensor], owner: int) -> GradPieces:
        vq, vdout, vlse, vdelta = visitor
        pieces = []
        for seg in plan(owner, schedule.rank):
            b, rows, cols = seg.batch, seg.q_rows, seg.kv_rows
            vout = out[b, rows] if owner == schedule.rank else output_with_delta(vdout[b, rows], vdelta[b, :, rows])
            dq_blk, dk_blk, dv_blk = kernel.backward(vdout[b, rows], vq[b, rows], k[b, cols], v[b, cols], vout,
                                                     vlse[b, :, rows].contiguous(), seg.causal, scale)
            dk[b, cols] += dk_blk
            dv[b, cols] += dv_blk
            pieces.append((b, rows, [dq_blk]))
        return pieces

    (dq,) = circulate(schedule, [q, dout, lse, delta], 1, step)
    return as_result(dq, q.dtype), as_result(dk, k.dtype), as_result(dv, v.dtype)


def ring_backward(schedule: Schedule, kernel: AttentionKernel, plan: AttentionPlan, dout, q, k, v, out, lse,
                  scale: float):
    """Ring attention's backward: Q, dO and dQ stay home; K, V travel, dK, dV follow them."""
    dq = torch.zeros_like(q, dtype=torch.float32)

    def step(visitor: list[torch.Tensor], owner: int) -> GradPieces:
        vk, vv = visitor
        pieces = []
        for seg in plan(schedule.rank, owner):
            b, rows, cols = seg.batch, seg.q_rows, seg.kv_rows
            dq_blk, dk_blk, dv_blk = kernel.backward(dout[b, rows], q[b, rows], vk[b, cols], vv[b, cols], out[b, rows],
                                                     lse[b, :, rows].contiguous(), seg.causal, scale)
            dq[b, rows] += dq_blk
            pieces.append((b, cols, [dk_blk, dv_blk]))
        return pieces

    dk, dv = circulate(schedule, [k, v], 2, step)
    return as_result(dq, q.dtype), as_result(dk, k.dtype), as_result(dv, v.dtype)
