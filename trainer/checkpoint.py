"""Training checkpoints: sharded with torch.distributed.checkpoint (DCP), written atomically, resumable on any layout.

    OUT/checkpoints/step-000012/
        .metadata, __0_0.distcp, ...   DCP: model and optimizer, each rank writing its own shards
        config.json                    the model's ModelConfig: the checkpoint describes itself
        train_state.json               step, token count, LR schedule, data-loader position
        rng-00000.json, ...            each rank's RNG states (torch CPU and CUDA, Python's random)
        COMPLETE                       written last, by rank 0, once every rank's files are there

Every rank writes into `step-N.tmp-<id>`; after a barrier rank 0 writes COMPLETE and renames the
directory to `step-N`. A kill during the save leaves a tmp directory that readers ignore and
`--resume` deletes, and the previous checkpoint untouched: older checkpoints are deleted (--keep)
only after the new one is complete.

DCP stores each tensor with its global shape, whatever the sharding it was saved from, so a run
saved with cp x dp ranks resumes on another layout, and one process without a process group reads
the weights (`burst convert-checkpoint`, `burst eval`). The loader's state is a position in the
global packing stream, the same on every rank and independent of the layout.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
import signal
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from models.checkpoint import CONFIG_NAME, check_tensor_shapes, expected_shapes, read_config
from models.config import ModelConfig
from models.convert import Checkpoint
from models.storage import read_json, write_json

CHECKPOINTS_DIR = "checkpoints"
MARKER = "COMPLETE"
STATE_NAME = "train_state.json"
DCP_METADATA = ".metadata"
MODEL_PREFIX = "model."  # DCP flattens {"model": {...}, "optimizer": {...}} into dotted keys
# Test hook: SIGKILL this process during the save of step N, after the shards are written, before the rename.
KILL_DURING_SAVE_ENV = "BURST_TEST_KILL_DURING_SAVE"
_COMPLETE_NAME = re.compile(r"step-(\d+)")
# DCP warns on every call without a process group, even when asked for exactly that (no_dist=True).
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / CHECKPOINTS_DIR / f"step-{step:06d}"


def complete_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints of the run in `out`, oldest first (tmp directories of interrupted saves are not)."""
    root = out / CHECKPOINTS_DIR
    found = [p for p in root.iterdir() if _COMPLETE_NAME.fullmatch(p.name) and (p / MARKER).is_file()] \
        if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


def is_run_or_checkpoint(path: Path) -> bool:
    """Whether `path` is a training checkpoint or a run directory holding checkpoints (possibly none complete)."""
    return (path / DCP_METADATA).is_file() or (path / MARKER).is_file() or (path / CHECKPOINTS_DIR).is_dir()


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint `path` names: itself, or for a run directory its newest complete checkpoint; checked."""
    path = Path(path)
    if (path / CHECKPOINTS_DIR).is_dir() or (path / "config.toml").is_file():
        complete = complete_checkpoints(path)
        if not complete:
            raise ValueError(f"the run directory {path} holds no complete checkpoint (a save that was interrupted "
                             f"leaves only a .tmp directory); train with --checkpoint-every N, or start a new run")
        path = complete[-1]
    check_checkpoint(path)
    return path


def check_checkpoint(path: Path) -> None:
    """Refuse a checkpoint that is partial or damaged, naming what is wrong; reads metadata only."""
    if not (path / MARKER).is_file():
        raise ValueError(f"checkpoint {path} has no {MARKER} marker: its save did not finish (the process was "
                         f"stopped during it); resume from an earlier checkpoint or delete {path}")
    for name in (DCP_METADATA, CONFIG_NAME, STATE_NAME):
        if not (path / name).is_file():
            raise ValueError(f"checkpoint {path} lacks {name}: it is damaged (files were deleted or not copied); "
                             f"resume from an earlier checkpoint")
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # a truncated pickle raises whatever unpickling hits
        raise ValueError(f"checkpoint {path}: {DCP_METADATA} cannot be read ({err}); the checkpoint is damaged, "
                         f"resume from an earlier one") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file() or file.stat().st_size < size:
            what = "is missing" if not file.is_file() else f"has {file.stat().st_size} bytes, {size} are needed"
            raise ValueError(f"checkpoint {path}: the shard file {name} {what}; the checkpoint is damaged, "
                             f"resume from an earlier one")


def check_model_config(path: Path, model_config: ModelConfig) -> None:
    """Refuse a checkpoint whose model is not `model_config` (another preset or shape)."""
    saved = read_config(path)
    if saved != model_config:
        diff = {k: (v, model_config.to_dict()[k]) for k, v in saved.to_dict().items() if model_config.to_dict()[k] != v}
        raise ValueError(f"checkpoint {path} holds another model than this run's: "
                         + ", ".join(f"{k} {a} in the checkpoint, {b} in the run" for k, (a, b) in diff.items())
                         + "; resume with the run's own settings (its config.toml), or start a new run")


# ---- save ------------------------------------------------------------------------------------------------------

def _rng_state(device: torch.device) -> dict[str, Any]:
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


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(out: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    train_state: dict[str, Any], model_config: ModelConfig, device: torch.device, keep: int) -> Path:
    """Save checkpoint `step` of the run in `out` on every rank (a collective); returns its directory.

    `train_state` (rank 0's) is the JSON-able rest of the run: TrainState, schedule and loader states.
    """
    final = checkpoint_dir(out, step)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tag = [uuid.uuid4().hex[:8]]
    if dist.is_initialized():
        dist.broadcast_object_list(tag, src=0)  # every rank writes into the same tmp directory
    tmp = final.with_name(f"{final.name}.tmp-{tag[0]}")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp),
             no_dist=not dist.is_initialized())
    write_json(_rng_state(device), tmp / f"rng-{rank:05d}.json")
    if os.environ.get(KILL_DURING_SAVE_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    _barrier()  # every rank's files are written
    if rank == 0:
        write_json(model_config.to_dict(), tmp / CONFIG_NAME)
        write_json(train_state, tmp / STATE_NAME)
        write_json({"step": step}, tmp / MARKER)
        if final.exists():  # a checkpoint of this step from an earlier invocation: the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(out)[:-keep]:
            shutil.rmtree(old)
    _barrier()  # no rank goes on (or exits) before the checkpoint is complete
    return final


def remove_interrupted_saves(out: Path) -> None:
    """Delete the tmp directories that saves killed midway left behind (rank 0, before the run saves again)."""
    root = out / CHECKPOINTS_DIR
    for tmp in root.glob("step-*.tmp-*") if root.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True)


def forget_metrics_after(out: Path, step: int) -> None:
    """Drop the rows of OUT/metrics.jsonl past `step`: a resumed run trains those steps again and logs them anew."""
    path = out / "metrics.jsonl"
    if path.is_file():
        rows = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(row + "\n" for row in rows))


# ---- load ------------------------------------------------------------------------------------------------------

def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    device: torch.device) -> dict[str, Any]:
    """Load the checkpoint `path` into `model` and `optimizer` (sharded or not, any layout) and this rank's RNG;
    returns the saved train state (TrainState, schedule and loader states)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = path / f"rng-{rank:05d}.json"  # a rank the saving run did not have takes rank 0's states
    _set_rng_state(read_json(rng_file if rng_file.is_file() else path / "rng-00000.json"), device)
    return read_json(path / STATE_NAME)


def read_model_checkpoint(path: Path) -> Checkpoint:
    """The model weights of a training checkpoint (or of a run directory's newest), read in this one process
    without the ranks that wrote them; validated from metadata, tensors read one at a time."""
    path = resolve_checkpoint(Path(path))
    config = read_config(path)
    items = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = {key.removeprefix(MODEL_PREFIX): meta for key, meta in items.items()
               if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}
    check_tensor_shapes({name: tuple(meta.size) for name, meta in tensors.items()}, expected_shapes(config),
                        str(path))

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for name, meta in tensors.items():
            state = {"model": {name: torch.empty(meta.size, dtype=meta.properties.dtype)}}
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
            yield name, state["model"][name]

    return Checkpoint(config, read)


def step_of(path: Path) -> int:
    return int(json.loads((path / MARKER).read_text())["step"])
