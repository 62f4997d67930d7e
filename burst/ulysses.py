"""Ulysses inside a node: an all-to-all over heads turns each rank's sequence shard into its
node's shards for a share of the heads, so that BurstAttention runs across nodes only.

On node n of L ranks (I nodes, W = I x L), rank (n, l) holds the zigzag chunks g and
2W - 1 - g of g = nL + l, each of c tokens. After the exchange it holds, for its heads, the
node's chunks in position order: [nL, nL + L) then [2W - nL - L, 2W - nL), two contiguous
runs, which is exactly node n's zigzag shard in a world of I with chunks of L x c tokens.
So the node-level ring plans like the rank-level one (`AttentionPlan` with world I), and
document boundaries stay global.

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


def to_node(x: torch.Tensor, heads: list[list[int]], group: dist.ProcessGroup | None,
            traffic: Traffic) -> torch.Tensor:
    """x [b, C, heads, d] -> [b, L x C, len(heads[l]), d]: rank l gets heads[l] of the node's shards,
    in position order. group: the node's ranks (None for a node of one)."""
    b, shard_len, _, d = x.shape
    nodes_ranks, per_rank, half = len(heads), len(heads[0]), x.shape[1] // 2
    index = torch.tensor([h for hs in heads for h in hs], device=x.device)
    parts = x.index_select(2, index).view(b, shard_len, nodes_ranks, per_rank, d).permute(2, 0, 1, 3, 4)
    got = _exchange(parts, group, traffic)  # [L (source rank), b, C, h, d]
    first = got[:, :, :half].transpose(0, 1).reshape(b, nodes_ranks * half, per_rank, d)
    second = got[:, :, half:].flip(0).transpose(0, 1).reshape(b, nodes_ranks * half, per_rank, d)
    return torch.cat([first, second], dim=1)


def from_node(y: torch.Tensor, node_size: int, group: dist.ProcessGroup | None, traffic: Traffic) -> torch.Tensor:
    """Inverse of `to_node` for query-side tensors: y [b, L x C, h, d] -> [b, C, L x h, d]."""
    b, node_len, per_rank, d = y.shape
    half = node_len // (2 * node_size)
    first = y[:, :node_size * half].reshape(b, node_size, half, per_rank, d)
    second = y[:, node_size * half:].reshape(b, node_size, half, per_rank, d).flip(1)
    parts = torch.cat([first, second], dim=2).transpose(0, 1)  # [L (destination rank), b, C, h, d]
    got = _exchange(parts, group, traffic)  # [L (head share), b, C, h, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, 2 * half, node_size * per_rank, d)
