"""Bytes on the wire: what each backward mode and each topology sends, and the choices made from it.

All counts are per rank and per pass, for the tensors as `burst_attn` receives them:
q [b, C, q_heads, d], k/v [b, C, kv_heads, d], C tokens per rank, W ranks in I nodes of L.
The small all-gather that compares the ranks' inputs is left out (see `comm.gather_from_every_rank`).
"""

from __future__ import annotations

import torch

from burst.ulysses import heads_per_rank


def backward_bytes_per_hop(q: torch.Tensor, k: torch.Tensor, mode: str) -> int:
    """Bytes one rank sends per backward ring step in `mode` ("burst" or "ring").

    burst: q and dout in their dtype, lse and delta (one float32 each per query row), dq in float32.
    ring:  k and v in their dtype, dk and dv in float32.
    """
    if mode == "burst":
        rows = q.numel() // q.shape[-1]
        return 2 * q.numel() * q.element_size() + 2 * rows * 4 + q.numel() * 4
    return 2 * k.numel() * k.element_size() + 2 * k.numel() * 4


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


def inter_node_bytes(topology: str, q: torch.Tensor, k: torch.Tensor, backward: str, node_size: int,
                     world_size: int, rank: int) -> tuple[int, int]:
    """(forward, backward) bytes that group rank `rank` sends to other nodes in one call.

    A block is k and v (forward) or one backward hop (`backward_bytes_per_hop`, `backward`
    resolved as burst_attn resolves it).
      flat:      the last rank of each node sends all W - 1 blocks across; the others none.
      two-level: every rank sends I - 1 blocks across (and, in backward, I - 1 gradient sums).
      ulysses:   I - 1 node-sized blocks, [b, L x C, heads / L, d]: the same bytes as two-level
                 when L divides the kv heads, more when each rank needs a whole kv head.
    """
    nodes = world_size // node_size
    if nodes == 1:
        return 0, 0
    if topology == "ulysses":
        q, k = node_blocks(q, k, node_size)
    hops = nodes - 1 if topology != "flat" else (world_size - 1 if rank % node_size == node_size - 1 else 0)
    return hops * 2 * k.numel() * k.element_size(), hops * backward_bytes_per_hop(q, k, choose_backward(q, k, backward))


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
