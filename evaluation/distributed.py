"""Evaluation over a context-parallel group: each rank holds a zigzag shard of every sequence.

The model code knows nothing about ranks (style principle 1): `use_burst_attention` swaps every
block's `core_attention` for `burst.BurstAttention`, exactly as the trainer's parallelize step
does; inputs are cut with the zigzag layout; per-rank sums are added up with `all_reduce_sum`.
`group=None` means one process alone, even when torch.distributed is initialised for something else.

The ranks are started by `burst.launch.run_local` (or by torchrun, for several machines); one
evaluation uses every rank of the world as its context-parallel group.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

import burst
from burst.launch import init_worker_process_group, leaving_process_group
from models import Transformer


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process in `group`; (0, 1) for None."""
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def use_burst_attention(model: Transformer, group: dist.ProcessGroup | None) -> None:
    """Make every attention block attend across `group` (in place); a no-op for a single process."""
    if rank_and_size(group)[1] == 1:
        return
    for block in model.layers:
        block.attention.core_attention = burst.BurstAttention(group)


def shard_tokens(tokens: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [batch, seq] -> this rank's zigzag shard [batch, seq // cp] and its global positions [seq // cp]."""
    rank, size = rank_and_size(group)
    seq_len = tokens.shape[1]
    return burst.shard_for_rank(tokens, rank, size), burst.zigzag_positions(seq_len, rank, size).to(tokens.device)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group` in place and return it."""
    if rank_and_size(group)[1] > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def eval_device() -> torch.device:
    """This rank's GPU (LOCAL_RANK) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


@contextlib.contextmanager
def context_parallel_group(cp: int) -> Iterator[tuple[dist.ProcessGroup | None, torch.device]]:
    """The process group of `cp` ranks to evaluate over (None for cp=1) and this rank's device.

    Joins the group torchrun or run_local describe when torch.distributed is not initialised yet
    (and leaves it afterwards); the world must have exactly `cp` ranks.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if world_size != cp:
        raise ValueError(f"--cp {cp} evaluates on {cp} ranks but {world_size} processes were started; "
                         f"start {cp} (`torchrun --nproc-per-node {cp} --no-python burst eval ... --cp {cp}`), "
                         f"or start one and let `burst eval --cp {cp}` start the ranks itself")
    if cp == 1:
        yield None, eval_device()
        return
    if dist.is_initialized():
        yield dist.group.WORLD, eval_device()
        return
    device = init_worker_process_group()
    with leaving_process_group():
        yield dist.group.WORLD, device
