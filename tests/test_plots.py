"""The plots of a run (trainer/plots.py): TensorBoard when installed and W&B when asked for get the training
metrics and the validation loss at its step, the same numbers as metrics.jsonl; one line at the start names every
place the metrics go; --wandb without the package, or with an unknown mode, is refused in one line.

Neither package is needed: a fake SummaryWriter stands in for TensorBoard's, and a fake `wandb` package on the
run's PYTHONPATH for W&B, so no test makes a network call."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cli import app
from tests.fixtures import events, metrics
from trainer.metrics import Metrics

REPO = Path(__file__).parents[1]
STEP = {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 900.0, "step_time_s": 0.3, "peak_mem_mib": 512.0,
        "skipped": False, "skip_reason": None, "tokens_by_source": {"code": 256}}
VALIDATION = {"at_step": 2, "loss": 2.25, "held_out_tokens": 512, "sequences": 2, "seconds": 0.1, "left_out": 0}


class FakeSummaryWriter:
    """What TensorBoard's SummaryWriter is given."""

    written: list[tuple[str, float, int]] = []

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.written.append((name, value, step))

    def close(self) -> None:
        pass


def quiet_metrics(out: Path) -> tuple[Metrics, io.StringIO]:
    printed = io.StringIO()
    return Metrics(out, 2, Console(file=printed, width=200)), printed


def test_tensorboard_gets_the_validation_loss_at_its_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    monkeypatch.setattr(FakeSummaryWriter, "written", [])
    run, printed = quiet_metrics(tmp_path)
    run.log(2, STEP)
    run.event("validation", VALIDATION, "validation loss 2.2500 at step 2", step=VALIDATION["at_step"])
    run.event("model_ready", {"seconds": 1.0}, "model ready")  # no step: in metrics.jsonl only
    run.close()
    assert printed.getvalue().startswith(f"metrics: {tmp_path / 'metrics.jsonl'}, TensorBoard "
                                         f"({tmp_path / 'tensorboard'})\n")
    written = {name: (value, step) for name, value, step in FakeSummaryWriter.written}
    recorded = events(tmp_path, "validation")[0]
    assert written["validation/loss"] == (recorded["loss"], recorded["at_step"]) == (2.25, 2)
    assert written["validation/held_out_tokens"] == (512, 2)
    assert written["train/loss"] == (metrics(tmp_path)[0]["loss"], 2)
    assert written["train/tokens_by_source/code"] == (256, 2)
    assert not any(name.startswith("model_ready") for name in written)


def test_without_tensorboard_the_line_names_metrics_jsonl_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # importing it raises ImportError
    run, printed = quiet_metrics(tmp_path)
    run.event("validation", VALIDATION, "validation loss", step=2)
    run.close()
    assert printed.getvalue().splitlines()[0] == f"metrics: {tmp_path / 'metrics.jsonl'}"


@pytest.mark.parametrize(("mode", "refusal"), [("offline", "--wandb offline needs the wandb package, which is not "
                                                           "installed: pip install 'burst-attention[wandb]'"),
                                               ("offlin", "--wandb 'offlin' must be offline")])
def test_wandb_without_its_package_or_with_an_unknown_mode_is_refused_in_one_line(mode, refusal, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, whatever this machine has
    result = CliRunner().invoke(app, ["train", "--wandb", mode, "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and refusal in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


FAKE_WANDB = '''
import json, os

class Run:
    def __init__(self, path):
        self.path = path

    def log(self, scalars, step):
        with open(self.path, "a") as file:
            file.write(json.dumps({"step": step, **scalars}) + "\\n")

    def finish(self):
        with open(self.path, "a") as file:
            file.write(json.dumps({"finished": True}) + "\\n")

def init(project, name, dir, mode, config):
    path = os.path.join(dir, "fake_wandb.jsonl")
    with open(path, "a") as file:
        file.write(json.dumps({"project": project, "name": name, "mode": mode, "seq_len": config["seq_len"]}) + "\\n")
    return Run(path)
'''


def test_a_run_with_wandb_plots_its_validation_losses_and_steps(store: Path, tmp_path: Path):
    """`burst train --wandb offline` end to end, with a fake `wandb` that writes what it is given to a file."""
    (tmp_path / "fake" / "wandb").mkdir(parents=True)
    (tmp_path / "fake" / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), str(REPO)]), "WANDB_PROJECT": "p"}
    done = subprocess.run([sys.executable, "-m", "cli", "train", "--data", str(store), "--model", "debug",
                           "--seq-len", "256", "--steps", "2", "--val-every", "1", "--precision", "fp32",
                           "--wandb", "offline", "--out", str(out)], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"metrics: {out / 'metrics.jsonl'}" in done.stdout and f"W&B offline (project p, {out / 'wandb'}" \
        in done.stdout, done.stdout
    lines = [json.loads(line) for line in (out / "fake_wandb.jsonl").read_text().splitlines()]
    assert lines[0] == {"project": "p", "name": "run", "mode": "offline", "seq_len": 256} and lines[-1] == \
        {"finished": True}
    plotted = [(line["step"], line["validation/loss"]) for line in lines if "validation/loss" in line]
    assert plotted == [(row["at_step"], row["loss"]) for row in events(out, "validation")] and len(plotted) == 3
    assert [(line["step"], line["train/loss"]) for line in lines if "train/loss" in line] == \
        [(row["step"], row["loss"]) for row in metrics(out)]
