"""Bytes on the wire: what each backward mode and each topology sends, and the choices made from it.

All counts are per rank and per pass, for the tensors as `burst_attn` receives them:
q [b, C, q_heads, d], k/v [b, C, kv_heads, d], C tokens per rank, W ranks in I nodes of L.
The small all-gather that compares the ranks' inputs is left out (see `comm.gather_from_every_rank`).
With document masking a block goes only where the plan needs it: `planned_sends` counts what a rank
sends for any plan (the benchmark's plan-only mode and the tests use it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from burst.plan import AttentionPlan, Rows
from burst.ulysses import heads_per_rank


def packet_bytes(q: torch.Tensor, k: torch.Tensor, mode: str) -> tuple[int, int]:
    """(visitor, gradient) bytes of one block in the backward `mode` ("burst" or "ring").

    burst: q and dout in their dtype, lse and delta (one float32 each per query row); dq in float32.
    ring:  k and v in their dtype; dk and dv in float32.
    """
    if mode == "burst":
        rows = q.numel() // q.shape[-1]
        return 2 * q.numel() * q.element_size() + 2 * rows * 4, q.numel() * 4
    return 2 * k.numel() * k.element_size(), 2 * k.numel() * 4


def backward_bytes_per_hop(q: torch.Tensor, k: torch.Tensor, mode: str) -> int:
    """Bytes one rank sends per backward ring step in `mode` when every block is needed: a visitor
    out and a gradient back."""
    return sum(packet_bytes(q, k, mode))


def choose_backward(q: torch.Tensor, k: torch.Tensor, mode: str) -> str:
    """Resolve "auto" to the mode that sends fewer bytes for these shapes and dtypes."""
    if mode != "auto":
        return mode
    return min(("burst", "ring"), key=lambda m: backward_bytes_per_hop(q, k, m))


def node_blocks(q: torch.Tensor, k: torch.Tensor, node_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape-only (meta) q and k of one rank after Ulysses' exchange: [b, L x C, heads of the rank, d]."""
    q_heads, kv_heads = heads_per_rank(q.shape[2], k.shape[2], node_size)
    b, shard_len, _, d = q.shape
    return (torch.empty(b, node_size * shard_len, len(q_heads[0]), d, dtype=q.dtype, device="meta"),
            torch.empty(b, node_size * shard_len, len(kv_heads[0]), d, dtype=k.dtype, device="meta"))


@dataclass(frozen=True)
class Sends:
    """Rows of blocks one rank sends in one pass (visitors out, gradients back), and how many of them
    leave its node; a whole block is a shard's rows."""

    visitors: int = 0
    visitors_inter_node: int = 0
    gradients: int = 0
    gradients_inter_node: int = 0


def planned_sends(rows_of, rounds: int, steps: int, position: int, node_size: int, total: int) -> Sends:
    """What position `position` of a schedule of `rounds` x `steps` positions sends in one pass, when
    rows_of(host, owner) says which rows of which positions' visitors each position works on (None:
    none; burst/ring.py's `circulate`), of `total` rows each.

    One round (flat, and Ulysses' ring over nodes): every visitor straight from its owner to each
    position that needs it, the rows it needs, and a gradient of those rows straight back. Two-level:
    a visitor once to every other node where a rank needs it, the rows its ranks need, to the
    counterpart there, who hands each rank of the node the rows it needs; gradients back to that
    holder, and the node's sum of its rows back to the owner. node_size: positions per node for
    `rounds` = 1 (1 when every position is a node of its own).
    """
    count = {"visitors": 0, "visitors_inter_node": 0, "gradients": 0, "gradients_inter_node": 0}

    def send(kind: str, rows: int, across: bool) -> None:
        count[kind] += rows
        count[f"{kind}_inter_node"] += rows if across else 0

    node, local = divmod(position, steps)
    if rounds == 1:
        for other in range(steps):
            if other != position:
                across = other // node_size != position // node_size
                if (going := rows_of(other, position)) is not None:
                    send("visitors", going.count, across)
                if (coming := rows_of(position, other)) is not None:
                    send("gradients", coming.count, across)
        return Sends(**count)

    def at(node_: int, local_: int) -> int:
        return node_ % rounds * steps + local_ % steps

    def node_rows(node_: int, owner: int) -> int:
        """How many rows of `owner`'s visitor the ranks of node `node_` work on, together."""
        wanted = [r for lo in range(steps) if (r := rows_of(at(node_, lo), owner)) is not None]
        return Rows.union([slice(a, b) for r in wanted for a, b in r.spans], total).count if wanted else 0

    for offset in range(rounds):
        held = at(node - offset, local)  # the visitor this position holds for its node in round `offset`
        if offset:
            send("visitors", node_rows(node + offset, position), True)
            send("gradients", node_rows(node, held), True)  # the node's sum, back to the owner
        for s in range(1, steps):
            if (going := rows_of(at(node, local + s), held)) is not None:
                send("visitors", going.count, False)
            if (coming := rows_of(position, at(node - offset, local - s))) is not None:
                send("gradients", coming.count, False)
    return Sends(**count)


def planned_bytes(sends_forward: Sends, sends_backward: Sends, q: torch.Tensor, k: torch.Tensor,
                  backward: str) -> tuple[int, int, int, int]:
    """(forward, forward inter-node, backward, backward inter-node) bytes of these sends for blocks
    like q and k (node-sized ones for Ulysses), `backward` resolved as burst_attn resolves it."""
    rows = q.shape[1]
    kv = 2 * k.numel() * k.element_size() // rows  # bytes per row of a block
    visitor, gradient = (n // rows for n in packet_bytes(q, k, choose_backward(q, k, backward)))
    return (sends_forward.visitors * kv, sends_forward.visitors_inter_node * kv,
            sends_backward.visitors * visitor + sends_backward.gradients * gradient,
            sends_backward.visitors_inter_node * visitor + sends_backward.gradients_inter_node * gradient)


def plan_bytes(plan: AttentionPlan, topology: str, q: torch.Tensor, k: torch.Tensor, backward: str, node_size: int,
               rank: int) -> tuple[int, int, int, int]:
    """(forward, forward inter-node, backward, backward inter-node) bytes group rank `rank` sends in one
    call of `topology` (resolved) whose ring runs `plan`: over ranks, or over nodes for "ulysses", with
    q and k as the ring gets them (node-sized for "ulysses"). The agreement all-gather is left out."""
    world = plan.world_size
    if topology == "ulysses":
        shape = (1, world, rank // node_size, 1)
    elif topology == "flat" or node_size in (1, world):
        shape = (1, world, rank, node_size)
    else:
        shape = (world // node_size, node_size, rank, node_size)
    mode = choose_backward(q, k, backward)
    backward_rows = plan.key_rows if mode == "ring" else (lambda host, owner: plan.query_rows(owner, host))
    return planned_bytes(planned_sends(plan.key_rows, *shape, plan.shard_len),
                         planned_sends(backward_rows, *shape, plan.shard_len), q, k, mode)


def inter_node_bytes(topology: str, q: torch.Tensor, k: torch.Tensor, backward: str, node_size: int,
                     world_size: int, rank: int) -> tuple[int, int]:
    """(forward, backward) bytes that group rank `rank` sends to other nodes in one call when every
    block is needed (no document mask).

      flat:      every rank sends its block straight to the W - L ranks of other nodes, and a
                 gradient back to each of their W - L owners.
      two-level: every rank sends I - 1 blocks across (and, in backward, I - 1 gradient sums).
      ulysses:   I - 1 node-sized blocks, [b, L x C, heads / L, d]: the same bytes as two-level
                 when L divides the kv heads, more when each rank needs a whole kv head.
    """
    nodes = world_size // node_size
    if nodes == 1:
        return 0, 0
    if topology == "ulysses":
        q, k = node_blocks(q, k, node_size)
    whole = Rows.every(q.shape[1])
    every = lambda host, owner: whole  # noqa: E731
    if topology == "ulysses":
        sends = planned_sends(every, 1, nodes, rank // node_size, 1, whole.total)
    elif topology == "flat" or node_size == 1:
        sends = planned_sends(every, 1, world_size, rank, node_size, whole.total)
    else:
        sends = planned_sends(every, nodes, node_size, rank, node_size, whole.total)
    _, forward, _, backward_ = planned_bytes(sends, sends, q, k, backward)
    return forward, backward_


def choose_topology(topology: str, q: torch.Tensor, k: torch.Tensor, backward: str, node_size: int,
                    world_size: int) -> str:
    """Resolve "auto": flat on one node; across nodes the topology whose ranks send fewest bytes
    to other nodes in forward + backward, all ranks together. On a tie ulysses goes first: inside
    the node it moves an all-to-all of q, k, v and out instead of I x (L - 1) ring hops, and its
    ring takes L x fewer steps on L x longer blocks."""
    if topology != "auto":
        return topology
    if world_size == node_size:
        return "flat"
    candidates = ["two-level", "flat"]
    try:
        heads_per_rank(q.shape[2], k.shape[2], node_size)
        candidates.insert(0, "ulysses")
    except ValueError:
        pass  # these heads do not split over a node

    def total(mode: str) -> int:
        return sum(sum(inter_node_bytes(mode, q, k, backward, node_size, world_size, r)) for r in range(world_size))

    return min(candidates, key=total)
