"""BurstAttention's forward and backward passes over a ring of ranks.

Shapes (per rank, each holding its zigzag shard of `shard_len` tokens):
    q, dout, out  [batch, shard_len, q_heads, head_dim]
    k, v          [batch, shard_len, kv_heads, head_dim]
    lse, delta    [batch, q_heads, shard_len]  float32

Forward: K/V circulate; each rank merges block results into a float32 (out, lse) by
log-sum-exp. Backward: one loop, `circulate`, serves both modes. A *visitor* packet tours
the ring while the *home* tensors stay put; the visitor's gradient accumulates in float32 as
it travels one step behind it and ends at its owner.

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

from burst.comm import Ring
from burst.kernels import AttentionKernel
from burst.plan import AttentionPlan


def as_result(accumulator: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 accumulator as a contiguous [b, s, h, d] result in `dtype`, converted in one pass.

    Contiguous, whatever the accumulator's memory layout: autograd would otherwise copy a
    gradient whose strides differ from its input's, and the model reshapes the output.
    """
    return accumulator.to(dtype, memory_format=torch.contiguous_format)


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running float32 (out, lse), in place.

    out [b, s, h, d] float32, lse [b, h, s] float32 (views into the accumulators are fine).
    Stable forms: out += sigmoid(lse_blk - lse) * (out_blk - out); lse = logaddexp(lse, lse_blk).
    Rows that have seen no key yet hold lse = -inf; a block that is fully masked for a row
    (lse_blk = -inf) leaves it unchanged.
    """
    weight = torch.sigmoid(block_lse - lse).nan_to_num_(0.0)  # [b, h, s]; nan only when both are -inf
    for h in range(out.shape[2]):  # a head at a time: the float32 copy of the block is 1/heads the size
        out[:, :, h].lerp_(block_out[:, :, h].float(), weight[:, h].unsqueeze(-1))
    lse.copy_(torch.logaddexp(lse, block_lse))


def ring_forward(ring: Ring, kernel: AttentionKernel, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse float32) of this rank's queries against the whole sequence."""
    batch, shard_len, q_heads, _ = q.shape
    out = torch.zeros_like(q, dtype=torch.float32)
    lse = torch.full((batch, q_heads, shard_len), float("-inf"), dtype=torch.float32, device=q.device)
    kv = [k, v]
    for step in range(ring.world_size):
        last = step + 1 == ring.world_size
        pending = ring.exchange([] if last else kv, [] if last else kv)  # next block in flight
        for seg in plan(ring.rank, (ring.rank - step) % ring.world_size):
            block_out, block_lse = kernel.forward(q[seg.batch, seg.q_rows], kv[0][seg.batch, seg.kv_rows],
                                                  kv[1][seg.batch, seg.kv_rows], seg.causal, scale)
            merge_block(out[seg.batch, seg.q_rows], lse[seg.batch, :, seg.q_rows], block_out, block_lse)
        kv = pending.wait() or kv
    return as_result(out, q.dtype), lse


# step(visitor, owner) -> [(batch rows, sequence rows, gradients of the visitor there), ...];
# it accumulates the home gradients itself.
GradPieces = list[tuple[slice, slice, list[torch.Tensor]]]
StepFn = Callable[[list[torch.Tensor], int], GradPieces]


def circulate(ring: Ring, visitor: list[torch.Tensor], num_grads: int, step: StepFn) -> list[torch.Tensor]:
    """Tour `visitor` round the ring, calling `step` at every rank; return the float32
    gradients of this rank's own visitor (shaped like visitor[:num_grads]), summed over ranks.

    At step t the packet of rank (r - t) is here. Its gradient so far was computed one rank
    back at step t - 1, so it arrives during step t and leaves at the start of step t + 1;
    after the last step it is one hop from its owner. The owner's own contribution never
    travels, so a gradient makes W - 1 hops in all.
    """
    world, grad_like = ring.world_size, visitor[:num_grads]
    f32 = [torch.float32] * num_grads
    own = [torch.zeros_like(t, dtype=torch.float32) for t in grad_like]
    traveling: list[torch.Tensor] = []
    for t in range(world):
        forward_visitor = t + 1 < world
        outgoing = (visitor if forward_visitor else []) + (traveling if t >= 2 else [])
        incoming = (visitor if forward_visitor else []) + (grad_like if t >= 2 else [])
        dtypes = [x.dtype for x in (visitor if forward_visitor else [])] + (f32 if t >= 2 else [])
        pending = ring.exchange(outgoing, incoming, dtypes)
        pieces = step(visitor, (ring.rank - t) % world)
        received = pending.wait()
        split = len(visitor) if forward_visitor else 0
        next_visitor, arrived = received[:split], received[split:]
        if t == 0:
            target = own
        else:
            target = arrived or [torch.zeros_like(x, dtype=torch.float32) for x in grad_like]
            traveling = target
        for batch, rows, grads in pieces:
            for acc, grad in zip(target, grads, strict=True):
                acc[batch, rows] += grad
        visitor = next_visitor or visitor
    if world > 1:
        for acc, grad in zip(own, ring.exchange(traveling, grad_like, f32).wait(), strict=True):
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
    """rowsum(a * b) in float32: [b, s, h, d] x2 -> [b, h, s], one head at a time so that the
    float32 temporaries stay 1/heads of the inputs' size."""
    heads = [(a[:, :, h].float() * b[:, :, h].float()).sum(-1) for h in range(a.shape[2])]  # [b, s] each
    return torch.stack(heads, dim=1)


def burst_backward(ring: Ring, kernel: AttentionKernel, plan: AttentionPlan, dout, q, k, v, out, lse, scale: float):
    """The paper's backward: K, V and their gradients stay home; Q, dO, lse, delta travel."""
    delta = row_dot(dout, out)  # [b, h, s]
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)

    def step(visitor: list[torch.Tensor], owner: int) -> GradPieces:
        vq, vdout, vlse, vdelta = visitor
        pieces = []
        for seg in plan(owner, ring.rank):
            b, rows, cols = seg.batch, seg.q_rows, seg.kv_rows
            vout = out[b, rows] if owner == ring.rank else output_with_delta(vdout[b, rows], vdelta[b, :, rows])
            dq_blk, dk_blk, dv_blk = kernel.backward(vdout[b, rows], vq[b, rows], k[b, cols], v[b, cols], vout,
                                                     vlse[b, :, rows].contiguous(), seg.causal, scale)
            dk[b, cols] += dk_blk
            dv[b, cols] += dv_blk
            pieces.append((b, rows, [dq_blk]))
        return pieces

    (dq,) = circulate(ring, [q, dout, lse, delta], 1, step)
    return as_result(dq, q.dtype), as_result(dk, k.dtype), as_result(dv, v.dtype)


def ring_backward(ring: Ring, kernel: AttentionKernel, plan: AttentionPlan, dout, q, k, v, out, lse, scale: float):
    """Ring attention's backward: Q, dO and dQ stay home; K, V travel, dK, dV follow them."""
    dq = torch.zeros_like(q, dtype=torch.float32)

    def step(visitor: list[torch.Tensor], owner: int) -> GradPieces:
        vk, vv = visitor
        pieces = []
        for seg in plan(ring.rank, owner):
            b, rows, cols = seg.batch, seg.q_rows, seg.kv_rows
            dq_blk, dk_blk, dv_blk = kernel.backward(dout[b, rows], q[b, rows], vk[b, cols], vv[b, cols], out[b, rows],
                                                     lse[b, :, rows].contiguous(), seg.causal, scale)
            dq[b, rows] += dq_blk
            pieces.append((b, cols, [dk_blk, dv_blk]))
        return pieces

    dk, dv = circulate(ring, [k, v], 2, step)
    return as_result(dq, q.dtype), as_result(dk, k.dtype), as_result(dv, v.dtype)
