"""Starting the ranks: under torchrun, join the ranks it started; on one machine, start cp x dp of them here.

    burst train --cp 2                      # this process starts 2 workers (torch's elastic launcher)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        --rdzv-id JOB --max-restarts 3 --no-python burst train --cp 8 --dp 2 --out runs/job   # on every node

Every worker runs `train(config)`, which joins the process group (see distributed.py). When a worker
dies, the agent (this process, or torchrun on each node) stops the others and starts them all again,
up to --max-restarts times; the new workers continue the run from its newest complete checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from checkpoints.training import complete_checkpoints
from runtime.launch import first_failure, run_local, under_torchrun
from trainer.config import TrainConfig
from trainer.distributed import environment_world_size
from trainer.preflight import check_run, default_run_dir
from trainer.rundir import hold_run_directory
from trainer.signals import TrainingInterrupted, TrainingStopped


def launch(config: TrainConfig) -> None:
    """Run `train(config)` on every rank; raises ValueError, before any worker starts, on a bad config, and
    TrainingInterrupted after a signal stopped the run (its checkpoint saved)."""
    if under_torchrun():
        if config.out is None and environment_world_size() > 1:
            raise ValueError("under torchrun pass --out: every rank, on every node, must use the same run directory")
        train_rank(config)
        return
    config = dataclasses.replace(config, out=config.out or default_run_dir())
    with hold_run_directory(config.out):  # for the run's whole life, restarts included
        start_ranks(config)


def start_ranks(config: TrainConfig) -> None:
    """Check the run, then run it here (one process) or on cp x dp local worker processes."""
    # Before any process starts: refuses more ranks than GPUs (naming --device cpu), prepares the default corpus.
    # Each worker resolves the device again from the same request, environment and GPUs (and so says why).
    config = dataclasses.replace(check_run(config, world_size=config.world_size).config, device=config.device)
    if config.world_size == 1 and not config.max_restarts:  # a single process runs here, unless it may restart
        train_rank(config)
        return
    try:
        # torch's elastic launcher, as `torchrun --standalone --max-restarts N`
        # trainer.train and what it imports, for the workers alone; torch._dynamo: a rank's optimizer imports it
        # (torch.optim's step is kept out of compilation)
        run_local(train_rank, config.world_size, (config,), max_restarts=config.max_restarts,
                  preload=("trainer.train", "torch._dynamo"))
    except ChildFailedError as err:
        raise worker_failure(err) from None
    except SignalException as err:
        # The launcher passed SIGTERM/SIGINT on to the workers, which finished their step and saved
        # (a worker still saving after the launcher's grace period is killed: its previous checkpoint stays).
        newest = complete_checkpoints(Path(config.out))
        print(f"stopped by {err.sigval.name}; newest checkpoint: {newest[-1] if newest else 'none'}; "
              f"continue with: burst train --resume --out {config.out}", flush=True)
        raise TrainingInterrupted(err.sigval.name) from None


def train_rank(config: TrainConfig) -> None:
    """A rank's work, `trainer.train.train`, imported here: a launcher of workers never runs the training loop and
    does not import it, nor FSDP, DTensor and DCP with it (about 1 CPU s a launch; its workers' server does)."""
    from trainer.train import train

    train(config)


def worker_failure(err: ChildFailedError) -> TrainingStopped | TrainingInterrupted | ValueError:
    """The first failed worker's error as one message; with its traceback only when it is a bug, not a
    reported condition (TrainingStopped, ValueError). A worker a signal stopped stays TrainingInterrupted, and
    bad input a worker found (a ValueError: say, a damaged starting checkpoint) stays a ValueError (exit 2)."""
    rank, error_type, text, traceback = first_failure(err)
    if not error_type:
        return TrainingStopped(f"rank {rank} {text}")
    if error_type == "TrainingInterrupted":
        return TrainingInterrupted(text.removeprefix("stopped by "))
    if error_type == "ValueError":
        return ValueError(f"rank {rank}: {text}")
    if error_type not in ("TrainingStopped", "WriteFailed"):
        text = f"{error_type}: {text}\n{traceback}"
    return TrainingStopped(f"rank {rank}: {text}")
