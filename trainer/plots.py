"""Where a run's numbers are also plotted, besides OUT/metrics.jsonl: TensorBoard when it is installed, and W&B
when asked for (`--wandb offline|online`). Each takes named scalars at a step.

    sinks = plot_sinks(out, wandb="offline", settings=config_values)
    for sink in sinks:
        sink.add({"train/loss": 2.31, "validation/loss": 2.40}, step=10)
    print(", ".join(sink.where for sink in sinks))   # TensorBoard (runs/x/tensorboard), W&B offline (...)
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Protocol

WANDB_MODES = ("offline", "online")
WANDB_INSTALL = "pip install 'burst-attention[wandb]'"


class PlotSink(Protocol):
    where: str  # what and where, for the run's "metrics: ..." line

    def add(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    """Event files under `directory`, for `tensorboard --logdir`."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the optional `tensorboard` package

        self._writer = SummaryWriter(str(directory))
        self.where = f"TensorBoard ({directory})"

    def add(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


class WandB:
    """A W&B run of this invocation (a resumed run starts another: its steps restart at the checkpoint's), named
    after the run directory, with the run's settings as its config; offline, it stays in OUT/wandb for `wandb sync`.
    The project is $WANDB_PROJECT, else burst."""

    def __init__(self, out: Path, mode: str, settings: dict[str, Any]) -> None:
        import wandb  # pip install 'burst-attention[wandb]' (checked before the run starts: check_wandb)

        project = os.environ.get("WANDB_PROJECT", "burst")
        self._run = wandb.init(project=project, name=out.name, dir=str(out), mode=mode, config=settings)
        self.where = f"W&B {mode} (project {project}, " + \
            (f"{out / 'wandb'}: upload with wandb sync)" if mode == "offline" else f"run {out.name})")

    def add(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


def check_wandb(mode: str | None) -> None:
    """Refuse --wandb MODE, in one line, where it cannot work: an unknown mode, or no `wandb` package."""
    if mode is None:
        return
    if mode not in WANDB_MODES:
        raise ValueError(f"--wandb {mode!r} must be offline (kept in the run directory, uploaded later with "
                         f"wandb sync) or online")
    if importlib.util.find_spec("wandb") is None:
        raise ValueError(f"--wandb {mode} needs the wandb package, which is not installed: {WANDB_INSTALL}, or "
                         f"leave out --wandb")


def plot_sinks(out: Path, wandb: str | None, settings: dict[str, Any]) -> list[PlotSink]:
    """TensorBoard under OUT/tensorboard when installed, and W&B in mode `wandb` (None: none)."""
    sinks: list[PlotSink] = []
    try:
        sinks.append(TensorBoard(out / "tensorboard"))
    except ImportError:
        pass
    if wandb is not None:
        sinks.append(WandB(out, wandb, settings))
    return sinks
