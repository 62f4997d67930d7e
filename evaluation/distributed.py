"""Evaluation over a context-parallel group: each rank holds a zigzag shard of every sequence.

The model code knows nothing about ranks (style principle 1): `use_burst_attention` swaps every
block's `core_attention` for `burst.BurstAttention`, exactly as the trainer's parallelize step
does; inputs are cut with the zigzag layout; per-rank sums are added up with `runtime.process.all_reduce`.
`group=None` means torch's default group: one process alone when torch.distributed is not initialised.

The ranks are started by `runtime.launch.run_local` (or by torchrun, for several machines); one
evaluation uses every rank of the world as its context-parallel group.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

import burst
from burst.groups import group_rank_and_size
from models import Transformer
from runtime.process import init_worker_process_group, leaving_process_group, worker_device


def use_burst_attention(model: Transformer, group: dist.ProcessGroup | None, kernel: str = "auto") -> None:
    """Make every attention block attend across `group` (in place) with the local kernel `kernel`
    (burst.select_kernel's names); a single process keeps its own attention, with that kernel."""
    for block in model.layers:
        if group_rank_and_size(group)[1] == 1:
            block.attention.core_attention.kernel = kernel
        else:
            block.attention.core_attention = burst.BurstAttention(group, kernel=kernel)


def shard_tokens(tokens: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [batch, seq] -> this rank's zigzag shard [batch, seq // cp] and its global positions [seq // cp]."""
    rank, size = group_rank_and_size(group)
    seq_len = tokens.shape[1]
    return burst.shard_for_rank(tokens, rank, size), burst.zigzag_positions(seq_len, rank, size).to(tokens.device)


@contextlib.contextmanager
def context_parallel_group(cp: int, device_kind: str) -> Iterator[tuple[dist.ProcessGroup | None, torch.device]]:
    """The process group of `cp` ranks to evaluate over (None for cp=1) and this rank's device, of `device_kind`
    ("cpu" or "cuda": runtime/device.py).

    Joins the group torchrun or run_local describe when torch.distributed is not initialised yet
    (and leaves it afterwards); the world must have exactly `cp` ranks.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if world_size != cp:
        raise ValueError(f"--cp {cp} evaluates on {cp} ranks but {world_size} processes were started; "
                         f"start {cp} (`torchrun --nproc-per-node {cp} --no-python burst eval ... --cp {cp}`), "
                         f"or start one and let `burst eval --cp {cp}` start the ranks itself")
    if cp == 1:
        yield None, worker_device(device_kind)
        return
    if dist.is_initialized():
        yield dist.group.WORLD, worker_device(device_kind)
        return
    device = init_worker_process_group(device_kind)
    with leaving_process_group():
        yield dist.group.WORLD, device
