"""The zigzag sequence layout shared by attention, the model's positions and the data loader.

A sequence of length S on W ranks is cut into 2W equal chunks; rank r holds chunks r and
2W-1-r, in that order. Under a causal mask every rank then does the same amount of work at
every ring step (see ../shared/docs/burstattention.md). The same layout is used without a
causal mask so that one code path serves both.

Functions that take `rank`/`world_size` are pure and need no process group (the data loader
cuts shards before any communication); the `group` variants ask the process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from burst.groups import group_rank_and_size


def check_sequence_length(seq_len: int, world_size: int) -> None:
    """Raise a ValueError unless `seq_len` splits into 2 * world_size equal chunks."""
    if seq_len <= 0 or seq_len % (2 * world_size) != 0:
        lower = seq_len - seq_len % (2 * world_size)
        raise ValueError(
            f"sequence length {seq_len} must be a positive multiple of 2 x world size = {2 * world_size} "
            f"for the zigzag layout; use {lower or 2 * world_size} or {lower + 2 * world_size}, or pad the sequence")


def zigzag_chunks(rank: int, world_size: int) -> tuple[int, int]:
    """The two chunk indices (out of 2 * world_size) that `rank` holds, in local order."""
    return rank, 2 * world_size - 1 - rank


def zigzag_positions(seq_len: int, rank: int, world_size: int) -> torch.Tensor:
    """Global positions [seq_len // world_size] held by `rank`, in local order (int64)."""
    check_sequence_length(seq_len, world_size)
    chunk = seq_len // (2 * world_size)
    first, second = zigzag_chunks(rank, world_size)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


def shard_for_rank(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """`rank`'s zigzag shard of the full-sequence tensor `x` along `dim` (a contiguous copy)."""
    check_sequence_length(x.shape[dim], world_size)
    chunks = x.chunk(2 * world_size, dim=dim)
    first, second = zigzag_chunks(rank, world_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim).contiguous()


def unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_for_rank`: the full sequence from every rank's shard, in rank order."""
    world_size = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * world_size)
    for rank, part in enumerate(parts):
        first, second = zigzag_chunks(rank, world_size)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def shard_sequence(x: torch.Tensor, dim: int = 1, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor that every rank holds.

    x: [..., seq, ...] with seq at `dim`  ->  [..., seq // world_size, ...]
    """
    rank, world_size = group_rank_and_size(group)
    return shard_for_rank(x, rank, world_size, dim)


def gather_sequence(x_local: torch.Tensor, dim: int = 1, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The full sequence on every rank from each rank's shard (inverse of `shard_sequence`).

    x_local: [..., seq // world_size, ...]  ->  [..., seq, ...]
    Not differentiable: it is for inspection, evaluation and tests.
    """
    _, world_size = group_rank_and_size(group)
    if world_size == 1:
        return x_local
    parts = [torch.empty_like(x_local) for _ in range(world_size)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    return unshard(parts, dim)


def sequence_positions(seq_len: int, group: dist.ProcessGroup | None = None,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Global position ids [seq_len // world_size] of this rank's shard (for RoPE)."""
    rank, world_size = group_rank_and_size(group)
    return zigzag_positions(seq_len, rank, world_size).to(device)

