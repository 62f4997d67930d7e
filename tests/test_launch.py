"""runtime.process.leaving_process_group: ranks tear down together after a clean end, at once after an error;
runtime.launch.die_with_parent: a worker ends with its launcher, however the launcher ends."""

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.process import leaving_process_group
from tests.distributed import free_port


def _leave(rank: int, port: int, fail: bool, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    started = time.perf_counter()
    try:
        with leaving_process_group():
            if rank == 0:
                time.sleep(1.0)  # rank 0 still busy (say, printing a report) when rank 1 is done
            if fail:
                raise RuntimeError("boom")
    except RuntimeError:
        pass
    results[rank] = (time.perf_counter() - started, dist.is_initialized())


def _leave_times(fail: bool) -> dict:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_leave, args=(free_port(), fail, results), nprocs=2, join=True)
        return dict(results)


def test_a_clean_end_waits_for_every_rank_before_tearing_down():
    results = _leave_times(fail=False)
    assert results[1][0] >= 0.9, "rank 1 tore its group down while rank 0 was still using it"
    assert not results[0][1] and not results[1][1]  # both left the group


def test_an_error_tears_down_at_once_without_waiting_for_the_others():
    results = _leave_times(fail=True)
    assert results[1][0] < 0.9, "after an error a rank must not wait for ranks that may be gone"
    assert not results[0][1] and not results[1][1]


# A launcher starts a worker that dies with it, and prints the worker's pid once the worker is ready.
WORKER = """
import os, sys, time
from runtime.launch import die_with_parent
sys.platform = PLATFORM  # "darwin": as where prctl is missing, the watchdog alone
die_with_parent(os.getppid(), poll_s=0.05)
print("ready", flush=True)
time.sleep(120)
"""
LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert worker.stdout.readline().strip() == "ready"
print(worker.pid, flush=True)
time.sleep(120)
"""


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_a_worker_dies_with_its_launcher_killed_outright(platform):
    worker_code = WORKER.replace("PLATFORM", repr(platform))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, worker_code], stdout=subprocess.PIPE, text=True,
                                cwd=Path(__file__).parents[1])
    try:
        worker = int(launcher.stdout.readline())
        assert running(worker)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 10
    while running(worker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not running(worker)
