"""BurstAttention's forward and backward passes along a `Schedule` (burst/topology.py).

Shapes (per rank, each holding its shard of `shard_len` tokens, burst/layout.py):
    q, dout, out  [batch, shard_len, q_heads, head_dim]
    k, v          [batch, shard_len, kv_heads, head_dim]
    lse, delta    [batch, q_heads, shard_len]  float32

One loop, `circulate`, serves both passes and every topology. A *visitor* packet goes to the
ranks whose part of the plan needs it while the *home* tensors stay put; in backward the
visitor's gradient comes back from each of them in float32 and is summed at its owner. Forward:
the visitor is K/V and each rank merges block results into a float32 (out, lse) by log-sum-exp;
nothing travels back.

    "burst" (the paper's): visitor = (q, dout, lse, delta); home = k, v, dk, dv.
    "ring":                visitor = (k, v);               home = q, dout, out, lse, dq.

Kernel calls take row slices of these tensors. Slices of [b, s, h, d] tensors keep a contiguous
last dimension, which is all the kernels need of them; an lse slice [b, h, rows] is not dense,
and flash-attn reads lse as a dense buffer, so it is copied at the call (rows floats per head,
cheap) to meet the kernels' contract (burst/kernels/contract.py). A step's blocks go to the kernel
together (burst/varlen.py): one varlen call per causal flag where the kernel has a checked one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from burst.comm import Pending
from burst.kernels import AttentionKernel
from burst.plan import AttentionPlan, Rows
from burst.topology import Schedule
from burst.varlen import backward_blocks, forward_blocks


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

    def step(kv: list[torch.Tensor], owner: int, held: Rows) -> GradPieces:
        segments = plan(schedule.rank, owner)
        blocks = [(q[seg.batch, seg.q_rows], kv[0][seg.batch, held.local(seg.kv_rows)],
                   kv[1][seg.batch, held.local(seg.kv_rows)], seg.mask) for seg in segments]
        for seg, (block_out, block_lse) in zip(segments, forward_blocks(kernel, blocks, scale), strict=True):
            merge_block(out[seg.batch, seg.q_rows], lse[seg.batch, :, seg.q_rows], block_out, block_lse)
        return []

    circulate(schedule, [k, v], [1, 1], 0, step, plan.key_rows)
    return as_result(out, q.dtype), lse


# step(visitor, owner, rows it holds) -> [(batch rows, rows of the visitor, its gradients there), ...];
# it accumulates the home gradients itself.
GradPieces = list[tuple[slice, slice, list[torch.Tensor]]]
StepFn = Callable[[list[torch.Tensor], int, Rows], GradPieces]
RowsFn = Callable[[int, int], Rows | None]


def circulate(schedule: Schedule, visitor: list[torch.Tensor], seq_dims: list[int], num_grads: int, step: StepFn,
              rows_of: RowsFn) -> list[torch.Tensor]:
    """Bring this rank every visitor its part of the plan needs, calling `step` on each; return the
    float32 gradients of this rank's own visitor (shaped like visitor[:num_grads]), summed over ranks.

    rows_of(host, owner): the rows of the visitor of position `owner` that position `host` works on
    (None: none); seq_dims: each visitor tensor's sequence dimension. Every rank computes the same
    answers from the same plan, so both ends of every message post it. A visitor goes only to the
    ranks that work on it, straight from its holder (`Schedule`), and only the rows they work on,
    packed: at step s the rank posts the sends and receives of step s + 1 and computes step s while
    they travel. A gradient travels only from a rank that computed one, with those rows only,
    straight back to the holder, posted one step after it was computed (so it overlaps the next
    step's compute); the holder sums its node's gradients (the owner itself in round 0). Across nodes
    (two-level), a visitor goes to each node that needs it with the rows its ranks need, and the
    node's sum of those rows goes back to the owner after its round on the outer links, overlapping
    the next round.
    """
    rounds, steps, me = schedule.rounds, schedule.steps, schedule.rank
    node = me // steps
    grad_like, f32, dtypes = visitor[:num_grads], [torch.float32] * num_grads, [t.dtype for t in visitor]
    every = Rows.every(visitor[0].shape[seq_dims[0]])

    def like(rows: Rows, tensors: list[torch.Tensor], types: list[torch.dtype]) -> list[torch.Tensor]:
        return [rows.empty(t, dim, dtype) for t, dim, dtype in zip(tensors, seq_dims, types, strict=False)]

    def zeros(rows: Rows) -> list[torch.Tensor]:
        return [t.zero_() for t in like(rows, grad_like, f32)]

    def add(accumulators: list[torch.Tensor], grads: list[torch.Tensor], rows: Rows = every) -> None:
        for acc, grad, dim in zip(accumulators, grads, seq_dims, strict=False):
            rows.add_into(acc, grad, dim)

    def node_rows(node_: int, owner: int) -> Rows | None:
        """The rows of `owner`'s visitor that any rank of node `node_` works on."""
        wanted = [rows for local in range(steps) if (rows := rows_of(node_ % rounds * steps + local, owner))]
        return Rows.union([slice(a, b) for rows in wanted for a, b in rows.spans], every.total) if wanted else None

    own = zeros(every)
    # this round's visitor, held for the node: its owner, the rows it holds, and their gradient summed over the node
    holding, holding_owner, holding_rows, holding_grad = visitor, me, every, own
    current, current_rows = (visitor, every) if rows_of(me, me) is not None else (None, None)  # this step's
    previous = None  # the previous step's gradients still to exchange: (step, gradient computed there or None,
    #                  and of the visitor this rank holds: owner, rows, accumulator)
    returned = Pending(), None  # a node's sum of this rank's gradient on its way back, and its rows
    finished = (me, None)  # (owner, node sum) of the round before this one

    def gradient_messages():
        """(sends, receives, rows received within the holder's) of the gradients of the previous step."""
        if previous is None:
            return [], [], None
        s, grad, owner, held, _ = previous
        host = schedule.host(s)
        coming = rows_of(host, owner)
        return ([(schedule.holder(s), grad)] if grad is not None else []), \
            ([(host, like(coming, grad_like, f32), f32)] if coming is not None else []), \
            (coming.within(held) if coming is not None else None)

    def collect(pending: Pending, rows: Rows | None) -> None:
        for grads in pending.wait():
            add(own, grads, rows)

    def return_node_sum(round_: int, owner: int, accumulator: list[torch.Tensor] | None) -> tuple[Pending, Rows]:
        """Send round `round_`'s node sum back to its owner; receive this rank's from the node that had it."""
        collect(*returned)  # the previous round's, which had a whole round to arrive
        source, coming = schedule.counterpart(round_), node_rows(node + round_, me)
        pending = schedule.outer.exchange([(owner, accumulator)] if accumulator is not None else [],
                                          [(source, like(coming, grad_like, f32), f32)] if coming else [])
        return pending, coming

    for round_ in range(rounds):
        arriving = Pending()  # next round's visitor, from its owner on another node, behind this whole round
        if round_ + 1 < rounds:
            source, target_node = schedule.counterpart(-(round_ + 1)), node + round_ + 1
            going, arriving_rows = node_rows(target_node, me), node_rows(node, source)
            arriving = schedule.outer.exchange(
                [(schedule.counterpart(round_ + 1), [going.pack(t, d) for t, d in zip(visitor, seq_dims, strict=True)])]
                if going else [], [(source, like(arriving_rows, visitor, dtypes), dtypes)] if arriving_rows else [])
        for s in range(steps):
            visitor_out, visitor_in, next_rows = [], [], None
            if s + 1 < steps:
                host = schedule.host(s + 1)
                going = rows_of(host, holding_owner) if holding is not None else None
                if going is not None:
                    within = going.within(holding_rows)
                    visitor_out.append((host, [within.pack(t, dim) for t, dim in zip(holding, seq_dims, strict=True)]))
                next_rows = rows_of(me, schedule.owner(round_, s + 1))
                if next_rows is not None:
                    visitor_in.append((schedule.holder(s + 1), like(next_rows, visitor, dtypes), dtypes))
            grad_out, grad_in, coming = gradient_messages() if num_grads else ([], [], None)
            pending = schedule.inner.exchange(visitor_out + grad_out, visitor_in + grad_in)
            pieces = step(current, schedule.owner(round_, s), current_rows) if current is not None else []
            received = pending.wait()
            if grad_in:
                add(previous[4], received[-1], coming)
            if s == 0 and round_ > 1 and num_grads:  # round_ - 1's node sum is complete: back to its owner
                returned = return_node_sum(round_ - 1, *finished)
            if num_grads and s == 0:
                previous = None
                target = holding_grad  # this rank's work on the visitor it holds: summed in place
            elif num_grads:
                target = zeros(current_rows) if current is not None else None
                previous = (s, target, holding_owner, holding_rows, holding_grad)
            for batch, rows, grads in pieces:
                for acc, grad in zip(target, grads, strict=True):
                    acc[batch, rows] += grad
            current, current_rows = (received[0], next_rows) if visitor_in else (None, None)
        if round_ + 1 < rounds:
            finished = (schedule.counterpart(-round_), holding_grad)
            arrived = arriving.wait()
            holding, holding_owner = (arrived[0] if arrived else None), schedule.counterpart(-(round_ + 1))
            holding_rows = arriving_rows
            holding_grad = zeros(holding_rows) if holding is not None and num_grads else None
            works = holding is not None and rows_of(me, holding_owner) is not None
            current, current_rows = (holding, holding_rows) if works else (None, None)
    if num_grads:
        grad_out, grad_in, coming = gradient_messages()
        received = schedule.inner.exchange(grad_out, grad_in).wait()
        if grad_in:
            add(previous[4], received[-1], coming)
        if rounds > 1:
            collect(*return_node_sum(rounds - 1, schedule.counterpart(-(rounds - 1)), holding_grad))
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

    def step(visitor: list[torch.Tensor], owner: int, held: Rows) -> GradPieces:
        vq, vdout, vlse, vdelta = visitor
        pieces, blocks = [], []
        segments = plan(owner, schedule.rank)
        for seg in segments:
            b, rows, cols = seg.batch, held.local(seg.q_rows), seg.kv_rows
            vout = out[b, rows] if owner == schedule.rank else output_with_delta(vdout[b, rows], vdelta[b, :, rows])
            blocks.append((vdout[b, rows], vq[b, rows], k[b, cols], v[b, cols], vout, vlse[b, :, rows].contiguous(),
                           seg.mask))
        for seg, (dq_blk, dk_blk, dv_blk) in zip(segments, backward_blocks(kernel, blocks, scale), strict=True):
            b, rows, cols = seg.batch, held.local(seg.q_rows), seg.kv_rows
            dk[b, cols] += dk_blk
            dv[b, cols] += dv_blk
            pieces.append((b, rows, [dq_blk]))
        return pieces

    (dq,) = circulate(schedule, [q, dout, lse, delta], [1, 1, 2, 2], 1, step,
                      lambda host, owner: plan.query_rows(owner, host))
    return as_result(dq, q.dtype), as_result(dk, k.dtype), as_result(dv, v.dtype)


def ring_backward(schedule: Schedule, kernel: AttentionKernel, plan: AttentionPlan, dout, q, k, v, out, lse,
                  scale: float):
    """Ring attention's backward: Q, dO and dQ stay home; K, V travel, dK, dV follow them."""
    dq = torch.zeros_like(q, dtype=torch.float32)

    def step(visitor: list[torch.Tensor], owner: int, held: Rows) -> GradPieces:
        vk, vv = visitor
        pieces = []
        segments = plan(schedule.rank, owner)
        blocks = [(dout[seg.batch, seg.q_rows], q[seg.batch, seg.q_rows], vk[seg.batch, held.local(seg.kv_rows)],
                   vv[seg.batch, held.local(seg.kv_rows)], out[seg.batch, seg.q_rows],
                   lse[seg.batch, :, seg.q_rows].contiguous(), seg.mask) for seg in segments]
        for seg, (dq_blk, dk_blk, dv_blk) in zip(segments, backward_blocks(kernel, blocks, scale), strict=True):
            dq[seg.batch, seg.q_rows] += dq_blk
            pieces.append((seg.batch, held.local(seg.kv_rows), [dk_blk, dv_blk]))
        return pieces

    dk, dv = circulate(schedule, [k, v], [1, 1], 2, step, plan.key_rows)
    return as_result(dq, q.dtype), as_result(dk, k.dtype), as_result(dv, v.dtype)
