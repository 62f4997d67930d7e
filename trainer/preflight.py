"""Checks that run before any process starts work: a bad setting fails here, in seconds, not after an hour.

`plan_run` resolves what the config leaves open (the embedded corpus, the run directory, the model's
vocabulary) and refuses anything that could not train. The launcher calls it before starting worker
processes, and every worker calls it again before joining the process group, so a run under torchrun
is checked the same way.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from checkpoints.training import resolve_checkpoint, step_of
from data import SequenceLoader, TokenStore, default_store
from data.store import TOKENIZER_FILE  # carried into native checkpoints by `burst convert-checkpoint`
from models import PRESETS, ModelConfig
from models.checkpoint import is_native_checkpoint, read_config
from trainer.checkpoint import check_model_config
from trainer.config import TrainConfig


@dataclass(frozen=True)
class RunPlan:
    """A checked run: the config with data and out resolved, the model to build, the weights to start from."""

    config: TrainConfig
    model_config: ModelConfig
    checkpoint: Path | None  # native checkpoint directory to load; None: fresh weights from config.seed
    resume_from: Path | None = None  # training checkpoint to continue from (--resume), checked


def default_run_dir() -> str:
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def check_world_size(config: TrainConfig, world_size: int) -> None:
    if world_size != config.world_size:
        raise ValueError(f"cp x dp = {config.cp} x {config.dp} = {config.world_size} ranks, but {world_size} processes "
                         f"were started; start cp x dp processes (torchrun --nnodes N --nproc-per-node M with "
                         f"N x M = {config.world_size}), or change --cp/--dp to multiply to {world_size}")


def check_run_dir(out: Path) -> None:
    """Refuse a run directory that already holds something: a new run never mixes into an old one."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "another run" if (out / "config.toml").is_file() else "other files"
        raise ValueError(f"run directory {out} already holds {what}; choose a new --out, or delete {out}")


def model_and_store(config: TrainConfig, store: TokenStore) -> tuple[ModelConfig, Path | None]:
    """The model config and starting checkpoint for `config.model`, checked against the store's tokenizer."""
    if config.model in PRESETS:
        preset = ModelConfig.from_name(config.model)
        # A fresh model gets the store's vocabulary, so any tokenizer trains any preset.
        return dataclasses.replace(preset, vocab_size=store.vocab_size,
                                   max_seq_len=max(preset.max_seq_len, config.seq_len)), None
    path = Path(config.model)
    if not path.is_dir():
        raise ValueError(f"--model {config.model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    if not is_native_checkpoint(path):
        raise ValueError(f"--model {path} is not a native checkpoint directory (config.json with the model's "
                         f"fields and safetensors weights); convert a Hugging Face model first with "
                         f"`burst convert-checkpoint {path} OUT --to burst`")
    model_config = read_config(path)
    store_tokenizer = store.metadata["tokenizer"]
    model_tokenizer = path / TOKENIZER_FILE
    if model_tokenizer.is_file():
        from data.tokenizer import Tokenizer  # imports sentencepiece: only when there is a tokenizer to read

        if Tokenizer(model_tokenizer).sha256 != store_tokenizer.get("sha256"):
            raise ValueError(f"the token store {store.directory} was made with another tokenizer than the model "
                             f"{path} ({model_tokenizer}); prepare the data with the model's tokenizer: "
                             f"`burst prepare INPUT... --tokenizer {model_tokenizer} --out STORE`")
    if store.vocab_size != model_config.vocab_size:
        raise ValueError(f"the token store {store.directory} has a vocabulary of {store.vocab_size} tokens but the "
                         f"model {path} has {model_config.vocab_size}; prepare the data with the model's tokenizer "
                         f"(`burst prepare INPUT... --tokenizer TOKENIZER.model --out STORE`)")
    return model_config, path


def plan_run(config: TrainConfig, world_size: int) -> RunPlan:
    """Check `config` for a run on `world_size` processes and resolve its defaults; raises ValueError.

    Prepares the embedded corpus when no --data is given (once, in the calling process).
    """
    check_world_size(config, world_size)
    out = config.out or default_run_dir()
    if not config.resume:
        check_run_dir(Path(out))
    data = config.data or str(default_store())
    try:
        store = TokenStore(data)
    except (OSError, ValueError) as err:
        raise ValueError(f"--data {data}: {err}") from None
    model_config, checkpoint = model_and_store(config, store)
    # The loader checks batch and sequence settings against the data; building one reads no tokens.
    SequenceLoader(store.split("train"), config.seq_len, config.batch_size, dp_size=config.dp, cp_size=config.cp)
    resume_from = check_resume(config, Path(out), model_config) if config.resume else None
    return RunPlan(dataclasses.replace(config, data=data, out=out), model_config, checkpoint, resume_from)


def check_resume(config: TrainConfig, out: Path, model_config: ModelConfig) -> Path:
    """The newest complete checkpoint of the run in `out`, checked whole and against the run's model."""
    path = resolve_checkpoint(out)
    check_model_config(path, model_config)
    step = step_of(path)
    if step >= config.steps:
        raise ValueError(f"the run in {out} is finished: its newest checkpoint {path.name} is at step {step} of "
                         f"{config.steps}; there is nothing to resume")
    if config.stop_after is not None and config.stop_after <= step:
        raise ValueError(f"--stop-after {config.stop_after} is not after the checkpoint to resume from "
                         f"({path.name}, step {step}); pass a later step")
    return path
