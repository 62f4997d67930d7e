"""Checks that run before any process starts work: a bad setting fails here, in seconds, not after an hour.

`plan_run` resolves what the config leaves open (the embedded corpus, the run directory, the model's
vocabulary) and refuses anything that could not train. The launcher calls it before starting worker
processes, and every worker calls it again before joining the process group, so a run under torchrun
is checked the same way.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoints.training import complete_checkpoints, is_run_or_checkpoint, resolve_checkpoint, step_of
from data import SequenceLoader, TokenStore, default_store
from data.tokenizer import TOKENIZER_FILES
from models import PRESETS, ModelConfig
from models.checkpoint import is_native_checkpoint
from models.convert import is_hf_checkpoint, read_checkpoint
from models.rope import parse_rope_scaling
from runtime.precision import Precision, resolve_precision
from trainer.checkpoint import check_model_config
from trainer.config import TrainConfig

# What a run that failed during start-up (before its first step) leaves in its directory: a rerun may reuse it.
STARTUP_FILES = {"config.toml", *TOKENIZER_FILES}


@dataclass(frozen=True)
class RunPlan:
    """A checked run: the config with data and out resolved, the model to build, the weights to start from."""

    config: TrainConfig
    model_config: ModelConfig
    checkpoint: Path | None  # native or Hugging Face checkpoint directory to load; None: fresh weights from seed
    precision: Precision  # config.precision ("auto": chosen by this machine's hardware) and why
    resume_from: Path | None = None  # training checkpoint to continue from (--resume), checked
    restart: int = 0  # how many times the launcher restarted the workers of this run (0: the first start)


def default_run_dir() -> str:
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def check_world_size(config: TrainConfig, world_size: int) -> None:
    if world_size != config.world_size:
        raise ValueError(f"cp x dp = {config.cp} x {config.dp} = {config.world_size} ranks, but {world_size} processes "
                         f"were started; start cp x dp processes (torchrun --nnodes N --nproc-per-node M with "
                         f"N x M = {config.world_size}), or change --cp/--dp to multiply to {world_size}")


def check_run_dir(out: Path) -> None:
    """Refuse a run directory that already holds something: a new run never mixes into an old one.

    Only what a start-up that failed before its first step leaves (STARTUP_FILES) may be there: nothing was trained.
    """
    if out.exists() and (not out.is_dir() or not {p.name for p in out.iterdir()} <= STARTUP_FILES):
        what = "another run" if (out / "config.toml").is_file() else "other files"
        raise ValueError(f"run directory {out} already holds {what}; choose a new --out, or delete {out}")


def model_and_store(config: TrainConfig, store: TokenStore) -> tuple[ModelConfig, Path | None]:
    """The model config and starting checkpoint for `config.model`, with --rope-theta and --rope-scaling applied,
    checked against the store's tokenizer; the config names the tokenizer's BOS and EOS (exports write them)."""
    if config.resume and config.out:  # the run keeps its data's tokenizer, and continues only on the same
        store.check_tokenizer(Path(config.out), Path(config.out))
    if config.model in PRESETS:
        preset = with_rope(ModelConfig.from_name(config.model), config)
        # A fresh model gets the store's vocabulary, so any tokenizer trains any preset.
        return dataclasses.replace(preset, vocab_size=store.vocab_size, bos_token_id=store.bos_id,
                                   eos_token_id=store.eos_id,
                                   max_seq_len=max(preset.max_seq_len, config.seq_len)), None
    path = Path(config.model)
    if not path.is_dir():
        raise ValueError(f"--model {config.model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    if is_run_or_checkpoint(path):
        raise ValueError(f"--model {path} is a training run or checkpoint: continue it with "
                         f"`burst train --resume --out RUN`, or start from its weights after "
                         f"`burst convert-checkpoint {path} OUT --to burst`")
    if not (is_native_checkpoint(path) or is_hf_checkpoint(path)):
        raise ValueError(f"--model {path} is not a model checkpoint directory (a native or Hugging Face LLaMA "
                         f"config.json with safetensors weights)")
    model_config = with_rope(read_checkpoint(path).config, config)  # validated from the file headers, no tensor read
    store.check_tokenizer(path, path)
    recorded = store.metadata.get("max_token_id")  # the largest id in the documents (stores since it is recorded)
    max_id = max(recorded if isinstance(recorded, int) else -1, store.bos_id, store.eos_id)
    if store.vocab_size > model_config.vocab_size or max_id >= model_config.vocab_size:
        raise ValueError(f"the token store {store.directory} has a vocabulary of {store.vocab_size:,} tokens (ids up "
                         f"to {max_id:,} in its documents and specials) but the model {path} has "
                         f"{model_config.vocab_size:,} embeddings; prepare the data with the model's tokenizer "
                         f"(`burst prepare INPUT... --tokenizer {path} --out STORE`)")
    return with_specials(model_config, store, path), path


def with_rope(model_config: ModelConfig, config: TrainConfig) -> ModelConfig:
    """`model_config` with --rope-theta and --rope-scaling, whose original length defaults to its max_seq_len."""
    changes = {}
    if config.rope_theta is not None:
        changes["rope_theta"] = config.rope_theta
    if config.rope_scaling is not None:
        changes["rope_scaling"] = parse_rope_scaling(config.rope_scaling, "--rope-scaling",
                                                     original_length=model_config.max_seq_len)
    try:
        return dataclasses.replace(model_config, **changes)
    except ValueError as err:  # what fits only this model: longrope's factors, one per frequency of its heads
        raise ValueError(f"--rope-scaling {config.rope_scaling}: {err}") from None


def with_specials(model_config: ModelConfig, store: TokenStore, path: Path) -> ModelConfig:
    """`model_config` naming the store's BOS and EOS; refused when the checkpoint's config.json names others."""
    bos, eos = model_config.bos_token_id, model_config.eos_token_id
    eos_ids = eos if isinstance(eos, list) else [eos]
    if bos not in (None, store.bos_id) or eos is not None and store.eos_id not in eos_ids:
        raise ValueError(f"the model {path} names BOS {bos} and EOS {eos} (config.json's bos_token_id and "
                         f"eos_token_id) but the token store {store.directory} was prepared with a tokenizer whose BOS "
                         f"is {store.bos_id} and EOS {store.eos_id}: the documents would be framed with tokens the "
                         f"model does not know as such; prepare the data with the model's tokenizer "
                         f"(`burst prepare INPUT... --tokenizer {path} --out STORE`)")
    return dataclasses.replace(model_config, bos_token_id=store.bos_id,
                               eos_token_id=store.eos_id if eos is None else eos)


def device_memory_bytes() -> int:
    """Memory of one rank's device: the first GPU's, else this machine's RAM."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_sequence_fits(config: TrainConfig, store: TokenStore, model_config: ModelConfig) -> None:
    """Refuse a --seq-len longer than the training split, or whose activations cannot fit one rank's memory."""
    train = store.split("train")
    stream = int(train.document_lengths.sum()) + 2 * train.num_documents  # BOS + document + EOS each
    if config.seq_len > stream:
        raise ValueError(f"--seq-len {config.seq_len:,} is longer than the training split of {store.directory} "
                         f"({stream:,} tokens with BOS/EOS): every sequence would repeat the data; lower --seq-len, "
                         f"or prepare more data")
    # A lower bound: backward keeps at least each layer's float32 input of the rank's share of the batch.
    needed = config.batch_size * config.seq_len // config.cp * model_config.dim * 4 * model_config.n_layers
    available = device_memory_bytes()
    if needed > available:
        raise ValueError(f"--seq-len {config.seq_len:,} cannot fit: one rank's activations alone take more than "
                         f"{needed / 2**30:,.0f} GiB, its device has {available / 2**30:,.0f} GiB; lower --seq-len "
                         f"or --batch-size, or raise --cp")


def restart_count() -> int:
    """How many times the elastic agent (our launcher or torchrun) has restarted this process's workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def invocation_done(config: TrainConfig) -> bool:
    """Whether the run in config.out already has a complete checkpoint of this invocation's last step."""
    complete = complete_checkpoints(Path(config.out)) if config.out else []
    return bool(complete) and step_of(complete[-1]) >= min(config.steps, config.stop_after or config.steps)


def plan_run(config: TrainConfig, world_size: int, restart: int = 0) -> RunPlan:
    """Check `config` for a run on `world_size` processes and resolve its defaults; raises ValueError.

    restart > 0: the workers were restarted after one died. The run continues from its newest complete
    checkpoint exactly as --resume would, or starts over when it has none yet (its directory is its own).
    Prepares the embedded corpus when no --data is given (once, in the calling process).
    """
    check_world_size(config, world_size)
    out = config.out or default_run_dir()
    if restart and complete_checkpoints(Path(out)):
        config = dataclasses.replace(config, resume=True)
    if not config.resume and not restart:
        check_run_dir(Path(out))
    data = config.data or str(default_store())
    try:
        store = TokenStore(data)
    except (OSError, ValueError) as err:
        raise ValueError(f"--data {data}: {err}") from None
    model_config, checkpoint = model_and_store(config, store)
    # The loader checks batch and sequence settings against the data; building one reads no tokens.
    SequenceLoader(store.split("train"), config.seq_len, config.batch_size, dp_size=config.dp, cp_size=config.cp)
    check_sequence_fits(config, store, model_config)
    resume_from = check_resume(config, Path(out), model_config) if config.resume else None
    precision = resolve_precision(config.precision, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return RunPlan(dataclasses.replace(config, data=data, out=out), model_config, checkpoint, precision, resume_from,
                   restart)


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
