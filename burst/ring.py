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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from burst.comm import Ring
from burst.kernels import AttentionKernel
from burst.layout import block_for


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running float32 (out, lse), in place.

    out [b, s, h, d] float32, lse [b, h, s] float32 (views into the accumulators are fine).
    Stable forms: out += sigmoid(lse_blk - lse) * (out_blk - out); lse = logaddexp(lse, lse_blk).
    Rows that have seen no key yet hold lse = -inf; a block that is fully masked for a row
    (lse_blk = -inf) leaves it unchanged.
    """
    weight = torch.sigmoid(block_lse - lse).nan_to_num_(0.0)  # [b, h, s]; nan only when both are -inf
    out.sub_(weight.transpose(1, 2).unsqueeze(-1) * (out - block_out.float()))
    lse.copy_(torch.logaddexp(lse, block_lse))


def ring_forward(ring: Ring, kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse float32) of this rank's queries against the whole sequence."""
    batch, shard_len, q_heads, _ = q.shape
    out = torch.zeros_like(q, dtype=torch.float32)
    lse = torch.full((batch, q_heads, shard_len), float("-inf"), dtype=torch.float32, device=q.device)
    kv = [k, v]
    for step in range(ring.world_size):
        last = step + 1 == ring.world_size
        pending = ring.exchange([] if last else kv, [] if last else kv)  # next block in flight
        block = block_for(ring.rank, (ring.rank - step) % ring.world_size, shard_len, causal)
        block_out, block_lse = kernel.forward(q[:, block.q_rows], kv[0][:, block.kv_rows],
                                              kv[1][:, block.kv_rows], block.causal, scale)
        merge_block(out[:, block.q_rows], lse[..., block.q_rows], block_out, block_lse)
        kv = pending.wait() or kv
    return out.to(q.dtype), lse


# step(visitor, owner) -> (rows of the visitor that got gradients, those gradients); it
# accumulates the home gradients itself.
StepFn = Callable[[list[torch.Tensor], int], tuple[slice, list[torch.Tensor]]]


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
        rows, grads = step(visitor, (ring.rank - t) % world)
        received = pending.wait()
        split = len(visitor) if forward_visitor else 0
        next_visitor, arrived = received[:split], received[split:]
        if t == 0:
            target = own
        else:
            target = arrived or [torch.zeros_like(x, dtype=torch.float32) for x in grad_like]
            traveling = target
        for acc, grad in zip(target, grads, strict=True):
            acc[:, rows] += grad
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
    d32 = dout.float()
    norm = (d32 * d32).sum(-1)  # [b, s, h]
    factor = torch.where(norm > 0, delta.transpose(1, 2) / norm, torch.zeros_like(norm))
    return (d32 * factor.unsqueeze(-1)).to(dout.dtype)


def burst_backward(ring: Ring, kernel: AttentionKernel, dout, q, k, v, out, lse, causal: bool, scale: float):
    """The paper's backward: K, V and their gradients stay home; Q, dO, lse, delta travel."""
    shard_len = q.shape[1]
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [b, h, s]
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)

    def step(visitor: list[torch.Tensor], owner: int) -> tuple[slice, list[torch.Tensor]]:
        vq, vdout, vlse, vdelta = visitor
        block = block_for(owner, ring.rank, shard_len, causal)
        rows, cols = block.q_rows, block.kv_rows
        vout = out[:, rows] if owner == ring.rank else output_with_delta(vdout[:, rows], vdelta[..., rows])
        dq_blk, dk_blk, dv_blk = kernel.backward(vdout[:, rows], vq[:, rows], k[:, cols], v[:, cols], vout,
                                                 vlse[..., rows], block.causal, scale)
        dk[:, cols] += dk_blk
        dv[:, cols] += dv_blk
        return rows, [dq_blk]

    (dq,) = circulate(ring, [q, dout, lse, delta], 1, step)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def ring_backward(ring: Ring, kernel: AttentionKernel, dout, q, k, v, out, lse, causal: bool, scale: float):
    """Ring attention's backward: Q, dO and dQ stay home; K, V travel, dK, dV follow them."""
    shard_len = q.shape[1]
    dq = torch.zeros_like(q, dtype=torch.float32)

    def step(visitor: list[torch.Tensor], owner: int) -> tuple[slice, list[torch.Tensor]]:
        vk, vv = visitor
        block = block_for(ring.rank, owner, shard_len, causal)
        rows, cols = block.q_rows, block.kv_rows
        dq_blk, dk_blk, dv_blk = kernel.backward(dout[:, rows], q[:, rows], vk[:, cols], vv[:, cols], out[:, rows],
                                                 lse[..., rows], block.causal, scale)
        dq[:, rows] += dq_blk
        return cols, [dk_blk, dv_blk]

    dk, dv = circulate(ring, [k, v], 2, step)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
