"""Run a function on a gloo group of CPU processes, from a test.

    def _check(rank, world_size, x): ...          # module-level, so it pickles
    run_on_ranks(_check, world_size=3, args=(x,))

The ranks are started once per world size and kept for the test module (a `RankPool`): each process imports
torch and the project once, not once per test. They fork from a server that imported torch once for the session
(multiprocessing's forkserver, torch preloaded), so a pool starts in a fraction of a second instead of importing
torch again in every rank (about 3 s of CPU each, for over a hundred ranks in the suite). The server does nothing
but import, and a rank takes the caller's environment, as a spawned process would. A test that needs processes of
its own (it compiles, counts what a fresh process does first, or ends the group) passes `fresh=True` and gets a
spawned group for itself.

A failure on any rank fails the test with that rank's traceback. A rank that hangs fails the test instead of
blocking the suite: a spawned group after `timeout_s` in one collective, a pool's call after
CALL_LIMIT_FACTOR x `timeout_s` in all. A pool that failed, hung or lost its group is closed; the next call
starts another. BURST_TEST_FRESH_RANKS=1 makes every call spawn (to compare, or to rule the pool out).

Each call runs as it would in a fresh process, as far as a test can tell: the caller's environment
variables, the rank's initial torch seed, float32 as the default dtype and one thread. What a function leaves
elsewhere in its process (module globals, compiled graphs, new process groups) the next call sees.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing.forkserver
import os
import queue
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.process import leaving_process_group

GROUP_TIMEOUT_S = 300.0  # the gloo group's own limit on one collective
# A spawned group's `timeout_s` limits each collective; a pool's call gets this many times it in all, on the clock
# (a loaded machine runs a long call past `timeout_s` without any collective hanging)
CALL_LIMIT_FACTOR = 3
# Imported once by the server pool ranks fork from. A rank imports the test module its function comes from (to
# unpickle it), and with it transformers, pytest and the project (3 to 5 s of CPU where the module uses
# transformers); torch._dynamo comes with the first optimizer step. Imported here, a rank begins with them, and so
# does a `burst train` that tests.fixtures runs (cli, tests.fixtures: its entry point).
PRELOADED = ["torch", "torch.distributed", "torch._dynamo", "transformers", "pytest", "burst", "models", "data",
             "checkpoints", "evaluation", "trainer.train", "tests.distributed", "cli", "tests.fixtures"]
KEPT_POOLS = 3  # pools alive at once (each rank holds torch and the project): the most recently used
# what this session's calls asked for (a spawn per call would start "ranks asked") and started (conftest prints it)
counts = {"calls": 0, "ranks asked": 0, "ranks started": 0}


def start_forkserver() -> None:
    """Start the server the pools' ranks fork from, with PRELOADED imported. The workers of runtime.launch.run_local
    (a command a test runs in its own process: `burst bench attention --nproc 2`) fork from the same server, and ask
    for their function's module alone: had one started it first, every pool of the session would import
    transformers and pytest again in each rank."""
    multiprocessing.set_forkserver_preload(PRELOADED)
    multiprocessing.forkserver.ensure_running()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # world_size processes share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _leave_at_once() -> None:
    # A clean end leaves at once: C++ destructors run at interpreter exit can abort a finished
    # worker now and then ("terminate called without an active exception", SIGABRT), which
    # would fail a test whose every assertion passed. Errors still propagate above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank: int, world_size: int, port: int, fn, args: tuple, timeout_s: float) -> None:
    _join_group(rank, world_size, port, timeout_s)
    with leaving_process_group():
        fn(rank, world_size, *args)
    _leave_at_once()


def _serve(rank: int, world_size: int, port: int, tasks, results, environment: dict) -> None:
    """A pool's rank: join the group, then run each task sent until told to stop (None)."""
    os.environ.clear()  # the caller's when the pool started, not the server's: as a spawned rank inherits it
    os.environ.update(environment)
    _join_group(rank, world_size, port, GROUP_TIMEOUT_S)
    group_env = {key: os.environ[key] for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    seed = torch.initial_seed()
    while (task := tasks.get()) is not None:
        fn, args, environment = task
        os.environ.clear()
        os.environ.update(environment, **group_env)
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        torch.set_num_threads(1)
        try:
            fn(rank, world_size, *args)
            dist.barrier()  # the ranks end each call together, as leaving_process_group has them do
        except BaseException:  # noqa: BLE001 -- any failure is the test's, with its traceback
            results.put((rank, traceback.format_exc()))
            break  # the other ranks may be inside a collective: the pool is closed, not reused
        if not dist.is_initialized():
            results.put((rank, "the function destroyed the process group; call run_on_ranks(..., fresh=True)"))
            break
        results.put((rank, None))
    results.close()
    results.join_thread()  # what this rank reported reaches the test before the rank leaves
    _leave_at_once()


class RankPool:
    """`world_size` gloo ranks started once, to which tests send module-level functions."""

    def __init__(self, world_size: int):
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOADED)  # before the server's first start; the same list afterwards
        self.world_size = world_size
        self.tasks = [context.SimpleQueue() for _ in range(world_size)]
        self.results = context.Queue()
        port, environment = free_port(), dict(os.environ)
        self.processes = [context.Process(target=_serve, daemon=True,
                                          args=(rank, world_size, port, self.tasks[rank], self.results, environment))
                          for rank in range(world_size)]
        for process in self.processes:
            process.start()
        counts["ranks started"] += world_size
        self.usable = True

    def run(self, fn, args: tuple, timeout_s: float) -> None:
        """fn(rank, world_size, *args) on every rank; raises with the first failing rank's traceback."""
        environment = dict(os.environ)
        for rank_tasks in self.tasks:
            rank_tasks.put((fn, args, environment))
        limit_s = CALL_LIMIT_FACTOR * timeout_s
        deadline, done, failures = time.monotonic() + limit_s, set(), {}
        try:
            while len(done) < self.world_size:
                reported = self.next_result(0.2)
                if reported is None:
                    dead = [rank for rank, p in enumerate(self.processes) if not p.is_alive() and rank not in done]
                    if dead:
                        self.results_after_exit(done, failures)
                        if failures:
                            break
                        raise RuntimeError(f"rank {dead[0]} of {self.world_size} exited while running "
                                           f"{fn.__qualname__} (exit code {self.processes[dead[0]].exitcode})")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{fn.__qualname__} on {self.world_size} ranks took longer than "
                                           f"{limit_s:g} s; ranks {sorted(set(range(self.world_size)) - done)} "
                                           f"did not finish")
                    continue
                rank, failure = reported
                done.add(rank)
                if failure is not None:
                    failures[rank] = failure
                    self.results_after_exit(done, failures)  # the rank that failed first may report second
                    break  # the others may be waiting on the failed rank
        except BaseException:
            self.close()
            raise
        if failures:
            self.close()
            # the cause, not a rank that lost its connection to it (as mp.spawn would, when it saw that one first)
            causes = [rank for rank, failure in failures.items() if "by peer" not in failure.strip().splitlines()[-1]]
            rank = min(causes or failures)
            raise RuntimeError(f"\n\n-- Process {rank} terminated with the following error:\n{failures[rank]}")

    def next_result(self, wait_s: float) -> tuple[int, str | None] | None:
        """(rank, its traceback or None) of the next rank to finish, or None if none does within `wait_s`."""
        try:
            return self.results.get(timeout=wait_s)
        except queue.Empty:
            return None

    def results_after_exit(self, done: set, failures: dict) -> None:
        """What ranks reported just before a rank exited (its traceback is usually among them)."""
        while (reported := self.next_result(0.5)) is not None:
            rank, failure = reported
            done.add(rank)
            if failure is not None:
                failures[rank] = failure

    def close(self) -> None:
        self.usable = False
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=10)


_pools: dict[int, RankPool] = {}


def pool(world_size: int) -> RankPool:
    """The live pool of `world_size` ranks, started if there is none; the least recently used others are closed."""
    kept = _pools.pop(world_size, None)
    if kept is None or not kept.usable:
        kept = RankPool(world_size)
    _pools[world_size] = kept  # last: the most recently used
    while len(_pools) > KEPT_POOLS:
        _pools.pop(next(iter(_pools))).close()
    return kept


@atexit.register
def close_pools() -> None:
    """Close every pool: conftest does at the end of each test module, so no module sees another's state."""
    while _pools:
        _pools.popitem()[1].close()


def run_on_ranks(fn, world_size: int, args: tuple = (), timeout_s: float = 120.0, fresh: bool = False) -> None:
    """Call fn(rank, world_size, *args) on `world_size` ranks of one gloo group: the pool's, or with `fresh`,
    processes spawned for this call alone."""
    counts["calls"] += 1
    counts["ranks asked"] += world_size
    if fresh or os.environ.get("BURST_TEST_FRESH_RANKS") == "1":  # 1: every call spawns, as before the pools
        counts["ranks started"] += world_size
        mp.spawn(_worker, args=(world_size, free_port(), fn, args, timeout_s), nprocs=world_size, join=True)
    else:
        pool(world_size).run(fn, args, timeout_s)
