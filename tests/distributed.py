"""Run a function on a spawned gloo group of CPU processes, from a test.

    def _check(rank, world_size, x): ...          # module-level, so it pickles
    run_on_ranks(_check, world_size=3, args=(x,))

A failure on any rank fails the test with that rank's traceback. A rank that hangs fails
after `timeout_s` instead of blocking the suite.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.process import leaving_process_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args: tuple, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # world_size processes share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    with leaving_process_group():
        fn(rank, world_size, *args)
    # A clean end leaves at once: C++ destructors run at interpreter exit can abort a finished
    # worker now and then ("terminate called without an active exception", SIGABRT), which
    # would fail a test whose every assertion passed. Errors still propagate above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn, world_size: int, args: tuple = (), timeout_s: float = 120.0) -> None:
    """Call fn(rank, world_size, *args) on `world_size` spawned processes of one gloo group."""
    mp.spawn(_worker, args=(world_size, free_port(), fn, args, timeout_s), nprocs=world_size, join=True)
