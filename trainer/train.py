"""`train(config)`: one rank's whole invocation: check the checked, join the process group, run the Trainer.

The phases of a run (set-up, resume, step, save, finish) are trainer/trainer.py's Trainer; one optimizer
step is trainer/step.py; what may start at all is decided before any process joins (trainer/preflight.py).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time

from runtime.process import leaving_process_group
from trainer.config import TrainConfig
from trainer.distributed import (
    check_settings_agree,
    environment_world_size,
    init_distributed,
    is_collective_timeout,
    unresponsive_ranks,
)
from trainer.preflight import CheckedRun, check_run, invocation_done, restart_count
from trainer.rundir import hold_run_directory
from trainer.trainer import Trainer, TrainingStopped


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def train(config: TrainConfig) -> None:
    """Train with `config` as one rank of the process group the environment describes (or as a single process).

    Raises ValueError on a bad config before any work, and TrainingStopped when the run cannot continue.
    """
    started = time.perf_counter()
    if restart_count() and invocation_done(config):
        return  # the worker that died had saved this invocation's last checkpoint: nothing is left to do
    # Rank 0 writes the run directory: it holds its lock (taken already when the launcher started this worker).
    held = hold_run_directory(config.out) if config.out and global_rank() == 0 else contextlib.nullcontext()
    with held:
        checked = check_run(config, environment_world_size(), restart_count())  # every rank checks before joining
        run_rank(checked, started)


def run_rank(checked: CheckedRun, started: float) -> None:
    """Join the process group and run this rank's Trainer; a collective that times out names the hung rank."""
    env = init_distributed(checked.config)

    def run() -> None:
        check_settings_agree(checked.config, env)
        trainer = Trainer(checked, env, started)
        trainer.resume()
        trainer.train()

    if env.mesh is None:
        run()
        return
    with leaving_process_group():
        try:
            run()
        except RuntimeError as err:
            if isinstance(err, TrainingStopped) or not is_collective_timeout(err):
                raise
            # The other ranks have waited --timeout already: a minute more tells a hung rank from a slow one.
            timeout = checked.config.timeout
            answer = unresponsive_ranks(env, min(datetime.timedelta(minutes=timeout), datetime.timedelta(minutes=1)))
            raise TrainingStopped(f"a collective waited longer than --timeout {timeout:g} minutes ({err}); "
                                  f"{answer}. That rank hung (a deadlock, a stuck device or file system) or is "
                                  f"too slow: look at its log, or raise --timeout for very long steps") from err
