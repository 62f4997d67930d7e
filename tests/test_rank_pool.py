"""tests/distributed.py's pool of gloo ranks: a failure or a hang fails the test that caused it, and the next
test gets a working group."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import pool, run_on_ranks


def _sum_of_ranks(rank, world_size, expected):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert total.item() == expected
    assert os.environ["RANK"] == str(rank) and os.environ["BURST_TEST_POOL_MARK"] == "set by the test"
    torch.set_default_dtype(torch.float64)  # left behind on purpose: the next call must not see it


def _fresh_state(rank, world_size):
    assert torch.get_default_dtype() == torch.float32


def _same_first_draw(rank, world_size, path):
    value = torch.randn(1).item()  # no seed: each call starts from the rank's initial seed, as a new process would
    if rank == 0:
        path.write_text(repr(value))


def _rank_1_fails(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 was told to fail")
    dist.barrier()  # rank 0 waits on the failed rank, as a real failure leaves it


def _rank_0_hangs(rank, world_size):
    if rank == 0:
        time.sleep(60)


def test_the_pool_runs_each_call_in_the_callers_environment_and_state(monkeypatch, tmp_path):
    monkeypatch.setenv("BURST_TEST_POOL_MARK", "set by the test")
    run_on_ranks(_sum_of_ranks, 2, args=(1.0,))
    ranks = pool(2).processes
    run_on_ranks(_fresh_state, 2)
    assert pool(2).processes == ranks  # the same processes served both calls
    for call in ("first", "second"):
        run_on_ranks(_same_first_draw, 2, args=(tmp_path / call,))
    assert (tmp_path / "first").read_text() == (tmp_path / "second").read_text()


def test_a_rank_that_fails_fails_the_call_with_its_traceback_and_the_next_call_gets_new_ranks():
    run_on_ranks(_fresh_state, 2)
    failed = pool(2)
    with pytest.raises(RuntimeError, match="(?s)Process 1 terminated.*rank 1 was told to fail"):
        run_on_ranks(_rank_1_fails, 2, timeout_s=30)
    assert not any(process.is_alive() for process in failed.processes)
    run_on_ranks(_fresh_state, 2)
    assert pool(2) is not failed


def test_a_rank_that_hangs_fails_the_call_after_its_timeout_and_the_next_call_gets_new_ranks():
    run_on_ranks(_fresh_state, 2)
    hung, started = pool(2), time.monotonic()
    with pytest.raises(TimeoutError, match=r"_rank_0_hangs on 2 ranks took longer than 3 s; ranks \[0, 1\] did not"):
        run_on_ranks(_rank_0_hangs, 2, timeout_s=1)
    assert time.monotonic() - started < 20
    assert not any(process.is_alive() for process in hung.processes)
    run_on_ranks(_fresh_state, 2)


def test_a_burst_train_forked_from_the_server_is_the_command_run_alone(store, tmp_path, monkeypatch):
    """tests.fixtures.burst_train forks `burst train` from the pools' server instead of starting the interpreter:
    the same losses bit for bit, output, exit codes and refusals as `python -m cli train` run alone, the caller's
    environment included (BURST_DEVICE, read when the command runs)."""
    from tests.fixtures import burst_train, metrics

    args = ["--model", "debug", "--data", store, "--seq-len", 128, "--steps", 2, "--precision", "fp32"]
    forked = burst_train(*args, "--out", tmp_path / "forked")
    monkeypatch.setenv("BURST_TEST_SPAWN_COMMANDS", "1")
    alone = burst_train(*args, "--out", tmp_path / "alone")
    assert forked.returncode == alone.returncode == 0, forked.stderr[-2000:] + alone.stderr[-2000:]
    kept = ("step", "loss", "grad_norm", "lr", "skipped", "scored_tokens")  # not the times, nor memory
    assert [{key: row[key] for key in kept} for row in metrics(tmp_path / "forked")] == \
        [{key: row[key] for key in kept} for row in metrics(tmp_path / "alone")]

    def shape(done, run: str) -> list[str]:  # the output without its times, speeds and run directory
        lines = done.stdout.replace(str(tmp_path / run), "RUN").splitlines()
        return [re.sub(r"[0-9.,:]+", "#", line) for line in lines]

    assert shape(forked, "forked") == shape(alone, "alone")
    monkeypatch.setenv("BURST_DEVICE", "nonsense")
    refusals = [burst_train(*args, "--out", tmp_path / "refused")]
    monkeypatch.delenv("BURST_TEST_SPAWN_COMMANDS")
    refusals.append(burst_train(*args, "--out", tmp_path / "refused"))
    assert [done.returncode for done in refusals] == [2, 2]
    assert refusals[0].stderr == refusals[1].stderr and "BURST_DEVICE" in refusals[1].stderr, refusals[1].stderr
    assert not (tmp_path / "refused").exists()
