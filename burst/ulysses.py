"""Ulysses inside a node: an all-to-all over heads turns each rank's sequence shard into its
node's shards for a share of the heads, so that BurstAttention runs across nodes only.

On node n of L ranks (I nodes, W = I x L), rank (n, l) holds its chunks of the layout
(burst/layout.py). After the exchange it holds, for its heads, all of the node's chunks in
position order: node n's shard of the layout grouped by node (`Layout.grouped`), a layout in a
world of I. So the node-level ring plans like the rank-level one (`AttentionPlan` with world I),
and document boundaries stay global. Under zigzag rank (n, l) holds chunks g and 2W - 1 - g of
g = nL + l, and the node's chunks are two contiguous runs, [nL, nL + L) and [2W - nL - L, 2W - nL):
the zigzag shard of node n in a world of I.

    to_node:   [b, C, heads, d]          -> [b, L x C, heads of this rank, d]
    from_node: [b, L x C, q heads / L, d] -> [b, C, q heads, d]

Both are differentiable: the adjoint of an all-to-all is the all-to-all back, and autograd
sums the gradients of key/value heads that several ranks needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from burst.comm import Traffic, all_to_all


def heads_per_rank(q_heads: int, kv_heads: int, node_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(query heads, key/value heads) that each local rank of a node works on.

    Query heads split evenly. Key/value heads split evenly when node_size divides them;
    otherwise each rank gets the one kv head its query heads share (GQA groups larger than a
    rank's query heads), and nothing more. Other head counts raise a ValueError.
    """
    if q_heads % node_size != 0:
        raise ValueError(f"topology='ulysses' splits the {q_heads} query heads over the {node_size} ranks of a node, "
                         "which needs node_size to divide them; use topology='two-level' or another node_size")
    per_rank, group = q_heads // node_size, q_heads // kv_heads
    queries = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(node_size)]
    if kv_heads % node_size == 0:
        share = kv_heads // node_size
        return queries, [list(range(r * share, (r + 1) * share)) for r in range(node_size)]
    if group % per_rank == 0:
        return queries, [[r * per_rank // group] for r in range(node_size)]
    raise ValueError(f"topology='ulysses' cannot give the {node_size} ranks of a node equal shares of {q_heads} query "
                     f"and {kv_heads} key/value heads: node_size must divide the kv heads, or each rank's "
                     f"{per_rank} query heads must divide the group of {group} sharing a kv head; "
                     "use topology='two-level'")


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, traffic):
        ctx.group, ctx.traffic = group, traffic
        return all_to_all(x, group, traffic)

    @staticmethod
    def backward(ctx, grad):
        ctx.traffic.enter_backward()
        return all_to_all(grad, ctx.group, ctx.traffic), None, None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup | None, traffic: Traffic) -> torch.Tensor:
    return x if group is None else _AllToAll.apply(x, group, traffic)


def in_order(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [b, n, ...] with its rows rearranged along dim 1: row i of batch row r is x[r, order[r][i]]
    (order [b or 1, n]: one order for every batch row, or one each)."""
    if order.shape[0] == 1:
        return x.index_select(1, order[0])
    return torch.stack([row.index_select(0, o) for row, o in zip(x.unbind(0), order.unbind(0), strict=True)])


def to_node(x: torch.Tensor, heads: list[list[int]], group: dist.ProcessGroup | None, traffic: Traffic,
            order: torch.Tensor) -> torch.Tensor:
    """x [b, C, heads, d] -> [b, L x C, len(heads[l]), d]: rank l gets heads[l] of the node's shards,
    in position order. group: the node's ranks (None for a node of one). order: [b or 1, L x C], where
    each position of the node's shard sits in its ranks' shards laid end to end (`Layout.group_order`)."""
    b, shard_len, _, d = x.shape
    node_ranks, per_rank = len(heads), len(heads[0])
    index = torch.tensor([h for hs in heads for h in hs], device=x.device)
    parts = x.index_select(2, index).view(b, shard_len, node_ranks, per_rank, d).permute(2, 0, 1, 3, 4)
    got = _exchange(parts, group, traffic)  # [L (source rank), b, C, h, d]
    return in_order(got.transpose(0, 1).reshape(b, node_ranks * shard_len, per_rank, d), order)


def from_node(y: torch.Tensor, node_size: int, group: dist.ProcessGroup | None, traffic: Traffic,
              order: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_node` for query-side tensors: y [b, L x C, h, d] -> [b, C, L x h, d]."""
    b, node_len, per_rank, d = y.shape
    parts = in_order(y, order.argsort(dim=1)).view(b, node_size, node_len // node_size, per_rank, d)
    got = _exchange(parts.transpose(0, 1), group, traffic)  # [L (head share), b, C, h, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, node_len // node_size, node_size * per_rank, d)
