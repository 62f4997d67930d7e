"""What a run reports, on rank 0: a live display (or plain lines), OUT/metrics.jsonl, and the plots (TensorBoard
when installed, W&B when asked for: trainer/plots.py), which one line names at the start.

    metrics = Metrics(out, total_steps)
    metrics.log(step, {"loss": 2.31, "lr": 1e-3, ...})
    metrics.event("model_ready", {"seconds": 4.2, ...}, "model ready: ...")   # a line with "event", no "step"
    metrics.event("validation", {"loss": 2.4, ...}, "validation loss ...", step=10)   # also plotted at step 10
    metrics.progress("validation", done, total)   # a pass that is not a step: a bar, or plain lines
    metrics.close()
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from runtime.console import make_console
from trainer.plots import plot_sinks


def format_line(step: int, total_steps: int, values: dict[str, Any]) -> str:
    """One human-readable line per logged step (the same in the live display and in plain logs)."""
    loss, norm = ("-" if values[name] is None else f"{values[name]:{form}}" for name, form in (("loss", ".4f"),
                                                                                                ("grad_norm", ".3f")))
    line = (f"step {step:>{len(str(total_steps))}}/{total_steps}  loss {loss}  lr {values['lr']:.2e}  "
            f"grad norm {norm}  {values['tokens_per_s']:,.0f} tok/s  "
            f"step {values['step_time_s']:.2f} s  mem {values['peak_mem_mib']:,.0f} MiB")
    if values.get("skipped"):
        line += f"  [skipped: {values['skip_reason']}]"
    return line


class Metrics:
    """Logs on rank 0: one JSON object per logged step in `out/metrics.jsonl`, the plots (TensorBoard when installed,
    W&B in mode `wandb`, with the run's `settings`), and a live progress display with ETA on a terminal (plain lines
    otherwise, e.g. in a job log)."""

    def __init__(self, out: Path, total_steps: int, console: Console | None = None, wandb: str | None = None,
                 settings: dict[str, Any] | None = None) -> None:
        self.total_steps = total_steps
        self.console = console or make_console()
        self._jsonl = open(out / "metrics.jsonl", "a")
        self._plots = plot_sinks(out, wandb, settings or {})
        self.console.print("metrics: " + ", ".join([str(out / "metrics.jsonl"), *(sink.where for sink in self._plots)]),
                           soft_wrap=True)
        self._progress = None
        if self.console.is_terminal:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("ETA"), TimeRemainingColumn(), TextColumn("elapsed"),
                                      TimeElapsedColumn(), console=self.console)
            self._task = self._progress.add_task("training", total=total_steps)
            self._progress.start()
        self._step_times: list[float] = []
        self._passes: dict[str, tuple[float, Any]] = {}  # progress(): each pass's start, and its bar on a terminal

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Record the metrics of `step` (1-based): loss, lr, grad_norm, tokens_per_s, step_time_s, peak_mem_mib,
        and tokens_by_source ({source: tokens so far}: several TensorBoard series)."""
        record = {"step": step, **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._plot("train", values, step)
        line = format_line(step, self.total_steps, values)
        if self._progress is not None:
            self._progress.update(self._task, completed=step)
            self._progress.console.print(line)
        else:
            self._step_times.append(values["step_time_s"])
            recent = self._step_times[-20:]
            eta = datetime.timedelta(seconds=round(sum(recent) / len(recent) * (self.total_steps - step)))
            print(f"{line}  eta {eta}", flush=True)

    def progress(self, label: str, done: int, total: int) -> None:
        """How far a pass that is not a training step (validation) is: `done` of its `total` parts, called at 0
        first and at `total` last. A bar beside training's on a terminal; otherwise a plain line at each quarter
        (none at the end: the pass's own result follows)."""
        if done == 0:
            bar = self._progress.add_task(label, total=total) if self._progress is not None else None
            self._passes[label] = (time.perf_counter(), bar)
            return
        started, bar = self._passes[label]
        if bar is not None:
            self._progress.update(bar, completed=done)
            if done == total:
                self._progress.remove_task(bar)
        elif done < total and 4 * done // total > 4 * (done - 1) // total:
            seconds = time.perf_counter() - started
            eta = datetime.timedelta(seconds=round(seconds / done * (total - done)))
            print(f"{label} {done}/{total}  {seconds:.1f} s  eta {eta}", flush=True)

    def event(self, name: str, values: dict[str, Any], text: str, step: int | None = None) -> None:
        """Record something that happened to the run, not a step's metrics (start-up, a restart, a validation
        pass), and print `text`; with `step`, its numbers are also plotted at that step, as NAME/KEY."""
        self._jsonl.write(json.dumps({"event": name, **values}) + "\n")
        self._jsonl.flush()
        if step is not None:
            self._plot(name, values, step)
        self.message(text)

    def _plot(self, prefix: str, values: dict[str, Any], step: int) -> None:
        """The numbers among `values` (a dict's, such as tokens_by_source, as several series) to every plot."""
        scalars = {f"{prefix}/{name}" + (f"/{key}" if key else ""): float(number) for name, value in values.items()
                   for key, number in (value.items() if isinstance(value, dict) else [("", value)])
                   if isinstance(number, int | float)}  # not a skipped step's missing loss, nor its reason
        for sink in self._plots:
            sink.add(scalars, step)

    def message(self, text: str) -> None:
        """A line that is not a step's metrics (a warning, the end of the run)."""
        (self._progress.console if self._progress is not None else self.console).print(text)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        for sink in self._plots:
            sink.close()
        self._jsonl.close()
