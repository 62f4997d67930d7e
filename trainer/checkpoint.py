"""Saving and resuming training checkpoints: sharded with torch.distributed.checkpoint (DCP), written
atomically, resumable on any layout. Their layout (OUT/checkpoints/step-N/...), listing and checks live in
checkpoints/training.py, which `burst eval` and `burst convert-checkpoint` read them through.

Every rank writes into `step-N.tmp-<id>`; once all are written rank 0 writes COMPLETE and renames
the directory to `step-N` (trainer/saving.py, which also saves in the background). A kill during the
save leaves a tmp directory that readers ignore and `--resume` deletes, and the previous checkpoint
untouched: older checkpoints are deleted (--keep) only after the new one is complete.

DCP stores each tensor with its global shape, whatever the sharding it was saved from, so a run
saved with cp x dp ranks resumes on another layout, and one process without a process group reads
the weights (`burst convert-checkpoint`, `burst eval`). The loader's state is a position in the
global packing stream, the same on every rank and independent of the layout.
"""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoints.training import read_train_state, rng_name
from models.checkpoint import read_config
from models.config import ModelConfig
from models.storage import read_json
from runtime.directories import write_atomically


def check_model_config(path: Path, model_config: ModelConfig) -> None:
    """Refuse a checkpoint whose model is not `model_config` (another preset or shape)."""
    saved = read_config(path)
    if saved != model_config:
        diff = {k: (v, model_config.to_dict()[k]) for k, v in saved.to_dict().items() if model_config.to_dict()[k] != v}
        raise ValueError(f"checkpoint {path} holds another model than this run's: "
                         + ", ".join(f"{k} {a} in the checkpoint, {b} in the run" for k, (a, b) in diff.items())
                         + "; resume with the run's own settings (its config.toml), or start a new run")


# ---- RNG states and metrics (saving itself is trainer/saving.py) -------------------------------------------------

def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states (torch CPU and CUDA, Python's random) as JSON-able values, for its rng-N.json."""
    def encode(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    version, internal, gauss = random.getstate()
    state = {"torch": encode(torch.get_rng_state()), "python": [version, list(internal), gauss]}
    if device.type == "cuda":
        state["cuda"] = encode(torch.cuda.get_rng_state(device))
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    def decode(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(decode(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(decode(state["cuda"]), device)


def metrics_rows(out: Path) -> list[str]:
    """The lines of OUT/metrics.jsonl that hold a whole JSON object. A kill while a line was being written
    leaves it torn: the last line only, which is dropped (that step is trained and logged again); any other
    line that does not read is damage, refused with the line named."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} cannot be read ({err}); move it aside to resume without its history") from None
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            if number == len(lines):
                break  # a torn last line
            raise ValueError(f"{path} line {number} is not a JSON object ({line[:60]!r}): the run's history is "
                             f"damaged; repair or delete that line, then resume")
        rows.append(line)
    return rows


def forget_metrics_after(out: Path, step: int) -> None:
    """Drop the rows of OUT/metrics.jsonl past `step` (and a torn last line): a resumed run trains those steps
    again and logs them anew. Event rows (start-ups, restarts) stay: they are the run's history. The file is
    replaced whole."""
    rows = [line for line in metrics_rows(out) if json.loads(line).get("step", 0) <= step]
    if (out / "metrics.jsonl").is_file():
        write_atomically(out / "metrics.jsonl", "".join(row + "\n" for row in rows))


# ---- load ------------------------------------------------------------------------------------------------------

def load_stage_start(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Start a new stage (--init-from) from the checkpoint `path`: the model's weights, and with `optimizer` its
    state too (AdamW's moments and step counts), keeping this run's hyperparameters (lr, betas, weight decay:
    the new stage's schedule drives them). Any layout, as `load_checkpoint`; the rest of the run starts afresh."""
    import torch.distributed.checkpoint as dcp  # here: the launcher's preflight reads this module, not DCP (1 CPU s)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer) if optimizer is not None else \
        (get_state_dict(model, [])[0], None)
    state = {"model": model_state} if optimizer is None else {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())  # only the keys asked for
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
        return
    hyperparameters = [{key: value for key, value in group.items() if key != "params"}
                       for group in optimizer.param_groups]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for group, own in zip(optimizer.param_groups, hyperparameters, strict=True):
        group.update(own)


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    device: torch.device) -> dict[str, Any]:
    """Load the checkpoint `path` into `model` and `optimizer` (sharded or not, any layout) and this rank's RNG;
    returns the saved train state (TrainState, schedule and loader states)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = path / rng_name(rank)  # a rank the saving run did not have takes rank 0's states
    _set_rng_state(read_json(rng_file if rng_file.is_file() else path / rng_name(0)), device)
    return read_train_state(path)


