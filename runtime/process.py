"""This process as a rank: its device, joining and leaving the process group, and sums across ranks.

Train, eval and bench workers all start here: `init_worker_process_group()` reads the group torchrun
(or `runtime.launch.run_local`) describes in the environment, `leaving_process_group()` tears it down.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from burst.groups import group_rank_and_size
from runtime.launch import local_world_size, threads_per_process


def worker_device(kind: str) -> torch.device:
    """This rank's device of `kind` (runtime/device.py's resolve_device): GPU LOCAL_RANK (made current) on cuda;
    else the CPU, with intra-op threads limited to this process's share of the cores (LOCAL_WORLD_SIZE ranks
    share them), and CUDA left untouched even where it is there."""
    if kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    torch.set_num_threads(threads_per_process(local_world_size(1)))
    return torch.device("cpu")


def init_worker_process_group(kind: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30)
                              ) -> torch.device:
    """Join the process group described by the environment as a rank on `kind` ("cpu" or "cuda"); return this
    rank's device.

    CUDA ranks use NCCL, CPU ranks gloo. The default timeout allows for a 1M-token step on a slow link."""
    device = worker_device(kind)
    if device.type == "cuda":
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return device


@contextlib.contextmanager
def leaving_process_group() -> Iterator[None]:
    """Destroy the default process group when the block ends; after a clean end, all ranks together.

    A rank that destroys its group and exits while another rank still holds its gloo
    connections open (say, rank 0 still printing a report) can be aborted at exit with
    "terminate called without an active exception", which turns a finished run into a failed
    one. A barrier first makes the ranks tear down together. After an error there is no
    barrier: the other ranks may be gone, and waiting for them would hang.
    """
    try:
        yield
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce `tensor` over the ranks of `group` (None: the default group) in place and return it;
    a no-op in a world of one, with or without torch.distributed."""
    if group_rank_and_size(group)[1] > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor
