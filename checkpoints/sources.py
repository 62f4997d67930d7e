"""Every checkpoint a user may name: a model directory (Hugging Face or native, models/convert.py), or a
training checkpoint or run directory of `burst train` (training.py), whose newest complete checkpoint is read.

`burst eval` and `burst convert-checkpoint` open their source through here, so both accept all four.
"""

from __future__ import annotations

from pathlib import Path

from checkpoints.training import is_run_or_checkpoint, read_model_checkpoint
from models import convert
from models.convert import Checkpoint, SourceFormat
from models.storage import DEFAULT_MAX_SHARD_BYTES

# Training checkpoints first: they hold a native config.json too.
SOURCE_FORMATS: convert.SourceFormats = {
    "train": SourceFormat("a training checkpoint or run directory of `burst train`", is_run_or_checkpoint,
                          read_model_checkpoint),
    **convert.SOURCE_FORMATS,
}


def detect_format(path: Path) -> str:
    """The name of the source format of the checkpoint directory `path` (a key of SOURCE_FORMATS)."""
    return convert.detect_format(path, SOURCE_FORMATS)


def read_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint `path` names, in any source format; validated from file headers, tensors read lazily."""
    return convert.read_checkpoint(path, SOURCE_FORMATS)


def convert_checkpoint(src: str | Path, dst: str | Path, to: str, force: bool = False,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """`models.convert.convert_checkpoint` from any source format, training checkpoints and run directories too."""
    return convert.convert_checkpoint(src, dst, to, force, max_shard_bytes, SOURCE_FORMATS)
