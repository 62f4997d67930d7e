"""Surviving failures: a worker killed from outside, the launcher restarting the workers, and the run continuing
from its newest complete checkpoint to the losses of an uninterrupted run (through the real command line); a
rank that hangs named once a collective times out."""

import datetime
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed import free_port
from tests.fixtures import events, metrics
from tests.test_checkpoint import COMMON, REPO, UNINTERRUPTED, losses, train_command
from trainer.config import load_config
from trainer.distributed import Distributed, is_collective_timeout, unresponsive_ranks
from trainer.train import train


def workers_of(launcher: int) -> list[int]:
    """The worker processes the launcher `launcher` started: forked by its forkserver (runtime/launch.py), or
    spawned by it where there is none; not the server itself, nor the resource tracker."""
    processes = {}
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            processes[int(entry.name)] = ppid, (entry / "cmdline").read_bytes()
        except (ValueError, OSError):  # not a process, or one that just ended
            continue
    servers = {pid for pid, (ppid, command) in processes.items() if ppid == launcher and b"forkserver" in command}
    return sorted(pid for pid, (ppid, command) in processes.items()
                  if ppid in servers or (ppid == launcher and b"spawn_main" in command))


def kill_a_worker_after(command: list[str], out: Path, step: int) -> subprocess.CompletedProcess:
    """Run `command`, SIGKILL one of its workers once OUT/metrics.jsonl shows `step`, and let it finish."""
    with open(out.with_suffix(".log"), "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 240
        while process.poll() is None and time.monotonic() < deadline:
            if (out / "metrics.jsonl").is_file() and any(row["step"] >= step for row in metrics(out)):
                os.kill(workers_of(process.pid)[-1], signal.SIGKILL)
                break
            time.sleep(0.01)
        process.wait(timeout=240)
    return subprocess.CompletedProcess(command, process.returncode, out.with_suffix(".log").read_text())


def test_a_killed_worker_is_restarted_and_the_run_ends_with_the_losses_of_an_uninterrupted_one(store, uninterrupted,
                                                                                              tmp_path):
    whole = uninterrupted(store, *UNINTERRUPTED)
    command = train_command(*UNINTERRUPTED, "--data", store, "--checkpoint-every", 4, "--max-restarts", 1, "--out",
                            tmp_path / "run")
    killed = kill_a_worker_after(command, tmp_path / "run", step=6)
    assert killed.returncode == 0, killed.stdout[-3000:]
    restarts = events(tmp_path / "run", "restart")
    assert [(r["attempt"], r["from_step"]) for r in restarts] in ([(1, 4)], [(1, 8)]), restarts
    assert losses(tmp_path / "run") == losses(whole)  # all 12 steps, bit for bit
    assert len(events(tmp_path / "run", "model_ready")) == 2  # the first start and the restart


def _hang(rank: int, port: int, named) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Joining has a generous limit: on a loaded machine (the suite's other worker, its process groups) the two
    # spawned ranks may reach this line seconds apart. The collective that hangs has a group of its own with the
    # 2 s limit, made once both ranks are here.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    dist.barrier()
    hanging = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    env = Distributed(rank, 2, torch.device("cpu"), None, dist.new_group(backend="gloo"))
    if rank == 1:
        # stuck past the group's 2 s timeout, as in a deadlock: until rank 0 has named it, however long that takes
        assert named.wait(timeout=300), "rank 0 never named the hung rank"
    else:
        try:
            dist.all_reduce(torch.ones(1), group=hanging)
        except RuntimeError as err:
            assert is_collective_timeout(err), err
            answer = unresponsive_ranks(env, datetime.timedelta(seconds=1))
            assert "Ranks 1 failed to pass monitoredBarrier" in answer, answer
        else:
            raise AssertionError("the collective with a hung rank did not time out")
        finally:
            named.set()
    dist.destroy_process_group()  # no barrier: the group's connections broke with the timeout


def test_a_collective_with_a_hung_rank_times_out_and_the_hung_rank_is_named():
    mp.spawn(_hang, args=(free_port(), mp.get_context("spawn").Event()), nprocs=2, join=True)


def test_a_restart_after_the_last_checkpoint_was_saved_has_nothing_left_to_do(store, tmp_path, monkeypatch):
    out = tmp_path / "run"
    done = subprocess.run(train_command(*COMMON, "--data", store, "--steps", 3, "--out", out), capture_output=True,
                          text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    before = (out / "metrics.jsonl").read_text()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # as in a worker the agent restarted
    train(load_config(out / "config.toml", {"out": str(out)}))
    assert (out / "metrics.jsonl").read_text() == before  # no step trained again, no restart logged
