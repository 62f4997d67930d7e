"""Start N local worker processes with PyTorch's elastic launcher (what torchrun uses).

    results = run_local(worker_fn, nproc=2, args=(config,))   # {rank: worker_fn's return value}

Each worker finds RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its
environment, exactly as under torchrun, so worker code is the same either way.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another elastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run_local(fn: Callable[..., Any], nproc: int, args: tuple = ()) -> dict[int, Any]:
    """Run fn(*args) on `nproc` local processes; return {rank: result}. A failure on any
    rank raises torch's ChildFailedError naming the rank, with its traceback."""
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"burst-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
                          monitor_interval=0.1)
    return elastic_launch(config, fn)(*args)


def available_cores() -> int:
    """Cores this process may run on (fewer than os.cpu_count() under a CPU mask or container)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_process(nproc: int) -> int:
    """Intra-op threads for one of `nproc` local processes, so they do not oversubscribe the cores."""
    return max(1, available_cores() // nproc)


def worker_device() -> torch.device:
    """This rank's device: GPU LOCAL_RANK (made current) when CUDA is there, else the CPU, with
    intra-op threads limited to this process's share of the cores (LOCAL_WORLD_SIZE ranks share them)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    torch.set_num_threads(threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    return torch.device("cpu")


def init_worker_process_group(timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> torch.device:
    """Join the process group described by the environment; return this rank's device.

    CUDA ranks use NCCL, CPU ranks gloo. The default timeout allows for a 1M-token step on a slow link."""
    device = worker_device()
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
