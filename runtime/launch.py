"""Start N local worker processes with PyTorch's elastic launcher (what torchrun uses).

    results = run_local(worker_fn, nproc=2, args=(config,))   # {rank: worker_fn's return value}

Each worker finds RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its
environment, exactly as under torchrun, so worker code is the same either way.

On Linux the workers fork from a server process (multiprocessing's forkserver) that imported the worker
function's module once, instead of each importing torch and the project again (about 3 CPU s a rank): a run of
2 ranks imports twice, not three times, and one of 4 twice, not five times. The server is a fresh interpreter that
does nothing but import (no threads, no OpenMP, no process group, which a fork must not inherit); a worker still
sees the launcher's environment and working directory as they are when it starts, as a spawned one would.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another elastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def local_world_size(default: int) -> int:
    """The ranks on this machine: under torchrun its LOCAL_WORLD_SIZE (checked), else `default`, the ranks this
    command starts here; a LOCAL_WORLD_SIZE left in the environment of a plain command is not read."""
    if not under_torchrun() or "LOCAL_WORLD_SIZE" not in os.environ:
        return default
    text = os.environ["LOCAL_WORLD_SIZE"]
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={text!r}, set by the launcher, is not a number of ranks on this machine "
                         f"(a whole number, at least 1); start the ranks with torchrun, which sets it")
    return int(text)


# Where workers fork from a server that imported their module (see the module docstring); elsewhere each is spawned
START_METHOD = "forkserver" if sys.platform.startswith("linux") else "spawn"
# The environment this process started with: in a worker forked from the server, the server's (see _as_launched)
INHERITED_ENVIRONMENT = dict(os.environ)


def run_local(fn: Callable[..., Any], nproc: int, args: tuple = (), max_restarts: int = 0,
              preload: tuple[str, ...] = ()) -> dict[int, Any]:
    """Run fn(*args) on `nproc` local processes; return {rank: result}. When a rank fails, all are
    stopped and started again, up to `max_restarts` times (each sees TORCHELASTIC_RESTART_COUNT);
    a failure past that raises torch's ChildFailedError naming the rank, with its traceback (see first_failure).
    The workers begin with fn's module imported, and the modules in `preload` (what a worker imports later)."""
    if max_restarts:
        # Restarted workers sharing the agent's store can read the previous attempt's addresses and fail to
        # connect (pytorch/pytorch#135712): give each attempt a store of its own, hosted by its rank 0.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # Read when this process first starts the server; one started before (by an earlier call) keeps its imports
    multiprocessing.set_forkserver_preload([fn.__module__, *preload])
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"burst-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
                          start_method=START_METHOD, monitor_interval=0.1)
    logging.disable(logging.ERROR)  # the agent logs a worker's failure as pages of tracebacks; callers report it once
    try:
        return elastic_launch(config, _as_launched)(fn, os.getpid(), dict(os.environ), *args)
    finally:
        logging.disable(logging.NOTSET)


def _as_launched(fn: Callable[..., Any], launcher: int, environment: dict[str, str], *args: Any) -> Any:
    """A worker's entry point: fn(*args), in a process that dies with the launcher `launcher`, in the launcher's
    `environment` with the variables the elastic agent set for this worker.

    A launcher killed outright (kill -9, the out-of-memory killer) cannot stop its workers, and the run
    directory's lock, which it held, is released with it: workers that trained and saved on would write
    alongside the next `burst train --resume`, the new holder of the lock.

    A worker forked from the server inherits the environment the server started with, which an earlier call in
    this process may have started before the launcher's environment changed: what differs from it is what the agent
    set (RANK and the rest), laid over the launcher's environment as it is now."""
    die_with_launcher(launcher)
    given = {key: value for key, value in os.environ.items() if INHERITED_ENVIRONMENT.get(key) != value}
    os.environ.clear()
    os.environ.update(environment, **given)
    return fn(*args)


def die_with_launcher(launcher: int) -> None:
    """End this worker with its launcher, however the launcher ends. A spawned worker is the launcher's child
    (die_with_parent). A worker forked from the launcher's server is its grandchild, and the server outlives the
    launcher while any worker lives (each holds the pipe whose end would end it): the worker watches the launcher
    itself (a pidfd, which the kernel makes readable when that process ends). A worker whose launcher already ended
    ends now."""
    parent = os.getppid()
    if parent == launcher:
        die_with_parent(launcher)
        return
    try:
        handle = os.pidfd_open(launcher)
    except OSError:  # no such process: the launcher ended
        os.kill(os.getpid(), signal.SIGKILL)
    # The launcher is still the server's parent: the handle is the launcher's, not a process that took its pid later
    if parent_of(parent) != launcher:
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        select.select([handle], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def parent_of(pid: int) -> int | None:
    """The parent of process `pid` (Linux's /proc), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:  # "pid (name) state ppid ...": the name may hold spaces, ")"
            return int(stat.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """Have the kernel SIGKILL this process when its parent (pid `parent`) ends (Linux's PR_SET_PDEATHSIG);
    where prctl is not there, a daemon thread watches for the parent to change instead. A parent that
    ended before this was set up ends this process now."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    if libc is None or libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(poll_s)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def first_failure(err: ChildFailedError) -> tuple[int, str, str, str]:
    """(rank, error type, message, traceback) of the first worker that failed; the type is "" when the process
    died without raising (killed, out of memory), and the message then says how it ended."""
    rank, failure = err.get_first_failure()
    if not isinstance(failure.message, dict):  # no error file
        return rank, "", f"exited with code {failure.exitcode} ({failure.message})", ""
    error_type, _, text = failure.message.get("message", "").partition(": ")
    return rank, error_type, text, failure.message.get("extraInfo", {}).get("py_callstack", "")


def available_cores() -> int:
    """Cores this process may run on (fewer than os.cpu_count() under a CPU mask or container)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_process(nproc: int) -> int:
    """Intra-op threads for one of `nproc` local processes, so they do not oversubscribe the cores."""
    return max(1, available_cores() // nproc)
