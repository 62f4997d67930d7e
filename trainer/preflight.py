"""Checks that run before any process starts work: a bad setting fails here, in seconds, not after an hour.

`check_run` resolves what the config leaves open (the embedded corpus, the run directory, the model's
vocabulary) and refuses anything that could not train. The launcher calls it before starting worker
processes, and every worker calls it again before joining the process group, so a run under torchrun
is checked the same way.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tomllib

from checkpoints.training import (
    complete_checkpoints,
    is_run_or_checkpoint,
    read_model_checkpoint,
    read_train_state,
    resolve_checkpoint,
    step_of,
)
from data import SequenceLoader, TokenStore, default_store
from data.mixture import Source, open_sources, parse_mixture
from models import PRESETS, ModelConfig
from models.checkpoint import is_native_checkpoint
from models.convert import is_hf_checkpoint, read_checkpoint
from models.rope import ORIGINAL_LENGTH, parse_rope_scaling
from planner import RunShape
from planner.fit import check_fits
from runtime.device import Device
from runtime.directories import check_writable, read_marker
from runtime.launch import local_world_size
from runtime.precision import Precision
from trainer.checkpoint import check_model_config, metrics_rows
from trainer.config import TrainConfig, run_identity
from trainer.resolve import Resolved, resolve, run_device
from trainer.rundir import check_run_dir

DEFAULT_MODEL = "tiny"


@dataclass(frozen=True)
class CheckedRun:
    """A checked run: the config with data and out resolved, the model to build, the weights to start from."""

    config: TrainConfig
    model_config: ModelConfig
    checkpoint: Path | None  # native or Hugging Face checkpoint directory to load; None: fresh weights from seed
    resolved: Resolved  # what "auto" and unset settings mean here (device, precision, doc_mask, layout) and why
    resume_from: Path | None = None  # training checkpoint to continue from (--resume), checked
    restart: int = 0  # how many times the launcher restarted the workers of this run (0: the first start)
    init_from: Path | None = None  # training checkpoint a new stage starts from (--init-from), unless resuming
    recorded_device: str | None = None  # on --resume, the device the run ran on before (None: not recorded)

    @property
    def precision(self) -> Precision:
        """config.precision ("auto": chosen by this machine's hardware) and why."""
        return self.resolved.precision

    @property
    def device(self) -> Device:
        """Where the ranks run (config.device holds its kind) and why."""
        return self.resolved.device


def default_run_dir() -> str:
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def check_world_size(config: TrainConfig, world_size: int) -> None:
    if world_size != config.world_size:
        raise ValueError(f"cp x dp = {config.cp} x {config.dp} = {config.world_size} ranks, but {world_size} processes "
                         f"were started; start cp x dp processes (torchrun --nnodes N --nproc-per-node M with "
                         f"N x M = {config.world_size}), or change --cp/--dp to multiply to {world_size}")


def resolve_model(config: TrainConfig, store: TokenStore | None,
                  out: Path | None = None) -> tuple[ModelConfig, Path | None, Path | None]:
    """(the model to build, the checkpoint its weights load from, the training checkpoint a new stage starts from):
    --init-from's run (or, resuming a stage, the run in `out`), else --model (a preset, default tiny, or a model
    directory). `burst train` and `burst plan` both resolve the model here. store: the data's first store, which the
    model is checked against and a preset takes its vocabulary from (None: no data named, `burst plan` for data
    elsewhere: a preset keeps its own vocabulary)."""
    if config.init_from is not None and config.resume:  # a stage continues with the model its checkpoints hold
        model_config = read_model_checkpoint(out).config
        if store is not None:
            check_store_fits(store, model_config, out, out)
        return model_config, None, None
    if config.init_from is not None:
        model_config, init_from = init_checkpoint(config, store)
        return model_config, None, init_from
    model_config, checkpoint = model_and_store(config, store)
    return model_config, checkpoint, None


def model_and_store(config: TrainConfig, store: TokenStore | None) -> tuple[ModelConfig, Path | None]:
    """The model config and starting checkpoint for `config.model` (a preset, default tiny, or a model directory),
    with --rope-theta and --rope-scaling applied, checked against the store's tokenizer; the config names the
    tokenizer's BOS and EOS (exports write them)."""
    name = config.model or DEFAULT_MODEL
    if name in PRESETS:
        preset = with_rope(ModelConfig.from_name(name), config)
        preset = dataclasses.replace(preset, max_seq_len=max(preset.max_seq_len, config.seq_len))
        if store is None:
            return preset, None
        # A fresh model gets the store's vocabulary, so any tokenizer trains any preset.
        return dataclasses.replace(preset, vocab_size=store.vocab_size, bos_token_id=store.bos_id,
                                   eos_token_id=store.eos_id), None
    path = Path(name)
    if not path.is_dir():
        raise ValueError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    if is_run_or_checkpoint(path):
        raise ValueError(f"--model {path} is a training run or checkpoint: continue it with "
                         f"`burst train --resume --out RUN`, or start a new stage from its weights with "
                         f"`--init-from {path}`")
    if not (is_native_checkpoint(path) or is_hf_checkpoint(path)):
        raise ValueError(f"--model {path} is not a model checkpoint directory (a native or Hugging Face LLaMA "
                         f"config.json with safetensors weights)")
    model_config = with_rope(read_checkpoint(path).config, config)  # validated from the file headers, no tensor read
    if store is None:
        return model_config, path
    check_store_fits(store, model_config, path, path)
    return with_specials(model_config, store, path), path


def with_rope(model_config: ModelConfig, config: TrainConfig, context: int | None = None) -> ModelConfig:
    """`model_config` with --rope-theta and --rope-scaling. The scaling's original length defaults to the context
    the model was trained at: its present scaling's original length (a new scaling extends the same context), else
    `context` (default: its max_seq_len)."""
    changes = {}
    if config.rope_theta is not None:
        changes["rope_theta"] = config.rope_theta
    if config.rope_scaling is not None:
        original = getattr(model_config.rope_scaling, ORIGINAL_LENGTH, None) or context or model_config.max_seq_len
        changes["rope_scaling"] = parse_rope_scaling(config.rope_scaling, "--rope-scaling", original_length=original)
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


def check_store_fits(store: TokenStore, model_config: ModelConfig, tokenizer: Path | None, model: Path) -> None:
    """Refuse data prepared with another tokenizer than the model's (kept in the directory `tokenizer`, when
    there is one), or whose ids do not all have an embedding in the model."""
    if tokenizer is not None:
        store.check_tokenizer(tokenizer, model)
    store.check_fits(model_config.vocab_size, model, f"prepare the data with the model's tokenizer (`burst prepare "
                                                     f"INPUT... --tokenizer {model} --out STORE`)")


def trained_context(checkpoint: Path, model_config: ModelConfig) -> int:
    """The context the weights of the training checkpoint `checkpoint` (of model `model_config`) were trained for:
    its model's max_seq_len, but for a run that started from seed (a preset: no --model directory, no --init-from)
    the --seq-len it trained at, as the preset's max_seq_len is a context its weights never saw."""
    settings = read_train_state(checkpoint).get("settings") or {}  # checkpoints of older versions recorded none
    seq_len = settings.get("seq_len")
    if settings.get("model") in PRESETS and settings.get("init_from") is None and isinstance(seq_len, int):
        return min(seq_len, model_config.max_seq_len)
    return model_config.max_seq_len


def init_checkpoint(config: TrainConfig, store: TokenStore | None) -> tuple[ModelConfig, Path]:
    """The training checkpoint --init-from names (a run's newest, or one checkpoint), checked whole, and the
    model this new stage trains: the checkpoint's, its --rope-scaling extending the context the checkpoint was
    trained at (`trained_context`), with max_seq_len raised from that context to --seq-len."""
    path = Path(config.init_from)
    if not path.is_dir():
        raise ValueError(f"--init-from {path} does not exist; pass a run directory of `burst train` or one of its "
                         f"checkpoints (RUN/checkpoints/step-N)")
    if not is_run_or_checkpoint(path) and (read_marker(path) or {}).get("kind") == "run":
        raise ValueError(f"--init-from {path} is a training run without a checkpoint (its start-up failed, or it ended "
                         f"before its first save); start the stage from a run that saved one, or train this one "
                         f"first (its directory may be reused: `burst train --out {path} ...`)")
    if not is_run_or_checkpoint(path):
        hint = f"start from a model directory with --model {path}" if is_native_checkpoint(path) or \
            is_hf_checkpoint(path) else "pass a run directory of `burst train` or one of its checkpoints"
        raise ValueError(f"--init-from {path} is not a training run or checkpoint; {hint}")
    resolved = resolve_checkpoint(path)  # the newest complete checkpoint of a run; checked
    checkpoint = read_model_checkpoint(resolved)  # no tensor read
    context = trained_context(resolved, checkpoint.config)
    model_config = with_rope(dataclasses.replace(checkpoint.config, max_seq_len=max(context, config.seq_len)),
                             config, context)
    if store is None:
        return model_config, resolved
    check_store_fits(store, model_config, checkpoint.tokenizer, path)
    return with_specials(model_config, store, path), resolved


def check_sequence_fits(config: TrainConfig, sources: list[Source]) -> None:
    """Refuse a --seq-len longer than a source's training documents: every sequence would repeat the data (an
    instruction store's sequences never do: they hold whole conversations, the rest padding)."""
    for source in sources:
        train = source.store
        if train.is_conversations or train.is_preferences:
            continue
        stream = train.packed_tokens  # [BOS] + document + EOS each
        if config.seq_len > stream:
            raise ValueError(f"--seq-len {config.seq_len:,} is longer than the training documents of --data "
                             f"{source.spec.name} ({stream:,} tokens with BOS/EOS): every sequence would repeat the "
                             f"data; lower --seq-len, or prepare more data")


def check_conversations(config: TrainConfig, sources: list[Source]) -> None:
    """Refuse instruction stores without --doc-mask (packed conversations would read each other), and build the
    training and validation loaders, which refuse conversations over the --long-conversations policy and
    --train-on-prompt without an instruction store (building them reads only the long conversations)."""
    conversations = [source.spec.name for source in sources if source.store.is_conversations]
    if conversations and not config.doc_mask:
        raise ValueError(f"--no-doc-mask is refused for --data {', '.join(conversations)}: instruction stores "
                         f"(`burst prepare --chat`) pack several conversations to a sequence, which must not attend "
                         f"to each other nor to the padding; drop --no-doc-mask (the mask is on by default for them)")
    loader = dict(seq_len=config.seq_len, batch_size=config.batch_size, dp_size=config.dp, cp_size=config.cp,
                  long_conversations=config.long_conversations, prefix_sharing=config.prefix_sharing)
    SequenceLoader([source.store for source in sources], shares=[source.spec.share for source in sources],
                   train_on_prompt=config.train_on_prompt, **loader)
    for source in sources:
        if (source.store.is_conversations or source.store.is_preferences) and source.val.num_documents:
            SequenceLoader(source.val, train_on_prompt=config.train_on_prompt, **loader)


def run_shape(config: TrainConfig, doc_len: int | list[int] | None = None) -> RunShape:
    """The planner's view of `config`: the settings its memory and time depend on. doc_len: with --doc-mask, the
    packed documents' length attention is counted for (None: one per sequence)."""
    return RunShape(seq_len=config.seq_len, batch_size=config.batch_size, grad_accum=config.grad_accum, cp=config.cp,
                    dp=config.dp, precision=config.precision, activation_checkpointing=config.activation_checkpointing,
                    doc_len=doc_len if config.doc_mask else None,
                    prefix_sharing=bool(config.doc_mask and config.objective != "nll" and config.prefix_sharing),
                    layout=config.sequence_layout, cp_topology=config.cp_topology,
                    attention_backward=config.attention_backward, lora_rank=config.lora_rank,
                    lora_targets=config.lora.targets, train_embeddings_and_norms=config.train_embeddings_and_norms,
                    offload_activations=config.offload_activations, mlp_tile=config.mlp_tile,
                    loss_tile=config.loss_tile)


def restart_count() -> int:
    """How many times the elastic agent (our launcher or torchrun) has restarted this process's workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def invocation_done(config: TrainConfig) -> bool:
    """Whether the run in config.out already has a complete checkpoint of this invocation's last step."""
    complete = complete_checkpoints(Path(config.out)) if config.out else []
    return bool(complete) and step_of(complete[-1]) >= min(config.steps, config.stop_after or config.steps)


def check_run(config: TrainConfig, world_size: int, restart: int = 0) -> CheckedRun:
    """Check `config` for a run on `world_size` processes and resolve its defaults; raises ValueError.

    restart > 0: the workers were restarted after one died. The run continues from its newest complete
    checkpoint exactly as --resume would, or starts over when it has none yet (its directory is its own).
    Prepares the embedded corpus when no --data is given (once, in the calling process).
    """
    # here, not at the top: trainer.preference's rank side imports FSDP and DTensor, which a launcher of ranks
    # never uses (0.8 CPU s a launch)
    from trainer.preference import check_preferences, check_reference_kept

    check_world_size(config, world_size)
    local_ranks = local_world_size(world_size)  # under torchrun: this node's
    device = run_device(config, world_size)  # first: a run the machine cannot start prepares nothing
    out = config.out or default_run_dir()
    if restart and complete_checkpoints(Path(out)):
        config = dataclasses.replace(config, resume=True)
    if not config.resume and not restart:
        check_run_dir(Path(out))
    check_writable(Path(out) / "config.toml")  # a read-only or forbidden --out: refused before any work
    data = config.data or [f"stdlib={default_store()}"]
    sources = open_sources(parse_mixture(data))
    store = sources[0].store  # every source has the same tokenizer (open_sources checks)
    model_config, checkpoint, init_from = resolve_model(config, store, Path(out))
    # The loader checks batch, sequence and conversation settings against the data; building one reads no tokens
    # (but an over-long conversation's, to truncate it).
    resolved = resolve(config, [source.store for source in sources], device)
    config = dataclasses.replace(config, doc_mask=resolved.doc_mask.value)
    check_preferences(config, sources)
    check_conversations(config, sources)
    check_sequence_fits(config, sources)
    check_fits(run_shape(config), model_config, local_ranks, device.kind)
    resume_from = check_resume(config, Path(out), model_config, sources) if config.resume else None
    if resume_from is not None:
        check_reference_kept(config, Path(out))
    model = config.model or (None if config.init_from else DEFAULT_MODEL)
    return CheckedRun(dataclasses.replace(config, data=data, out=out, model=model, device=device.kind), model_config,
                      checkpoint, resolved, resume_from, restart, None if resume_from else init_from,
                      recorded_device(Path(out)) if config.resume else None)


def recorded_device(out: Path) -> str | None:
    """The device the run in `out` last ran on, as its config.toml records it (None: a run from before --device)."""
    try:
        return tomllib.loads((out / "config.toml").read_text()).get("device")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None


def check_same_data(checkpoint: Path, sources: list[Source]) -> None:
    """Refuse to resume onto stores whose content is not what the run trained on (prepared again from other or
    reordered rows: the counts may all agree), compared by the content digests `burst prepare` records and each
    checkpoint keeps; a store or checkpoint of a burst from before them is not compared, and that is said."""
    recorded = read_train_state(checkpoint)["loader"].get("content")
    digests = [source.store.content_digest for source in sources]
    if not isinstance(recorded, list) or len(recorded) != len(sources) or None in recorded or None in digests:
        if os.environ.get("LOCAL_RANK") is None:  # said once, by the launcher (or the single process)
            print(f"note: the data's content is not compared with what {checkpoint} trained on: the store or the "
                  f"checkpoint was written by a burst from before content digests", file=sys.stderr, flush=True)
        return
    for source, then, now in zip(sources, recorded, digests, strict=True):
        if then != now:
            raise ValueError(f"--data {source.spec.name} ({source.spec.path}) holds other data than the run trained "
                             f"on: its content digest is not the one {checkpoint.name} recorded (the store was "
                             f"prepared again, from other or reordered rows); resume with the data the run trained "
                             f"on, or start a new stage on this data with --init-from {checkpoint.parent.parent}")


def check_resume(config: TrainConfig, out: Path, model_config: ModelConfig, sources: list[Source]) -> Path:
    """The newest complete checkpoint of the run in `out`, checked whole and against the run's model, settings,
    tokenizer, data and history; nothing is written (a refused resume leaves the run as it was)."""
    sources[0].store.check_tokenizer(out, out)  # first: the likeliest cause of any other difference
    path = resolve_checkpoint(out)
    check_model_config(path, model_config)
    check_same_data(path, sources)
    recorded = read_train_state(path).get("settings")
    if isinstance(recorded, dict):  # checkpoints of older versions recorded none
        now = run_identity(config)
        changed = [name for name in now if name in recorded and recorded[name] != now[name]
                   and not (name == "steps" and now[name] > recorded[name])]  # an extended run
        if changed:
            raise ValueError(f"{out / 'config.toml'} no longer describes the run its checkpoint {path.name} "
                             f"trained: " + ", ".join(f"{name} {now[name]!r} there, {recorded[name]!r} in the "
                                                      f"checkpoint" for name in changed)
                             + "; it was edited after the run started: restore those settings, or start a new "
                               f"stage from it with --init-from {out}")
    metrics_rows(out)  # a damaged history is refused here; a torn last line is dropped on resume
    step = step_of(path)
    if step >= config.steps:
        raise ValueError(f"the run in {out} is finished: its newest checkpoint {path.name} is at step {step} of "
                         f"{config.steps}; there is nothing to resume (pass --steps above {step} to extend it)")
    if config.stop_after is not None and config.stop_after <= step:
        raise ValueError(f"--stop-after {config.stop_after} is not after the checkpoint to resume from "
                         f"({path.name}, step {step}); pass a later step")
    return path
