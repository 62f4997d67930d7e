"""What `burst eval --checkpoint PATH` can read, and the check that the data's tokenizer fits the model.

Formats are those of `checkpoints.SOURCE_FORMATS`, detected there: a Hugging Face LLaMA or a
native model directory, a training checkpoint of `burst train`, or a run directory (its newest
complete checkpoint), whose weights are read in this process without the ranks that wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tomllib
import torch

from checkpoints import detect_format, read_checkpoint
from data import TokenStore
from data.mixture import parse_mixture
from models import ModelConfig, Transformer
from models.checkpoint import model_from_tensors, non_finite
from models.convert import Checkpoint


@dataclass
class EvalCheckpoint:
    """A validated checkpoint whose tensors have not been read yet."""

    path: Path
    format: str  # a key of checkpoints.SOURCE_FORMATS
    config: ModelConfig
    checkpoint: Checkpoint

    def model(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Transformer:
        """The Transformer in eval mode, its weights read onto `device` (and cast to `dtype` if given);
        refused when a weight is not finite (a diverged run, or a damaged file)."""
        model = model_from_tensors(self.config, self.checkpoint.tensors(), device, dtype)
        bad = non_finite(model.state_dict().items())
        if bad:
            raise ValueError(f"{self.path} holds non-finite weights ({len(bad)} tensors, e.g. {bad[0]}): the run "
                             f"diverged or the file is damaged; evaluate an earlier checkpoint")
        return model


def load_for_eval(path: str | Path) -> EvalCheckpoint:
    """Open the checkpoint at `path` for evaluation: detect its format and validate config and tensor shapes.

    Reads file headers (DCP metadata for a training checkpoint) only; `EvalCheckpoint.model()` reads the weights.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist; pass a model directory (native or Hugging Face "
                         f"LLaMA), a training checkpoint or a run directory of `burst train`")
    format_name = detect_format(path)
    checkpoint = read_checkpoint(path)
    return EvalCheckpoint(path=path, format=format_name, config=checkpoint.config, checkpoint=checkpoint)


def check_tokenizer(checkpoint: EvalCheckpoint, store: TokenStore) -> None:
    """Refuse a token store whose tokenizer does not belong to the model.

    Every token id must have an embedding; a tokenizer kept with the checkpoint (a run keeps its
    data's) must be the very one the store was prepared with.
    """
    store.check_fits(checkpoint.config.vocab_size, checkpoint.path,
                     f"evaluate on a store prepared with the model's tokenizer (`burst prepare ... --tokenizer "
                     f"{checkpoint.path}`, when it keeps one)")
    if checkpoint.checkpoint.tokenizer is not None:
        store.check_tokenizer(checkpoint.checkpoint.tokenizer, checkpoint.path)


def recorded_store(path: Path) -> tuple[Path, str] | None:
    """The token store the run that wrote checkpoint `path` trained on, with where that was read; None when
    `path` is no run directory or checkpoint of one, or its run trained on the embedded corpus.

    A run records its --data in config.toml (absolute paths); of a mixture, the first source is taken."""
    for run in (path, path.parent.parent):  # RUN, or RUN/checkpoints/step-N
        settings = run / "config.toml"
        if not (settings.is_file() and (run / "checkpoints").is_dir()):
            continue
        try:
            data = tomllib.loads(settings.read_text()).get("data")
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            return None  # an unreadable record: the embedded corpus, as before; the tokenizer check still runs
        if not data:
            return None
        sources = parse_mixture([data] if isinstance(data, str) else list(data))
        origin = f"the store {settings} records" + (
            f", the first of its {len(sources)} sources; pass --data for another" if len(sources) > 1 else "")
        return Path(sources[0].path), origin
    return None
