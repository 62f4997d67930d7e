"""runtime.process.leaving_process_group: ranks tear down together after a clean end, at once after an error;
runtime.launch.die_with_parent: a worker ends with its launcher, however the launcher ends; runtime.launch.run_local:
workers fork from a server that imported their module, in the launcher's environment as it is when they start."""

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

from runtime.launch import run_local
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


def assert_dies_soon(pid: int, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not running(pid)


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
    assert_dies_soon(worker)


def _as_started(name: str) -> dict:
    """What a worker of run_local finds as its function begins."""
    return {"cpu_s": time.process_time(), "parent": os.getppid(), "rank": os.environ["RANK"],
            "value": os.environ.get(name), "cwd": os.getcwd()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers fork from a server on Linux only")
def test_workers_fork_from_a_server_in_the_launchers_environment_as_it_is_when_they_start(monkeypatch, tmp_path):
    monkeypatch.setenv("BURST_TEST_LAUNCH", "first")
    first = run_local(_as_started, 2, ("BURST_TEST_LAUNCH",))
    # The server now runs, with the environment and directory it started in; the next workers fork from it.
    monkeypatch.setenv("BURST_TEST_LAUNCH", "second")
    monkeypatch.chdir(tmp_path)
    second = run_local(_as_started, 2, ("BURST_TEST_LAUNCH",))
    for run, value in ((first, "first"), (second, "second")):
        assert [run[rank]["rank"] for rank in (0, 1)] == ["0", "1"]
        assert [run[rank]["value"] for rank in (0, 1)] == [value, value]
    assert {second[rank]["cwd"] for rank in (0, 1)} == {str(tmp_path)}
    # Forked, not spawned by this process: a spawned worker imported torch again first (2-3 CPU s)
    assert all(run[rank]["parent"] != os.getpid() for run in (first, second) for rank in (0, 1))
    assert all(run[rank]["cpu_s"] < 1.0 for run in (first, second) for rank in (0, 1)), (first, second)


def _sleep_after_writing_pid(path: str) -> None:
    Path(path).write_text(str(os.getpid()))
    time.sleep(120)


RUN_LOCAL_LAUNCHER = """
import sys
from runtime.launch import run_local
from tests.test_launch import _sleep_after_writing_pid
run_local(_sleep_after_writing_pid, 1, (sys.argv[1],))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_a_worker_forked_from_the_server_dies_with_its_launcher_killed_outright(tmp_path):
    pid_file = tmp_path / "worker.pid"
    repo = Path(__file__).parents[1]
    launcher = subprocess.Popen([sys.executable, "-c", RUN_LOCAL_LAUNCHER, str(pid_file)], cwd=repo,
                                env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.is_file() and pid_file.read_text()) and launcher.poll() is None:
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        assert running(worker)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    assert_dies_soon(worker)


def test_the_launcher_of_ranks_imports_neither_the_training_loop_nor_fsdp_dtensor_or_dcp():
    """`burst train --cp 2` checks the run and starts the workers' server, which imports the training loop for
    them: the launcher itself, which only waits, leaves FSDP, DTensor (and sympy under it), DCP and the loop
    unimported (about 1 CPU s a launch)."""
    heavy = ["torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint", "sympy",
             "trainer.trainer", "trainer.train"]
    probe = f"import sys, cli, trainer.launch; print([name for name in {heavy!r} if name in sys.modules])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
