"""The training configuration: one typed dataclass, read from defaults < a TOML file < command-line flags.

    config = load_config("run.toml", overrides={"cp": 2})   # flags win over the file, the file over defaults
    save_config(config, out / "config.toml")                # the run records exactly what it ran with

The defaults train the `tiny` model on the embedded corpus in a few minutes on a 2-core machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomllib

if TYPE_CHECKING:
    from models.config import TrainingRecipe
    from models.lora import LoRAConfig

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
# The settings a model's training recipe fills in when neither a flag nor the config file sets them.
RECIPE_FIELDS = ("lr", "warmup", "min_lr_ratio", "weight_decay", "beta1", "beta2", "max_grad_norm")
RECIPE_SHOWN = "the model's training recipe (fine-tuning's for --model DIR, --init-from; docs/training-defaults.md)"
MIN_TIMEOUT, MAX_TIMEOUT = 0.1, 7 * 24 * 60.0  # minutes: --timeout becomes a timedelta and every collective's wait
MAX_LR = 1.0  # AdamW moves each weight by about lr per step: beyond this no run trains
# The default --val-tokens. A validation pass runs forward only, about a third of a training step's work per token
# (backward costs about twice the forward), so two steps' tokens take about two thirds of a step's time: each pass
# stays within one step's time, a third to spare for what forward-only does not save (the loss over the
# vocabulary, a batch of one sequence). Below MIN_VAL_TOKENS a validation loss is mostly the noise of which
# document it holds: steps shorter than half that validate on that many, a few of their short steps' time.
VAL_STEPS, MIN_VAL_TOKENS = 2, 2048
DEVICE_HELP = ("Where the ranks run: cuda (a GPU per local rank, NCCL), cpu (gloo ranks on the CPU, even beside GPUs, "
               "which stay untouched) or auto (cuda where a GPU is visible, else cpu); the BURST_DEVICE environment "
               "variable when not given.")


def flag(name: str) -> str:
    """The command-line flag of the setting `name`: seq_len -> --seq-len."""
    return "--" + name.replace("_", "-")


def setting(default: Any, help: str, shown: str | None = None) -> Any:
    """A TrainConfig field with its help text (and, for a None default, how `--help` describes it):
    `burst train` builds its options from these, so each setting is declared once."""
    return field(default=default, metadata={"help": help, "shown": shown})


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on. Global batch = batch_size x dp x grad_accum sequences of seq_len."""

    model: str | None = setting(None, "Preset (debug, tiny, llama3-8b, ...: models.PRESETS) or a native or Hugging "
                                      "Face checkpoint directory to start from.", shown="tiny, or --init-from's model")
    init_from: str | None = setting(None, "Start this new run from the weights of another run (its newest checkpoint) "
                                          "or training checkpoint: a new stage with its own seq-len, data, RoPE, "
                                          "layout and schedule; the model's shape is the checkpoint's.")
    init_optimizer: bool = setting(False, "With --init-from, also start from its optimizer state (AdamW's moments and "
                                          "step counts), under this run's learning-rate schedule.")
    data: list[str] | None = setting(None, "Token store from `burst prepare`, or several with their shares of the "
                                           "tokens: repeat --data [NAME=]STORE[:SHARE][:min_doc=TOKENS], e.g. --data "
                                           "code=stores/code:0.6 --data short=stores/web:0.4 (the shares sum to 1; "
                                           "min_doc keeps documents of at least that many tokens).",
                                     shown="the embedded stdlib corpus")
    rope_theta: float | None = setting(None, "RoPE base of the model trained, replacing the preset's or checkpoint's "
                                             "(e.g. 8e6 to extend a LLaMA-3 to 64K tokens, as ProLong does).",
                                       shown="the model's")
    rope_scaling: str | None = setting(None, "RoPE scaling of the model trained: none, or TYPE:key=value,... with TYPE "
                                             "linear (factor), dynamic (factor), yarn (factor; attention_factor, "
                                             "beta_fast, beta_slow, mscale, mscale_all_dim, truncate), longrope "
                                             "(short_factor=a,b,..., long_factor=..., factor or attention_factor) or "
                                             "llama3 (factor, low_freq_factor, high_freq_factor); all but linear also "
                                             "take original_max_position_embeddings (default: the context the model "
                                             "was trained at: its present scaling's original length, else its "
                                             "max_seq_len, or the --seq-len an --init-from run from a preset trained "
                                             "at); e.g. yarn:factor=8,original_max_position_embeddings=1024.",
                                       shown="the model's")
    seq_len: int = setting(1024, "Tokens per sequence, split over the --cp ranks.")
    cp: int = setting(1, "Sequence-parallel degree: ranks that share one sequence (BurstAttention).")
    dp: int = setting(1, "Data-parallel degree: groups of --cp ranks that see different sequences.")
    batch_size: int = setting(1, "Sequences per data-parallel rank per micro-batch.")
    grad_accum: int = setting(1, "Micro-batches per optimizer step.")
    steps: int = setting(40, "Optimizer steps of the whole run (the LR schedule spans them).")
    # The optimizer's settings default to the training recipe of the model's preset (`resolve_recipe`).
    lr: float | None = setting(None, "Peak learning rate.", shown=RECIPE_SHOWN)
    min_lr_ratio: float | None = setting(None, "The cosine decays to lr x min_lr_ratio at the last step.",
                                         shown=RECIPE_SHOWN)
    warmup: int | None = setting(None, "Steps of linear warmup from lr / warmup to lr; below --steps.",
                                 shown=RECIPE_SHOWN + ", cut to --steps - 1 when longer")
    weight_decay: float | None = setting(None, "Decoupled weight decay (AdamW); not applied to norms and embeddings.",
                                         shown=RECIPE_SHOWN)
    beta1: float | None = setting(None, "AdamW beta1.", shown=RECIPE_SHOWN)
    beta2: float | None = setting(None, "AdamW beta2.", shown=RECIPE_SHOWN)
    max_grad_norm: float | None = setting(None, "Clip the global gradient norm (over all shards) to this; 0: no "
                                                "clipping.", shown=RECIPE_SHOWN)
    # A run saves the resolved precision (config.toml, with the reason), so it resumes alike on other hardware.
    precision: str = setting("auto", "bf16: bf16 compute over float32 master weights (FSDP2 mixed precision on "
                                     "CUDA, else autocast); fp32: no autocast; auto: bf16 where the hardware computes "
                                     "in bf16 natively (CUDA, CPUs with AVX512-BF16 or AMX), fp32 elsewhere.")
    # A run records the device it ran on (config.toml); --resume resolves it again, and says so when it changed.
    device: str | None = setting(None, DEVICE_HELP, shown="$BURST_DEVICE, else auto")
    # Old config files' true/false read as selective/none (`_upgraded`).
    activation_checkpointing: str = setting("none", "none; full: recompute each block's activations in backward; "
                                                    "selective: the same, but keep attention's output, so the ring "
                                                    "forward never runs twice.")
    compile: bool = setting(False, "Compile each transformer block with torch.compile (attention stays one opaque "
                                   "operator).")
    check_ranks_every: int = setting(100, "Steps between checks that the cp ranks' attention inputs agree (one "
                                          "all-gather per attention call); the first step always checks.")
    attention_backward: str = setting("auto", "BurstAttention backward communication: burst, ring or auto "
                                              "(fewer bytes).")
    attention_kernel: str = setting("auto", "Local attention kernel of BurstAttention's blocks: auto (the fastest "
                                            "installed one that agrees with the math kernel on a self-check), math, "
                                            "cpu, flash, efficient, cudnn, fa3, fa4, flash-attn or torch "
                                            "(docs/kernels.md).")
    cp_topology: str = setting("auto", "How BurstAttention's blocks travel between nodes: flat (one ring), two-level "
                                       "(a ring per node, one hop per round across), ulysses (all-to-all over heads "
                                       "in a node, ring across) or auto (flat on one node, else fewest bytes "
                                       "across nodes).")
    doc_mask: bool | None = setting(None, "Attend only within each packed document; positions restart at every "
                                          "document.", shown="on for instruction and preference stores (which need "
                                                             "it), else off")
    cp_layout: str = setting("auto", "How each sequence is cut into the cp ranks' shards: zigzag (2 x cp chunks), "
                                     "balanced (chosen per sequence from its documents so that every rank does the "
                                     "same attention work; needs --doc-mask) or auto (balanced with --doc-mask, "
                                     "else zigzag).")
    train_on_prompt: bool = setting(False, "Score every token of an instruction store's conversations (`burst prepare "
                                           "--chat`), prompts too, not only the answers.")
    long_conversations: str = setting("refuse", "A conversation longer than a sequence: refuse (the run, naming it), "
                                                "truncate (cut the prompt's start away, BOS kept) or split (into "
                                                "sequence-long pieces).")
    objective: str = setting("nll", "What training minimises: nll (the next-token loss), or on a preference store "
                                    "(`burst prepare --preference`) dpo, ipo, simpo or orpo (TRL's formulas).")
    beta: float = setting(0.1, "A preference objective's beta: the KL strength of dpo and ipo, the reward scale of "
                               "simpo.")
    simpo_gamma: float = setting(0.5, "SimPO's target reward margin gamma.")
    orpo_lambda: float = setting(0.1, "ORPO's weight lambda of the odds-ratio term beside the chosen answer's NLL.")
    prefix_sharing: bool = setting(True, "Pack a preference pair's prompt once, both answers seeing it (each at the "
                                         "positions it would have after the prompt alone); --no-prefix-sharing packs "
                                         "prompt + chosen and prompt + rejected as two documents.")
    # LoRA (models/lora.py; docs/lora.md): one section, `lora` below gathers it.
    lora_rank: int = setting(0, "Train a LoRA adapter of this rank on the frozen model (0: full fine-tuning; 8 to 64 "
                                "are usual); only the adapters get gradients and optimizer state.")
    lora_alpha: float = setting(16.0, "LoRA's alpha: the adapter's update is scaled by alpha / rank.")
    lora_dropout: float = setting(0.0, "Dropout on the adapters' input (0 to 0.1 are usual).")
    lora_targets: str = setting("q,k,v,o", "The linear layers that get adapters, comma-separated: q, k, v, o "
                                           "(attention) and gate, up, down (the MLP).")
    train_embeddings_and_norms: bool = setting(False, "With --lora-rank, also train the token embeddings and the "
                                                      "RMSNorm gains (LongLoRA: needed to extend the context).")
    init_adapter: str | None = setting(None, "A PEFT LoRA adapter directory (adapter_config.json, "
                                             "adapter_model.safetensors) to start the adapter from, on --model's "
                                             "weights; its rank, alpha and targets become the run's.")
    # Memory at long sequences (docs/lora.md): none changes the result.
    offload_activations: bool = setting(False, "Keep each block's saved input in pinned host memory between forward "
                                               "and backward (needs --activation-checkpointing full or selective).")
    mlp_tile: int = setting(0, "Compute the MLP over slices of this many tokens, so its [tokens, ffn] intermediate "
                               "never spans the whole sequence (0: the whole sequence at once).")
    loss_tile: int = setting(1024, "Tokens whose logits the loss forms at once (the [tokens, vocab] slice).")
    seed: int = setting(0, "Seed of the initial weights and the data order.")
    val_tokens: int | None = setting(None, "Held-out tokens (the data's validation split) scored at the start and the "
                                           "end of each invocation and every --val-every steps, rounded up to whole "
                                           "sequences and never more than the split holds (no token twice): the "
                                           "validation loss of metrics.jsonl and the summary; 0: none.",
                                     shown=f"{VAL_STEPS} steps' tokens, at least {MIN_VAL_TOKENS}: about 2/3 of a "
                                           f"step's time")
    val_every: int = setting(0, "Steps between validation losses during the run (0: at the start and end only).")
    out: str | None = setting(None, "Run directory (must be new, unless --resume).", shown="runs/DATE-TIME")
    log_every: int = setting(1, "Steps between logged metrics.")
    max_bad_steps: int = setting(3, "Non-finite steps in a row that end the run.")
    checkpoint_every: int = setting(0, "Steps between training checkpoints (0: only at the end and when stopped).")
    keep: int = setting(2, "Newest complete checkpoints to keep; older ones are deleted once a newer one is complete.")
    async_checkpoint: bool = setting(False, "Write checkpoints in the background while training goes on (at most "
                                            "one save in flight).")
    max_restarts: int = setting(0, "Times the launcher restarts the workers after one dies; they continue from the "
                                   "newest complete checkpoint. Under torchrun, pass torchrun's own --max-restarts.")
    timeout: float = setting(30.0, "Minutes a collective may wait for a rank (a hung or dead one) before the run "
                                   "ends with an error.")
    # This invocation only (not written to config.toml):
    resume: bool = setting(False, "Continue the run in --out from its newest complete checkpoint, with its "
                                  "config.toml (cp, dp may change).")
    stop_after: int | None = setting(None, "End this invocation after this step, with a checkpoint; the schedule "
                                           "stays --steps.", shown="--steps")

    def __post_init__(self) -> None:
        # Here, not at the top: `burst --help` builds its options from these fields and must not import torch.
        from burst.attention import check_backward_mode
        from burst.kernels import check_kernel_name
        from burst.layout import check_layout, check_sequence_length
        from burst.topology import check_topology
        from data.conversation_packing import check_policy
        from data.mixture import parse_mixture, resolved_sources
        from models.config import PRESETS
        from models.rope import check_theta, parse_rope_scaling
        from runtime.device import check_device
        from runtime.precision import PRECISIONS

        for name in ("seq_len", "cp", "dp", "batch_size", "grad_accum", "steps", "log_every", "max_bad_steps",
                     "check_ranks_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} {getattr(self, name)} must be at least 1")
        if self.keep < 1:
            raise ValueError(f"--keep {self.keep} must be at least 1: a run keeps its newest checkpoint")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"--stop-after {self.stop_after} must be a step of the run, 1 to --steps {self.steps}; "
                             f"pass an earlier step, or raise --steps")
        resolve_recipe(self)
        for name in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "max_grad_norm"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{flag(name)} {getattr(self, name)} must be a finite number")
        for name in ("lr", "warmup", "weight_decay", "max_grad_norm", "checkpoint_every", "max_restarts",
                     "val_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{flag(name)} {getattr(self, name)} must not be negative")
        if self.val_tokens is None:
            object.__setattr__(self, "val_tokens", max(VAL_STEPS * self.tokens_per_step, MIN_VAL_TOKENS))
        if self.val_tokens < 0:
            raise ValueError(f"--val-tokens {self.val_tokens} must not be negative (0: no validation)")
        if not MIN_TIMEOUT <= self.timeout <= MAX_TIMEOUT:
            raise ValueError(f"--timeout {self.timeout:g} minutes must be between {MIN_TIMEOUT:g} (a collective of a "
                             f"healthy step takes longer than a few seconds) and {MAX_TIMEOUT:g} (a week); 30 suits "
                             f"most runs, more for very long steps on a slow link")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed {self.seed} must be between 0 and 2^63 - 1 (it seeds numpy's and torch's "
                             f"generators)")
        if self.warmup >= self.steps:
            raise ValueError(f"--warmup {self.warmup} is not below --steps {self.steps}: the whole run would stay in "
                             f"warmup, its learning rate never reaching --lr; lower --warmup (a few percent of "
                             f"--steps is usual) or raise --steps")
        if self.lr > MAX_LR:
            raise ValueError(f"--lr {self.lr} would wreck the weights in one step (AdamW moves each weight by about "
                             f"--lr per step; 1e-4 to 1e-2 are usual); pass at most {MAX_LR}")
        if self.lr * self.weight_decay >= 1:
            raise ValueError(f"--weight-decay {self.weight_decay:g} with --lr {self.lr:g}: decoupled AdamW multiplies "
                             f"each decayed weight by 1 - lr x weight decay = {1 - self.lr * self.weight_decay:g} "
                             f"every step, which zeroes or flips the weights; lr x weight decay must stay below 1 (a "
                             f"weight decay of 0.01 to 0.1 is usual)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio {self.min_lr_ratio} must be in [0, 1]")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} {getattr(self, name)} must be in [0, 1), e.g. 0.9 or 0.95")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.device is not None:
            check_device(self.device)
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(f"--activation-checkpointing {self.activation_checkpointing!r} is not one of "
                             f"{', '.join(ACTIVATION_CHECKPOINTING)}")
        if self.rope_theta is not None:
            check_theta(self.rope_theta, "--rope-theta")
        if self.rope_scaling is not None:
            # The model's context length is known only once the model is (trainer/preflight.py fills it in);
            # seq_len stands in for it here, where everything else about the flag is checked.
            parse_rope_scaling(self.rope_scaling, "--rope-scaling", original_length=self.seq_len)
        check_policy(self.long_conversations)
        from models.preference import OBJECTIVES, check_settings
        if self.objective not in ("nll", *OBJECTIVES):
            raise ValueError(f"--objective {self.objective!r} is not one of nll, {', '.join(OBJECTIVES)}")
        check_settings(self.objective, self.beta, self.simpo_gamma, self.orpo_lambda)
        check_backward_mode(self.attention_backward, "--attention-backward")
        check_kernel_name(self.attention_kernel, "--attention-kernel")
        check_topology(self.cp_topology, "--cp-topology")
        if self.cp_layout != "auto":
            check_layout(self.cp_layout, "--cp-layout")
        if self.init_adapter is not None:
            object.__setattr__(self, "init_adapter", str(Path(self.init_adapter).resolve()))
            adopted = adapter_settings(self.init_adapter)
            if self.lora_rank not in (0, adopted["lora_rank"]):
                raise ValueError(f"--lora-rank {self.lora_rank} differs from the rank {adopted['lora_rank']} of "
                                 f"--init-adapter {self.init_adapter}; drop --lora-rank (the adapter's is used)")
            for name, value in adopted.items():
                object.__setattr__(self, name, value)
        self.lora  # noqa: B018 -- checks the LoRA settings, each naming its flag
        for name in ("mlp_tile", "loss_tile"):
            if getattr(self, name) < 0 or (name == "loss_tile" and self.loss_tile == 0):
                raise ValueError(f"{flag(name)} {getattr(self, name)} must be " + ("at least 0 (0: no slicing)" if
                                 name == "mlp_tile" else "at least 1 (1024 is usual)"))
        if self.offload_activations and self.activation_checkpointing == "none":
            raise ValueError("--offload-activations moves the block inputs that activation checkpointing keeps: "
                             "pass --activation-checkpointing full (or selective) too")
        if self.cp_layout == "balanced" and not self.doc_mask:
            raise ValueError("--cp-layout balanced is chosen from each sequence's documents, which attention sees "
                             "only with --doc-mask; add --doc-mask, or use --cp-layout zigzag (or auto)")
        try:
            check_sequence_length(self.seq_len, self.cp)
        except ValueError as err:
            raise ValueError(f"--seq-len {self.seq_len} does not split over --cp {self.cp} ranks: {err}") from None
        if self.init_optimizer and self.init_from is None:
            raise ValueError("--init-optimizer starts from the optimizer state of --init-from's checkpoint: pass "
                             "--init-from RUN_OR_CHECKPOINT too")
        if self.init_from is not None and self.model is not None:
            raise ValueError(f"--init-from {self.init_from} starts from that checkpoint's model, so --model "
                             f"{self.model} would not be used; drop --model (its RoPE may change with --rope-theta "
                             f"and --rope-scaling)")
        # Paths are kept absolute, so a run resumed from another directory finds its data and model.
        if self.data is not None:  # a single store may be given as a plain path
            sources = [self.data] if isinstance(self.data, str) else self.data
            object.__setattr__(self, "data", [str(spec) for spec in resolved_sources(parse_mixture(sources))])
        if self.model is not None and self.model not in PRESETS and Path(self.model).is_dir():
            object.__setattr__(self, "model", str(Path(self.model).resolve()))
        if self.init_from is not None:
            object.__setattr__(self, "init_from", str(Path(self.init_from).resolve()))

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
        if self.cp_layout != "auto":
            return self.cp_layout
        return "balanced" if self.doc_mask else "zigzag"

    @property
    def lora(self) -> LoRAConfig:
        """The LoRA section of the run (rank 0: full fine-tuning)."""
        from models.lora import LoRAConfig

        return LoRAConfig(rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                          targets=LoRAConfig.parse_targets(self.lora_targets),
                          train_embeddings_and_norms=self.train_embeddings_and_norms)

    @property
    def world_size(self) -> int:
        return self.cp * self.dp

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all ranks."""
        return self.seq_len * self.batch_size * self.dp * self.grad_accum


def adapter_settings(directory: str) -> dict[str, Any]:
    """The LoRA settings (TrainConfig fields) of the PEFT adapter in `directory`, for --init-adapter."""
    from models.lora import PEFT_CONFIG, config_from_peft
    from models.storage import read_json

    path = Path(directory) / PEFT_CONFIG
    if not path.is_file():
        raise ValueError(f"--init-adapter {directory} holds no {PEFT_CONFIG}: pass a PEFT LoRA adapter directory "
                         f"(`burst convert-checkpoint RUN DIR --to peft` writes one)")
    lora = config_from_peft(read_json(path), str(path))
    return {"lora_rank": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "lora_targets": ",".join(lora.targets), "train_embeddings_and_norms": lora.train_embeddings_and_norms}


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
                     "timeout", "val_tokens", "val_every", "offload_activations", "mlp_tile", "loss_tile",
                     *INVOCATION_FIELDS)


def run_identity(config: TrainConfig) -> dict[str, Any]:
    """The settings that make a run what it is, as JSON values: all but those --resume may change. Each
    checkpoint records them, so a config.toml edited by hand cannot change a run behind its back."""
    return json.loads(json.dumps({name: getattr(config, name) for name in FIELDS
                                  if name not in RESUMABLE_CHANGES and name != "out"}))


def _accepted_types(name: str) -> tuple[Any, ...]:
    """The types a value of field `name` may have (an int is a fine float; None only where allowed)."""
    annotation = typing.get_type_hints(TrainConfig)[name]
    types_ = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return types_ + ((int,) if float in types_ else ())


def _is_a(value: Any, kind: Any) -> bool:
    """isinstance for the field types: plain classes, and list[str] (a list of strings)."""
    if typing.get_origin(kind) is list:
        return isinstance(value, list) and all(_is_a(item, typing.get_args(kind)[0]) for item in value)
    return (kind is bool or not isinstance(value, bool)) and isinstance(value, kind)


def _checked(values: dict[str, Any], source: str) -> dict[str, Any]:
    """`values` if every key is a TrainConfig field holding a value of its type; else a ValueError naming it."""
    for key, value in values.items():
        if key not in FIELDS:
            raise ValueError(f"unknown setting {key!r} in {source}; valid settings: {', '.join(FIELDS)}")
        accepted = _accepted_types(key)
        if not any(_is_a(value, kind) for kind in accepted):
            names = " or ".join("list of strings" if typing.get_origin(t) is list else t.__name__
                                for t in accepted if t is not type(None))
            raise ValueError(f"setting {key!r} in {source} is {value!r}, which is not a {names}")
    return values


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


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None, *,
                recorded: bool = False) -> TrainConfig:
    """Defaults, replaced by the settings of the TOML file at `path`, replaced by `overrides` (flags).
    recorded: `path` is a run's own config.toml (--resume)."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            values.update(_checked(_upgraded(tomllib.loads(path.read_text()), str(path), recorded), str(path)))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
            raise ValueError(f"cannot read the config file {path}: {err}") from None
        in_file = [name for name in INVOCATION_FIELDS if name in values]
        if in_file:
            raise ValueError(f"{path} sets {', '.join(in_file)}, which apply to one invocation only and so come "
                             f"from the command line; delete the line and pass "
                             f"{' / '.join(flag(name) for name in in_file)} instead")
    values.update(_checked(overrides or {}, "the command line"))
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
    # The device recorded is where the run ran, not a request: this machine's is resolved again (flag, BURST_DEVICE,
    # auto), and the run says so when it changed (trainer/trainer.py).
    config = load_config(path, {"device": None, **overrides, "out": str(out), "resume": True}, recorded=True)
    changed = [name for name in FIELDS if name not in RESUMABLE_CHANGES and name != "out"
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
