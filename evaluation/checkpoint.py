"""What `burst eval --checkpoint PATH` can read, and the check that the data's tokenizer fits the model.

Formats are those of `checkpoints.SOURCE_FORMATS`, detected there: a Hugging Face LLaMA or a
native model directory, a training checkpoint of `burst train`, or a run directory (its newest
complete checkpoint), whose weights are read in this process without the ranks that wrote them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoints import detect_format, read_checkpoint
from data import TokenStore
from data.store import TOKENIZER_FILE  # also the name `burst convert-checkpoint` carries it under
from models import ModelConfig, Transformer
from models.checkpoint import model_from_tensors
from models.convert import Checkpoint


@dataclass
class EvalCheckpoint:
    """A validated checkpoint whose tensors have not been read yet."""

    path: Path
    format: str  # a key of checkpoints.SOURCE_FORMATS
    config: ModelConfig
    tokenizer_sha256: str | None  # of the tokenizer.model stored beside the weights, if there is one
    checkpoint: Checkpoint

    def model(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Transformer:
        """The Transformer in eval mode, its weights read onto `device` (and cast to `dtype` if given)."""
        return model_from_tensors(self.config, self.checkpoint.tensors(), device, dtype)


def load_for_eval(path: str | Path) -> EvalCheckpoint:
    """Open the checkpoint at `path` for evaluation: detect its format and validate config and tensor shapes.

    Reads file headers (DCP metadata for a training checkpoint) only; `EvalCheckpoint.model()` reads the weights.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist; pass a model directory (native or Hugging Face "
                         f"LLaMA), a training checkpoint or a run directory of `burst train`")
    format_name = detect_format(path)
    tokenizer = path / TOKENIZER_FILE
    sha256 = hashlib.sha256(tokenizer.read_bytes()).hexdigest() if tokenizer.is_file() else None
    checkpoint = read_checkpoint(path)
    return EvalCheckpoint(path=path, format=format_name, config=checkpoint.config, tokenizer_sha256=sha256,
                          checkpoint=checkpoint)


def check_tokenizer(checkpoint: EvalCheckpoint, store: TokenStore) -> None:
    """Refuse a token store whose tokenizer does not belong to the model.

    Every token id must have an embedding; a tokenizer shipped with the checkpoint must be
    the very one the store was prepared with.
    """
    vocab_size = checkpoint.config.vocab_size
    if store.vocab_size > vocab_size:
        raise ValueError(f"the token store {store.directory} uses a tokenizer of {store.vocab_size:,} tokens but "
                         f"the model at {checkpoint.path} has a vocabulary of {vocab_size:,}; evaluate on a store "
                         f"prepared with the model's tokenizer (`burst prepare ... --tokenizer TOKENIZER.model`)")
    store_sha256 = store.metadata["tokenizer"].get("sha256")
    if checkpoint.tokenizer_sha256 is not None and checkpoint.tokenizer_sha256 != store_sha256:
        raise ValueError(f"{checkpoint.path / TOKENIZER_FILE} is not the tokenizer the token store "
                         f"{store.directory} was prepared with; prepare the data with it: "
                         f"`burst prepare ... --tokenizer {checkpoint.path / TOKENIZER_FILE}`")
