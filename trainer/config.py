"""The training configuration: typed sections, read from defaults < a TOML file < command-line flags.

    config = load_config("run.toml", overrides={"cp": 2})   # flags win over the file, the file over defaults
    save_config(config, out / "config.toml")                # the run records exactly what it ran with

TrainConfig is the sections of trainer/sections.py side by side (model, data, parallelism, optimizer, objective,
checkpointing, run): each checks its own fields; TrainConfig fills the defaults that depend on other sections (the
recipe's optimizer settings, --val-tokens) and checks the rules that join them. config.toml stays one flat table.
The defaults train the `tiny` model on the embedded corpus in a few minutes on a 2-core machine.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomllib

from runtime.settings import checked, flag
from trainer.sections import (
    MIN_VAL_TOKENS,
    SECTIONS,
    VAL_STEPS,
    Checkpointing,
    Data,
    Lora,
    Memory,
    Model,
    Objective,
    Optimizer,
    Parallelism,
    Run,
    sequence_layout,
)

if TYPE_CHECKING:
    from models.config import TrainingRecipe

# The settings a model's training recipe fills in when neither a flag nor the config file sets them.
RECIPE_FIELDS = ("lr", "warmup", "min_lr_ratio", "weight_decay", "beta1", "beta2", "max_grad_norm")


# Fields are gathered from the last base to the first: the reversed SECTIONS keep their order in config.toml and --help.
@dataclass(frozen=True)
class TrainConfig(Run, Checkpointing, Memory, Lora, Objective, Optimizer, Parallelism, Data, Model):
    """Everything a training run depends on. Global batch = batch_size x dp x grad_accum sequences of seq_len."""

    def __post_init__(self) -> None:
        for section in SECTIONS:
            section.check(self)
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"--stop-after {self.stop_after} must be a step of the run, 1 to --steps {self.steps}; "
                             f"pass an earlier step, or raise --steps")
        resolve_recipe(self)
        Optimizer.check_filled(self)
        if self.val_tokens is None:
            object.__setattr__(self, "val_tokens", max(VAL_STEPS * self.tokens_per_step, MIN_VAL_TOKENS))
        self.check_across()

    def check_across(self) -> None:
        """The rules that join sections."""
        from burst.layout import check_sequence_length
        from models.rope import parse_rope_scaling

        if self.rope_scaling is not None:
            # The model's context length is known only once the model is (trainer/preflight.py fills it in);
            # seq_len stands in for it here, where everything else about the flag is checked.
            parse_rope_scaling(self.rope_scaling, "--rope-scaling", original_length=self.seq_len)
        if self.offload_activations and self.activation_checkpointing == "none":
            # the block inputs it moves are those recomputation keeps: without a mode given, full
            object.__setattr__(self, "activation_checkpointing", "full")
        if self.cp_layout == "balanced" and not self.doc_mask:
            raise ValueError("--cp-layout balanced is chosen from each sequence's documents, which attention sees "
                             "only with --doc-mask; add --doc-mask, or use --cp-layout zigzag (or auto)")
        try:
            check_sequence_length(self.seq_len, self.cp)
        except ValueError as err:
            raise ValueError(f"--seq-len {self.seq_len} does not split over --cp {self.cp} ranks: {err}") from None

    @property
    def recipe(self) -> TrainingRecipe:
        """The training recipe of the model this run starts from: its preset's (default tiny), or fine-tuning's
        for weights trained already (--model DIR, --init-from)."""
        from models.config import FINE_TUNING, PRESETS  # here: `burst --help` reads this module without torch

        return FINE_TUNING if self.starts_trained else PRESETS[self.model or "tiny"].recipe

    @property
    def recipe_name(self) -> str:
        """The recipe's name in the settings table: preset NAME recipe, or fine-tuning recipe."""
        return "fine-tuning recipe" if self.starts_trained else f"preset {self.model or 'tiny'} recipe"

    @property
    def starts_trained(self) -> bool:
        """Whether the run starts from trained weights (--init-from, --model DIR) rather than a preset's fresh ones."""
        from models.config import PRESETS

        return self.init_from is not None or (self.model or "tiny") not in PRESETS

    @property
    def sequence_layout(self) -> str:
        """The layout the cp ranks cut sequences with (burst/layout.py): cp_layout with auto resolved."""
        return sequence_layout(self.cp_layout, bool(self.doc_mask)).value

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all ranks."""
        return self.seq_len * self.batch_size * self.dp * self.grad_accum


# What shapes a LoRA adapter besides its rank: read only with --lora-rank, and taken from the adapter with
# --init-adapter.
LORA_SHAPE = ("lora_alpha", "lora_dropout", "lora_targets", "train_embeddings_and_norms")


def ignored_settings(config: TrainConfig, given: set[str]) -> dict[str, str]:
    """The settings of `given` (flags, and a --config file's keys) that this run would never read, each with why;
    runtime/given.py refuses them."""
    ignored = {}
    if config.objective == "nll":
        ignored.update({name: "is a preference objective's (--objective dpo | ipo | simpo | orpo); the next-token "
                              "loss does not use it" for name in ("beta", "simpo_gamma", "orpo_lambda")})
        ignored["prefix_sharing"] = ("packs a preference pair's prompt for a preference objective (--objective dpo | "
                                     "ipo | simpo | orpo); the next-token loss has no pairs")
    else:
        held_out = ("is for a validation loss; a preference run's held-out pairs are scored by `burst eval` (reward "
                    "accuracy and margins)")
        ignored.update(val_tokens=held_out, val_every=held_out)
        if config.objective != "simpo":
            ignored["simpo_gamma"] = f"is SimPO's target margin; --objective {config.objective} does not use it"
        if config.objective != "orpo":
            ignored["orpo_lambda"] = f"is ORPO's odds-ratio weight; --objective {config.objective} does not use it"
    if config.val_tokens == 0 and "val_every" not in ignored:
        ignored["val_every"] = "sets the steps between validation losses, and --val-tokens 0 turns validation off"
    if config.lora_rank == 0:
        ignored.update({name: "shapes a LoRA adapter, which only --lora-rank N trains (8 to 64 are usual; add it for "
                              "one): without it the run trains every weight" for name in LORA_SHAPE})
    elif config.init_adapter is not None:  # Lora.check replaced them with the adapter's own
        ignored.update({name: f"is the adapter's own with --init-adapter (its {name} is "
                              f"{getattr(config, name)!r}, from its adapter_config.json)" for name in LORA_SHAPE})
    if "long_conversations" in given and not _holds_conversations(config):
        ignored["long_conversations"] = ("is for instruction and preference stores (`burst prepare --chat`, "
                                         "--preference), whose conversations may outgrow a sequence; no --data store "
                                         "holds conversations")
    return ignored


def _holds_conversations(config: TrainConfig) -> bool:
    """Whether a --data store holds conversations or preference pairs (the embedded corpus does not); a store that
    cannot be opened counts as one, left to preflight to refuse by name."""
    from data.mixture import parse_mixture
    from data.store import TokenStore

    for spec in parse_mixture(config.data or []) if config.data else []:
        try:
            store = TokenStore(spec.path)
            if store.is_conversations or store.is_preferences:
                return True
        except (OSError, ValueError):
            return True
    return False


def recipe_value(config: TrainConfig, name: str) -> float | int:
    """The value the model's recipe gives the setting `name` in this run: its warmup cut to --steps - 1."""
    recipe = config.recipe
    return min(recipe.warmup_steps(config.steps), config.steps - 1) if name == "warmup" else getattr(recipe, name)


def resolve_recipe(config: TrainConfig) -> None:
    """Fill the optimizer settings neither a flag nor the config file set from the model's training recipe (a
    recorded run's config.toml sets them all, so a resume keeps its own). A recipe's warmup longer than the run
    is cut to --steps - 1 (`warmup_note` says so)."""
    for name in RECIPE_FIELDS:
        if getattr(config, name) is None:
            object.__setattr__(config, name, recipe_value(config, name))


def recipe_origin(config: TrainConfig, name: str) -> str:
    """Where the value of the recipe setting `name` came from, for the settings table."""
    if config.resume:
        return "the run's config.toml"
    return config.recipe_name if getattr(config, name) == recipe_value(config, name) else "flag or --config file"


def warmup_note(config: TrainConfig) -> str | None:
    """One line when the recipe's warmup was cut to fit a shorter run; None when it fits (or was set)."""
    wanted = config.recipe.warmup_steps(config.steps)
    if config.resume or wanted < config.steps or recipe_origin(config, "warmup") != config.recipe_name:
        return None
    return (f"warmup {wanted} steps of the {config.recipe_name} is longer than this {config.steps}-step run: warming "
            f"up over {config.warmup} steps (--warmup sets it)")


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
INVOCATION_FIELDS = ("resume", "stop_after")
# What --resume may change: the parallel layout (DCP reshards the state) and how the run reports and saves.
# Sequences per step (batch_size x dp x grad_accum) must stay, so the loss and schedule do not change.
RESUMABLE_CHANGES = ("device", "cp", "dp", "batch_size", "grad_accum", "activation_checkpointing",
                     "attention_backward", "attention_kernel", "cp_topology", "cp_layout", "compile",
                     "check_ranks_every", "log_every", "checkpoint_every", "keep", "async_checkpoint", "max_restarts",
                     "timeout", "val_tokens", "val_every", "offload_activations", "mlp_tile", "loss_tile", "wandb",
                     *INVOCATION_FIELDS)


def run_identity(config: TrainConfig) -> dict[str, Any]:
    """The settings that make a run what it is, as JSON values: all but those --resume may change. Each
    checkpoint records them, so a config.toml edited by hand cannot change a run behind its back."""
    return json.loads(json.dumps({name: getattr(config, name) for name in FIELDS
                                  if name not in RESUMABLE_CHANGES and name != "out"}))


def val_sequences_replaced(where: str) -> str:
    """Why `where` (--val-sequences, or a config file's val_sequences) is refused, and what to write instead."""
    return (f"{where} was replaced by --val-tokens (val_tokens in a config file): validation is sized in held-out "
            f"tokens, so that a long --seq-len no longer scores the same held-out tokens several times over; pass "
            f"--val-tokens N (N sequences are N x --seq-len tokens), or leave it out for the default ({VAL_STEPS} "
            f"steps' tokens, at least {MIN_VAL_TOKENS}: about 2/3 of a step's time)")


def _upgraded(values: dict[str, Any], source: str, recorded: bool) -> dict[str, Any]:
    """Settings of an older config file in today's form: activation_checkpointing was a switch, data one store.
    recorded: the file is a run's own config.toml, which recorded every setting, set or not."""
    if isinstance(values.get("activation_checkpointing"), bool):
        values["activation_checkpointing"] = "selective" if values["activation_checkpointing"] else "none"
    if isinstance(values.get("data"), str):  # one store, before mixtures
        values["data"] = [values["data"]]
    if "val_sequences" in values:  # before val_tokens: a run resumed validates by val_tokens' default
        if not recorded:
            raise ValueError(val_sequences_replaced(f"val_sequences in {source}"))
        del values["val_sequences"]
    return values


# The first line of the notes a run writes atop its config.toml (trainer/trainer.py): how a run's record is told
# from a config file a user wrote.
RECORD_HEADER = "# precision "


def read_config_file(path: str | Path, recorded: bool = False) -> dict[str, Any]:
    """The settings the TOML file at `path` asks for, checked. recorded: `path` is the config.toml of the run this
    invocation resumes. A run's config.toml given as --config asks for what its run was asked for, not for what
    that run found: the device it ran on, its directory, and a recipe's warmup cut to its steps are left out."""
    path = Path(path)
    try:
        text = path.read_text()
        values = checked(TrainConfig, _upgraded(tomllib.loads(text), str(path), recorded), str(path))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"cannot read the config file {path}: {err}") from None
    in_file = [name for name in INVOCATION_FIELDS if name in values]
    if in_file:
        raise ValueError(f"{path} sets {', '.join(in_file)}, which apply to one invocation only and so come "
                         f"from the command line; delete the line and pass "
                         f"{' / '.join(flag(name) for name in in_file)} instead")
    if not recorded and is_run_record(path, text):
        values.pop("device", None)
        values.pop("out", None)
        if _cut_warmup(values):
            del values["warmup"]
    return values


def is_run_record(path: Path, text: str) -> bool:
    """Whether the config file `path` (holding `text`) is a run's own config.toml, as the run wrote it."""
    from runtime.directories import read_marker  # here, so `burst --help` reads this module alone

    return text.startswith(RECORD_HEADER) or (read_marker(path.parent) or {}).get("kind") == "run"


def _cut_warmup(values: dict[str, Any]) -> bool:
    """Whether a run's recorded `values` hold its recipe's warmup cut to its steps - 1 (`warmup_note`)."""
    steps = values.get("steps", FIELDS["steps"].default)
    if values.get("warmup") != steps - 1:
        return False
    recorded = TrainConfig(model=values.get("model"), init_from=values.get("init_from"), steps=steps)
    return recorded.recipe.warmup_steps(steps) >= steps


def given_in_file(path: str | Path | None) -> set[str]:
    """The settings a --config file asks for (none for a run's own config.toml: what it records is what that run
    ran with, not what was asked of it), for the refusal of settings given that a run would not read."""
    if path is None:
        return set()
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return set()  # refused by read_config_file, naming the file
    return set() if is_run_record(path, text) else set(read_config_file(path))


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None, *,
                recorded: bool = False) -> TrainConfig:
    """Defaults, replaced by the settings of the TOML file at `path`, replaced by `overrides` (flags).
    recorded: `path` is a run's own config.toml (--resume)."""
    values = read_config_file(path, recorded) if path is not None else {}
    values.update(checked(TrainConfig, overrides or {}, "the command line"))
    return TrainConfig(**values)


def to_toml(config: TrainConfig) -> str:
    """The config as TOML that `load_config` reads back to an equal config (None settings and this
    invocation's --resume/--stop-after are left out)."""
    lines = []
    for name, value in dataclasses.asdict(config).items():
        if value is None or name in INVOCATION_FIELDS:
            continue
        text = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, float) \
            else json.dumps(value) if isinstance(value, str | list) else str(value)  # JSON strings, lists: TOML
        lines.append(f"{name} = {text}")
    return "\n".join(lines) + "\n"


def save_config(config: TrainConfig, path: Path, notes: str = "") -> None:
    """Write `config` to `path`, after `notes` (say, why a setting has its value) as TOML comments; whole or
    not at all (a temporary renamed over it), so a full disk never leaves a truncated config.toml."""
    from runtime.directories import write_atomically  # here, so `burst --help` reads this module alone

    write_atomically(path, "".join(f"# {line}\n" for line in notes.splitlines()) + to_toml(config))


def load_run_config(out: str | Path, overrides: dict[str, Any]) -> TrainConfig:
    """The config to continue the run in `out` with (--resume): its config.toml with `overrides` (flags),
    which may change only RESUMABLE_CHANGES, and not the number of sequences per step."""
    path = Path(out) / "config.toml"
    if not path.is_file():
        raise ValueError(f"--resume: {out} holds no run to continue ({path} does not exist); pass the --out of "
                         f"an earlier run, or start a new run without --resume")
    saved = load_config(path, {"out": str(out)}, recorded=True)
    steps = overrides.get("steps", saved.steps)
    if steps < saved.steps:
        raise ValueError(f"--resume --steps {steps}: the run has {saved.steps} steps and cannot be shortened (its "
                         f"learning-rate schedule decays over them); pass --stop-after N to stop it earlier, or a "
                         f"--steps above {saved.steps} to extend it")
    # The device recorded is where the run ran, not a request: this machine's is resolved again (flag, BURST_DEVICE,
    # auto), and the run says so when it changed (trainer/trainer.py).
    config = load_config(path, {"device": None, **overrides, "out": str(out), "resume": True}, recorded=True)
    # a larger --steps extends the run (its schedule then the new length's, trainer/trainer.py says so)
    changed = [name for name in FIELDS if name not in RESUMABLE_CHANGES and name not in ("out", "steps")
               and getattr(config, name) != getattr(saved, name)]
    if changed:
        raise ValueError("--resume continues a run with its own settings, but "
                         + ", ".join(f"{flag(n)} {getattr(config, n)} differs from the run's "
                                     f"{_run_value(saved, n, Path(out))}" for n in changed)
                         + f"; drop these flags (only {', '.join(map(flag, RESUMABLE_CHANGES))} may change), "
                           f"or start a new run")
    if config.tokens_per_step != saved.tokens_per_step:
        raise ValueError(f"--resume: --batch-size x --dp x --grad-accum = {config.batch_size} x {config.dp} x "
                         f"{config.grad_accum} changes the run's {saved.batch_size * saved.dp * saved.grad_accum} "
                         f"sequences per step, which changes the loss and the data order; keep the product")
    return config


def _run_value(saved: TrainConfig, name: str, out: Path) -> str:
    """The run's value of setting `name`, for a refusal: a setting left unset reads as the default it stood for;
    for RoPE, the model's own, with its value (from the run's newest checkpoint, or its preset)."""
    value = getattr(saved, name)
    if value is not None:
        return str(value)
    if name not in ("rope_theta", "rope_scaling"):
        return FIELDS[name].metadata["shown"] or "none"
    from checkpoints.training import complete_checkpoints  # here: reading a model needs torch
    from models.checkpoint import read_config
    from models.config import PRESETS

    complete = complete_checkpoints(out)
    model = read_config(complete[-1]) if complete else getattr(PRESETS.get(saved.model or ""), "model", None)
    if model is None:
        return f"(unset: the model's own {name})"
    own = model.rope_theta if name == "rope_theta" else model.rope_scaling and model.rope_scaling.to_dict()
    return f"(unset: the model's own {name}, {'none' if own is None else own})"
