"""This process's place in a run: the process group, the ("dp", "cp") DeviceMesh, and its device.

torchrun, or `burst train`'s own launcher, describes the group in the environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, ...). CPU ranks use gloo; CUDA ranks use NCCL with one GPU per local rank.
A single process has no process group and no mesh.

Every rank also joins a second, gloo group on the CPU (`cpu_group`), for work beside the training
step: background checkpoint saves, and finding the rank that hangs when a collective times out
(--timeout): a monitored barrier, which only gloo has, names the ranks that do not answer.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from runtime.memory import return_freed_memory
from runtime.process import init_worker_process_group, worker_device
from runtime.settings import flag
from trainer.config import TrainConfig


@dataclass
class Distributed:
    """This process's place in the run."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None  # ("dp", "cp"); None when the run is a single process
    cpu_group: dist.ProcessGroup | None = None  # gloo, every rank; None when the run is a single process

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank() if self.mesh is not None else 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def environment_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(config: TrainConfig) -> Distributed:
    """Join the process group the environment describes (none for a single process) and build the mesh, on
    config.device: the kind trainer/preflight.py resolved ("cpu" ranks use gloo even where CUDA is there). A CPU
    rank's freed tensors go back to the system, so that its peak memory is its tensors' (runtime/memory.py)."""
    if config.device == "cpu":
        return_freed_memory()
    world_size = environment_world_size()
    if world_size == 1:
        return Distributed(0, 1, worker_device(config.device), None)
    # The default, 30 minutes, allows for a 1M-token step on a slow link.
    device = init_worker_process_group(config.device, datetime.timedelta(minutes=config.timeout))
    mesh = init_device_mesh(device.type, (config.dp, config.cp), mesh_dim_names=("dp", "cp"))
    return Distributed(dist.get_rank(), world_size, device, mesh, dist.new_group(backend="gloo"))


def check_settings_agree(config: TrainConfig, env: Distributed) -> None:
    """Refuse, on every rank, a run whose ranks were started with different settings or run directories (under
    torchrun each node parses its own command line): one all-gather of each rank's resolved config, before any
    work. Ranks that disagreed used to train on silently (another --seed or --lr), end in a false diagnosis
    (another --steps), or save half a checkpoint marked complete (another --out)."""
    if env.mesh is None:
        return
    mine = {**dataclasses.asdict(config), "out": str(Path(config.out).resolve())}
    every: list[dict] = [{} for _ in range(env.world_size)]
    dist.all_gather_object(every, mine, group=env.cpu_group)
    differing = [name for name in mine if any(settings[name] != mine[name] for settings in every)]
    if differing:
        raise ValueError("the ranks were started with different settings: "
                         + "; ".join(f"{flag(name)}: " + ", ".join(f"rank {rank} {settings[name]}"
                                                                   for rank, settings in enumerate(every))
                                     for name in differing)
                         + ". Start every rank with the same command and the same --out (a directory every node "
                           "shares)")


def is_collective_timeout(err: BaseException) -> bool:
    """Whether `err` is a collective that waited past the process group's timeout (gloo: "Timed out waiting
    ...", NCCL: "... timeout")."""
    return isinstance(err, RuntimeError) and ("timed out" in str(err).lower() or "timeout" in str(err).lower())


def unresponsive_ranks(env: Distributed, timeout: datetime.timedelta) -> str:
    """Which ranks do not answer within `timeout`, in the words of a monitored barrier over every rank (rank 0:
    "Ranks 1 failed to pass monitoredBarrier ..."; another rank names rank 0 when rank 0 is the one that hangs)."""
    try:
        dist.monitored_barrier(group=env.cpu_group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:
        return str(err)
    return "every rank answers now (the wait was long, not stuck)"
