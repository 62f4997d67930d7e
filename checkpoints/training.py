"""The training checkpoint's format, shared by `burst train`, `burst eval` and `burst convert-checkpoint`.

    OUT/checkpoints/step-000012/
        .metadata, __0_0.distcp, ...   DCP: model and optimizer, each rank writing its own shards
        config.json                    the model's ModelConfig: the checkpoint describes itself
        train_state.json               step, token count, LR schedule, data-loader position
        rng-00000.json, ...            each rank's RNG states (torch CPU and CUDA, Python's random)
        COMPLETE                       written last, by rank 0, once every rank's files are there: the step
                                       and the SHA-256 of every other file, which loading checks

A save writes into `step-N.tmp-<id>` and renames it to `step-N` once COMPLETE is there
(trainer/saving.py); readers ignore tmp directories. This module is the layout, the listing of
complete checkpoints, their checks, and reading the model weights out of one in a single process.
It lives below trainer/ and evaluation/ (which must not import each other) and outside models/
(which knows native and Hugging Face model directories only).

DCP stores each tensor with its global shape, whatever the sharding it was saved from, so one
process without a process group reads the weights the ranks wrote.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from models.checkpoint import CONFIG_NAME, check_tensor_shapes, expected_shapes, read_config
from models.convert import Checkpoint, expected_adapter_shapes, generation_config_beside
from models.hf_tokenizer import tokenizer_beside
from models.lora import Adapter, LoRAConfig, is_adapter, is_trainable, merged
from runtime.digest import file_sha256

CHECKPOINTS_DIR = "checkpoints"
MARKER = "COMPLETE"
STATE_NAME = "train_state.json"
DCP_METADATA = ".metadata"
MODEL_PREFIX = "model."  # DCP flattens {"model": {...}, "optimizer": {...}} into dotted keys
CHECKSUMS = "sha256"  # COMPLETE's {file name: SHA-256} of every other file, as its save wrote them
# The checkpoints whose checksums this process, or the launcher that started it, checked: read once per launch.
VERIFIED_ENV = "BURST_VERIFIED_CHECKPOINTS"
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
    problems = missing_files(path)
    if problems:
        raise ValueError(f"checkpoint {path}: {problems[0]}; the checkpoint is damaged (files were deleted, cut "
                         f"short or not copied), resume from an earlier one")
    read_train_state(path)
    check_checksums(path)


def check_checksums(path: Path) -> None:
    """Refuse a checkpoint whose files are not the bytes its save wrote, naming the file and the checkpoint to
    resume from instead. Reads every file once per launch: a worker trusts its launcher's check, and under
    torchrun each node's local rank 0 checks (the others' start waits for it). A checkpoint of a burst from before
    checksums loads unchecked, and says so."""
    key = str(path.resolve())
    verified = os.environ.get(VERIFIED_ENV, "").split(os.pathsep)
    if key in verified or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    recorded = json.loads((path / MARKER).read_text()).get(CHECKSUMS)
    if not isinstance(recorded, dict):
        print(f"note: checkpoint {path} records no checksums (saved by an older burst): its files are not checked",
              file=sys.stderr, flush=True)
    else:
        for name, sha256 in sorted(recorded.items()):
            file = path / Path(str(name)).name
            if not file.is_file() or file_sha256(file) != sha256:
                what = "is missing" if not file.is_file() else \
                    "does not match the SHA-256 its save recorded (its bytes changed since)"
                raise ValueError(f"checkpoint {path} is damaged: {file.name} {what}; {_earlier(path)}")
    os.environ[VERIFIED_ENV] = os.pathsep.join([*filter(None, verified), key])


def _earlier(path: Path) -> str:
    """What to do instead of loading the damaged checkpoint `path`: the checkpoint before it, by name."""
    step = step_of(path)
    earlier = [p for p in complete_checkpoints(path.parent.parent) if step_of(p) < step] \
        if path.parent.name == CHECKPOINTS_DIR else []
    if not earlier:
        return "no earlier checkpoint of its run is left: start again from the run's beginning, or a copy you trust"
    return f"resume from the checkpoint before it, {earlier[-1]}: move {path} out of {path.parent} first"


def missing_files(path: Path, world_size: int | None = None) -> list[str]:
    """What a checkpoint directory lacks, in words: its own files, the shard files its DCP metadata names (each
    at least as long as the data in it), and with `world_size` every rank's RNG file. Empty when whole."""
    for name in (DCP_METADATA, CONFIG_NAME, STATE_NAME):
        if not (path / name).is_file():
            return [f"it lacks {name}"]
    import torch.distributed.checkpoint as dcp  # here: it imports DTensor (about 1 CPU s), which listing runs need not

    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # a truncated pickle raises whatever unpickling hits
        return [f"{DCP_METADATA} cannot be read ({err})"]
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file() or file.stat().st_size < size:
            what = "is missing" if not file.is_file() else f"has {file.stat().st_size} bytes, {size} are needed"
            problems.append(f"the shard file {name} {what}")
    problems += [f"rank {rank}'s {rng_name(rank)} is missing" for rank in range(world_size or 0)
                 if not (path / rng_name(rank)).is_file()]
    return problems


def rng_name(rank: int) -> str:
    return f"rng-{rank:05d}.json"


# train_state.json: {"train": TrainState, "schedule": LambdaLR's state, "loader": SequenceLoader's state}
TRAIN_COUNTERS = ("step", "tokens", "bad_steps")


def read_train_state(path: Path) -> dict[str, Any]:
    """The checkpoint's train_state.json, its fields checked (a damaged one names itself and the way out)."""
    def damaged(what: str) -> ValueError:
        return ValueError(f"checkpoint {path}: {STATE_NAME} {what}; the checkpoint is damaged, resume from an "
                          f"earlier one (delete {path})")

    try:
        state = json.loads((path / STATE_NAME).read_text())
        marker = json.loads((path / MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise damaged(f"or {MARKER} cannot be read ({err})") from None
    if not isinstance(state, dict) or not all(isinstance(state.get(key), dict)
                                              for key in ("train", "schedule", "loader")):
        raise damaged("lacks its train, schedule or loader part")
    counters = state["train"]
    bad = [key for key in TRAIN_COUNTERS if isinstance(counters.get(key), bool)
           or not isinstance(counters.get(key), int) or counters[key] < 0]
    if bad:
        raise damaged(f"holds no valid {', '.join(bad)} (whole numbers >= 0)")
    if not isinstance(marker, dict) or marker.get("step") != counters["step"]:
        raise damaged(f"says step {counters['step']} but {MARKER} says {marker}")
    return state


def remove_interrupted_saves(out: Path) -> None:
    """Delete the tmp directories that saves killed midway left behind (rank 0, before the run saves again)."""
    root = out / CHECKPOINTS_DIR
    for tmp in root.glob("step-*.tmp-*") if root.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True)


def step_of(path: Path) -> int:
    return int(json.loads((path / MARKER).read_text())["step"])


def read_model_checkpoint(path: Path) -> Checkpoint:
    """The model weights of a training checkpoint (or of a run directory's newest), read in this one process
    without the ranks that wrote them; validated from metadata, tensors read one at a time. A LoRA run's weights
    come merged (W + B A alpha / rank), and its adapter alone through `Checkpoint.adapter`."""
    import torch.distributed.checkpoint as dcp  # see missing_files
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = resolve_checkpoint(Path(path))
    config = read_config(path)
    items = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = {key.removeprefix(MODEL_PREFIX): meta for key, meta in items.items()
               if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}
    lora = lora_of(path) if any(is_adapter(name) for name in tensors) else None
    adapter_shapes = expected_adapter_shapes(config, lora) if lora is not None else {}
    check_tensor_shapes({name: tuple(meta.size) for name, meta in tensors.items()},
                        {**expected_shapes(config), **adapter_shapes}, str(path))

    def load(name: str) -> torch.Tensor:
        meta = tensors[name]
        state = {"model": {name: torch.empty(meta.size, dtype=meta.properties.dtype)}}
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
        return state["model"][name]

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for name in tensors:
            if is_adapter(name):
                continue
            stem = name.removesuffix(".weight")
            if f"{stem}.lora_a" in tensors:
                yield name, merged(load(name), load(f"{stem}.lora_a"), load(f"{stem}.lora_b"), lora)
            else:
                yield name, load(name)

    def adapter() -> Adapter:
        trained = [name for name in tensors if is_adapter(name) or is_trainable(name, lora)]
        return Adapter(lora, {name: load(name) for name in trained})

    run_dir = path.parent.parent  # RUN/checkpoints/step-N: the run keeps the tokenizer its data was made with
    return Checkpoint(config, read, tokenizer_beside(path) or tokenizer_beside(run_dir),
                      adapter=adapter if lora is not None else None,
                      generation_config=generation_config_beside(path) or generation_config_beside(run_dir))


def lora_of(path: Path) -> LoRAConfig:
    """The LoRA settings a training checkpoint's run trained with (its train_state.json's settings)."""
    settings = read_train_state(path).get("settings", {})
    return LoRAConfig(rank=settings["lora_rank"], alpha=settings["lora_alpha"], dropout=settings["lora_dropout"],
                      targets=LoRAConfig.parse_targets(settings["lora_targets"]),
                      train_embeddings_and_norms=settings["train_embeddings_and_norms"])
