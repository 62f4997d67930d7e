"""Generation with the keys and values split across ranks: a prompt read by BurstAttention, then decoded
token by token against every rank's slice of the cache.

Prefill: the prompt is sharded by a layout as training shards a sequence; `burst_attn` computes its
attention, and each rank keeps the keys and values of its own shard (`KVCache`): no rank ever holds
the whole prompt's. Decode: every rank runs the model on the new token (its query, key and value are
the same on every rank); each rank attends the query to its own slice (`attend_cached`, which gives an
output and its log-sum-exp), one all-gather per layer brings every rank's (out, lse) to all, and they
are merged in rank order by the ring's own merge (`burst.ring.merge_block`), so every rank holds the
same exact output. The new token's key and value are kept by one rank, round robin (`token_owner`), so
the slices never differ by more than one token. A sliding-window layer's query sees only the keys of its
window (each kept key's position is kept beside it); the whole cache is kept, the window only masks it.

    cache = KVCache(layers, batch, capacity, kv_heads, head_dim, dtype, device)
    cache.reserve(visible, positions)    # before each forward: the slots its keys take on this rank
    out = attention(q, k, v, cache=cache.layer(i))   # LocalAttention (one process) or DecodeAttention

The model calls its attention module with a layer's cache and knows nothing of ranks; the generation
loop (evaluation/generate.py) swaps `DecodeAttention` in for cp > 1, reserves the slots and places the
tokens.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from burst.groups import group_rank_and_size
from burst.module import BurstAttention
from burst.ring import merge_block


class KVCache:
    """This rank's keys and values of every layer, [layers, batch, kv_heads, capacity, head_dim] each (heads before
    slots, so that a query's scores are one matmul over a view), which of them each row's queries may see
    (`visible` [batch, capacity]: a padding key is held but never seen) and each key's position in its row
    (`positions` [batch, capacity], for the sliding-window layers).

    Slots are filled in order: `reserve` takes the next ones for a forward pass, and every layer writes its
    keys there (`LayerCache.write`). `keep` drops the rows that finished. Dropping the object frees it all.
    """

    def __init__(self, layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.visible = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch, capacity, dtype=torch.int64, device=device)
        self.query_positions: torch.Tensor | None = None  # [batch, s]: those of the forward pass under way
        self.start = self.stop = 0  # the slots of the forward pass under way: [start, stop)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values held (the whole capacity: it is allocated up front)."""
        return self.k.nbytes + self.v.nbytes

    def reserve(self, visible: torch.Tensor, positions: torch.Tensor) -> None:
        """Take the next visible.shape[1] slots for the coming forward pass of tokens at `positions` [batch, s];
        visible [batch, n] bool says which of its keys queries may see: n = s, or n = 0 when this rank keeps none of
        them (another rank holds the new token)."""
        start, stop = self.stop, self.stop + visible.shape[1]
        if stop > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} tokens per rank and {stop} were asked for; make it "
                             f"with the prompt's length plus the new tokens (`cache_capacity`)")
        self.visible[:, start:stop] = visible
        if stop > start:
            self.positions[:, start:stop] = positions
        self.query_positions = positions
        self.start, self.stop = start, stop

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (int64 indices, in order): a finished row's cache stops costing."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        self.visible, self.positions = self.visible[rows], self.positions[rows]

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)


class LayerCache:
    """One layer's view of a `KVCache`: what its attention writes and reads."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    @property
    def length(self) -> int:
        """Keys held before the forward pass under way (0: this pass is the prefill)."""
        return self.cache.start

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep k, v [batch, n, kv_heads, head_dim] in the slots reserved for this pass; nothing when none were
        reserved (the token is kept by another rank)."""
        start, stop = self.cache.start, self.cache.stop
        if stop == start:
            return
        if k.shape[1] != stop - start:
            raise ValueError(f"{k.shape[1]} new keys for {stop - start} reserved slots; reserve one slot per token")
        self.cache.k[self.index, :, :, start:stop] = k.transpose(1, 2)
        self.cache.v[self.index, :, :, start:stop] = v.transpose(1, 2)

    def held(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v [batch, kv_heads, n, head_dim], visible [batch, s, n]) of every key held, this pass's included;
        with a sliding `window`, a key is visible to a query at p only at a position p - window < j <= p."""
        cache, stop = self.cache, self.cache.stop
        visible = cache.visible[:, None, :stop]
        if window is not None:
            visible = visible & (cache.positions[:, None, :stop] > cache.query_positions[:, :, None] - window)
        return cache.k[self.index, :, :, :stop], cache.v[self.index, :, :, :stop], visible


def cache_capacity(prompt_len: int, new_tokens: int, world_size: int) -> int:
    """Slots one rank needs: its shard of the (padded) prompt and its share of the new tokens, round robin."""
    return prompt_len // world_size + math.ceil(new_tokens / world_size)


def cache_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype the cache holds keys and values in: float32 on a CPU, where `attend_cached` reads them in float32
    and converting a bf16 cache to float32 for every token took twice as long as the attention itself (the values
    are the same: a bf16 value is exact in float32); the weights' `dtype` elsewhere, where memory is shorter."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype


def token_owner(step: int, world_size: int) -> int:
    """The rank that keeps the key and value of the `step`-th generated token (0-based): round robin, so that
    every rank holds its prompt shard plus floor or ceil of step / world_size tokens."""
    return step % world_size


def attend_cached(q: torch.Tensor, cache: LayerCache, scale: float | None = None, window: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [batch, s, q_heads, head_dim] against every key the cache holds (all earlier than q: no causal mask; with
    a sliding `window`, those within it), in float32: out [batch, s, q_heads, head_dim] and lse [batch, q_heads, s]
    (-inf where a row sees no key, out 0 there). Grouped-query: kv heads are never repeated, and the keys are read
    where they lie (a matmul over a view of the cache, no copy in float32)."""
    k, v, visible = cache.held(window)  # [b, kv_heads, n, d], [b, s, n]
    batch, s, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    groups = q_heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    grouped = q.float().view(batch, s, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)  # [b, h, g, s, d]
    scores = grouped.reshape(batch, kv_heads, groups * s, head_dim) @ k.float().transpose(2, 3)  # [b, h, g*s, n]
    scores = (scores * scale).view(batch, kv_heads, groups, s, -1)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    lse = scores.logsumexp(-1)  # [b, h, g, s]
    weights = torch.exp(scores - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1))  # 0 for an unseen key
    out = weights.view(batch, kv_heads, groups * s, -1) @ v.float()  # [b, h, g*s, d]
    out = out.view(batch, kv_heads, groups, s, head_dim).permute(0, 3, 1, 2, 4).reshape(batch, s, q_heads, head_dim)
    return out, lse.reshape(batch, q_heads, s)


def merge_ranks(out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's partial (out [b, s, h, d], lse [b, h, s], float32) merged, the same on every rank: one
    all-gather of both, folded in rank order as the ring folds its blocks."""
    _, world_size = group_rank_and_size(group)
    packed = torch.cat([out.flatten(), lse.flatten()])
    every = [torch.empty_like(packed) for _ in range(world_size)]
    dist.all_gather(every, packed, group=group)
    merged_out, merged_lse = out.new_empty(out.shape), lse.new_empty(lse.shape)
    merged_out.copy_(every[0][:out.numel()].view(out.shape))
    merged_lse.copy_(every[0][out.numel():].view(lse.shape))
    for rank in range(1, world_size):
        merge_block(merged_out, merged_lse, every[rank][:out.numel()].view(out.shape),
                    every[rank][out.numel():].view(lse.shape))
    return merged_out


class DecodeAttention(BurstAttention):
    """`BurstAttention` that also generates: with a layer's cache, the prefill runs the ring and keeps this rank's
    keys; a decoded token attends to every rank's slice (`attend_cached` + `merge_ranks`). Without one it is
    BurstAttention as trained."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_boundaries=None, doc_sees=None,
                window: int | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        if cache is None:
            return super().forward(q, k, v, doc_boundaries, doc_sees, window)
        if cache.length == 0:  # the prompt, sharded by the layout
            out = super().forward(q, k, v, doc_boundaries, doc_sees, window)
            cache.write(k, v)
            return out
        cache.write(k, v)  # on the token's owner only
        out, lse = attend_cached(q, cache, window=window)
        return merge_ranks(out, lse, self.group).to(q.dtype)
