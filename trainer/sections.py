"""The sections of the training configuration, each a typed dataclass that checks its own fields.

    Model, Data, Parallelism, Optimizer, Objective, Lora, Memory, Checkpointing, Run

TrainConfig (trainer/config.py) is all of them at once: their fields side by side, as `config.seq_len` and
config.toml's flat `seq_len = 1024` name them, and the options of `burst train` (cli.py), in this order. A section's
`check` refuses its own fields' bad values, naming the flag; rules that join sections (a warmup below the steps, a
sequence that splits over the cp ranks) are TrainConfig's. A new feature's settings are a few fields in one section,
or a new section: a frozen dataclass of `setting` fields with a `check`, added to TrainConfig's SECTIONS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.settings import device_setting, flag, kernel_setting, setting
from trainer.plots import check_wandb

if TYPE_CHECKING:
    from models.lora import LoRAConfig

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
RECIPE_SHOWN = "the model's training recipe (fine-tuning's for --model DIR, --init-from; docs/training-defaults.md)"
MIN_TIMEOUT, MAX_TIMEOUT = 0.1, 7 * 24 * 60.0  # minutes: --timeout becomes a timedelta and every collective's wait
MAX_LR = 1.0  # AdamW moves each weight by about lr per step: beyond this no run trains
# The default --val-tokens. A validation pass runs forward only, about a third of a training step's work per token
# (backward costs about twice the forward), so two steps' tokens take about two thirds of a step's time: each pass
# stays within one step's time, a third to spare for what forward-only does not save (the loss over the
# vocabulary, a batch of one sequence). Below MIN_VAL_TOKENS a validation loss is mostly the noise of which
# document it holds: steps shorter than half that validate on that many, a few of their short steps' time.
VAL_STEPS, MIN_VAL_TOKENS = 2, 2048


def at_least_one(section: object, *names: str) -> None:
    for name in names:
        if getattr(section, name) < 1:
            raise ValueError(f"{flag(name)} {getattr(section, name)} must be at least 1")


def not_negative(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value < 0:
            raise ValueError(f"{flag(name)} {value} must not be negative")


# The checks import what they check with here, not at the top: `burst --help` builds its options from these fields
# and must not import torch.


@dataclass(frozen=True)
class Model:
    """The model trained and the weights it starts from."""

    model: str | None = setting(None, "Preset (debug, tiny, llama3-8b, ...: models.PRESETS) or a native or Hugging "
                                      "Face checkpoint directory to start from.", shown="tiny, or --init-from's model")
    init_from: str | None = setting(None, "Start this new run from the weights of another run (its newest checkpoint) "
                                          "or training checkpoint: a new stage with its own seq-len, data, RoPE, "
                                          "layout and schedule; the model's shape is the checkpoint's.")
    init_optimizer: bool = setting(False, "With --init-from, also start from its optimizer state (AdamW's moments and "
                                          "step counts), under this run's learning-rate schedule.")
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

    def check(self) -> None:
        from models.config import PRESETS
        from models.rope import check_theta

        if self.rope_theta is not None:
            check_theta(self.rope_theta, "--rope-theta")
        if self.init_optimizer and self.init_from is None:
            raise ValueError("--init-optimizer starts from the optimizer state of --init-from's checkpoint: pass "
                             "--init-from RUN_OR_CHECKPOINT too")
        if self.init_from is not None and self.model is not None:
            raise ValueError(f"--init-from {self.init_from} starts from that checkpoint's model, so --model "
                             f"{self.model} would not be used; drop --model (its RoPE may change with --rope-theta "
                             f"and --rope-scaling)")
        # Paths are kept absolute, so a run resumed from another directory finds its model.
        if self.model is not None and self.model not in PRESETS and Path(self.model).is_dir():
            object.__setattr__(self, "model", str(Path(self.model).resolve()))
        if self.init_from is not None:
            object.__setattr__(self, "init_from", str(Path(self.init_from).resolve()))


@dataclass(frozen=True)
class Data:
    """What the run reads: the stores, the sequences cut from them, how documents and conversations are packed."""

    data: list[str] | None = setting(None, "Token store from `burst prepare`, or several with their shares of the "
                                           "tokens: repeat --data [NAME=]STORE[:SHARE][:min_doc=TOKENS], e.g. --data "
                                           "code=stores/code:0.6 --data short=stores/web:0.4 (the shares sum to 1; "
                                           "min_doc keeps documents of at least that many tokens).",
                                     shown="the embedded stdlib corpus")
    seq_len: int = setting(1024, "Tokens per sequence, split over the --cp ranks.")
    batch_size: int = setting(1, "Sequences per data-parallel rank per micro-batch.")
    grad_accum: int = setting(1, "Micro-batches per optimizer step.")
    doc_mask: bool | None = setting(None, "Attend only within each packed document; positions restart at every "
                                          "document.", shown="on for instruction and preference stores (which need "
                                                             "it), else off")
    train_on_prompt: bool = setting(False, "Score every token of an instruction store's conversations (`burst prepare "
                                           "--chat`), prompts too, not only the answers.")
    long_conversations: str = setting("refuse", "A conversation longer than a sequence: refuse (the run, naming it), "
                                                "truncate (cut the prompt's start away, BOS kept) or split (into "
                                                "sequence-long pieces).")
    seed: int = setting(0, "Seed of the initial weights and the data order.")

    def check(self) -> None:
        from data.conversation_packing import check_policy
        from data.mixture import parse_mixture, resolved_sources

        at_least_one(self, "seq_len", "batch_size", "grad_accum")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed {self.seed} must be between 0 and 2^63 - 1 (it seeds numpy's and torch's "
                             f"generators)")
        check_policy(self.long_conversations)
        # Paths are kept absolute, so a run resumed from another directory finds its data.
        if self.data is not None:  # a single store may be given as a plain path
            sources = [self.data] if isinstance(self.data, str) else self.data
            object.__setattr__(self, "data", [str(spec) for spec in resolved_sources(parse_mixture(sources))])


@dataclass(frozen=True)
class Parallelism:
    """How the ranks share the work: sequence and data parallelism, BurstAttention, where and in what precision."""

    cp: int = setting(1, "Sequence-parallel degree: ranks that share one sequence (BurstAttention).")
    dp: int = setting(1, "Data-parallel degree: groups of --cp ranks that see different sequences.")
    # A run saves the resolved precision (config.toml, with the reason), so it resumes alike on other hardware.
    precision: str = setting("auto", "bf16: bf16 compute over float32 master weights (FSDP2 mixed precision on "
                                     "CUDA, else autocast); fp32: no autocast; auto: bf16 where the hardware computes "
                                     "in bf16 natively (CUDA, CPUs with AVX512-BF16 or AMX), fp32 elsewhere.")
    # A run records the device it ran on (config.toml); --resume resolves it again, and says so when it changed.
    device: str | None = device_setting()
    # Old config files' true/false read as selective/none (trainer/config.py `_upgraded`).
    activation_checkpointing: str = setting("none", "none; full: recompute each block's activations in backward; "
                                                    "selective: the same, but keep attention's output, so the ring "
                                                    "forward never runs twice.")
    compile: bool = setting(False, "Compile each transformer block with torch.compile (attention stays one opaque "
                                   "operator).")
    check_ranks_every: int = setting(100, "Steps between checks that the cp ranks' attention inputs agree (one "
                                          "all-gather per attention call); the first step always checks.")
    attention_backward: str = setting("auto", "BurstAttention backward communication: burst, ring or auto "
                                              "(fewer bytes).")
    attention_kernel: str = kernel_setting()
    cp_topology: str = setting("auto", "How BurstAttention's blocks travel between nodes: flat (one ring), two-level "
                                       "(a ring per node, one hop per round across), ulysses (all-to-all over heads "
                                       "in a node, ring across) or auto (flat on one node, else fewest bytes "
                                       "across nodes).")
    cp_layout: str = setting("auto", "How each sequence is cut into the cp ranks' shards: zigzag (2 x cp chunks), "
                                     "balanced (chosen per sequence from its documents so that every rank does the "
                                     "same attention work; needs --doc-mask) or auto (balanced with --doc-mask, "
                                     "else zigzag).")

    def check(self) -> None:
        from burst.checks import check_backward_mode
        from burst.kernels import check_kernel_name
        from burst.layout import check_layout
        from burst.topology import check_topology
        from runtime.device import check_device
        from runtime.precision import PRECISIONS

        at_least_one(self, "cp", "dp", "check_ranks_every")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.device is not None:
            check_device(self.device)
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(f"--activation-checkpointing {self.activation_checkpointing!r} is not one of "
                             f"{', '.join(ACTIVATION_CHECKPOINTING)}")
        check_backward_mode(self.attention_backward, "--attention-backward")
        check_kernel_name(self.attention_kernel, "--attention-kernel")
        check_topology(self.cp_topology, "--cp-topology")
        if self.cp_layout != "auto":
            check_layout(self.cp_layout, "--cp-layout")

    @property
    def world_size(self) -> int:
        return self.cp * self.dp


@dataclass(frozen=True)
class Optimizer:
    """AdamW and its learning-rate schedule. The settings left None take the model's training recipe
    (TrainConfig fills them: `resolve_recipe`)."""

    steps: int = setting(40, "Optimizer steps of the whole run (the LR schedule spans them).")
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

    def check(self) -> None:
        """The values given; TrainConfig checks the recipe's once filled in (`check_filled`)."""
        at_least_one(self, "steps")

    def check_filled(self) -> None:
        for name in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "max_grad_norm"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{flag(name)} {getattr(self, name)} must be a finite number")
        not_negative(self, "lr", "warmup", "weight_decay", "max_grad_norm")
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


@dataclass(frozen=True)
class Objective:
    """What training minimises: the next-token loss, or a preference objective and its settings."""

    objective: str = setting("nll", "What training minimises: nll (the next-token loss), or on a preference store "
                                    "(`burst prepare --preference`) dpo, ipo, simpo or orpo (TRL's formulas).")
    beta: float = setting(0.1, "A preference objective's beta: the KL strength of dpo and ipo, the reward scale of "
                               "simpo.")
    simpo_gamma: float = setting(0.5, "SimPO's target reward margin gamma.")
    orpo_lambda: float = setting(0.1, "ORPO's weight lambda of the odds-ratio term beside the chosen answer's NLL.")
    prefix_sharing: bool = setting(True, "Pack a preference pair's prompt once, both answers seeing it (each at the "
                                         "positions it would have after the prompt alone); --no-prefix-sharing packs "
                                         "prompt + chosen and prompt + rejected as two documents.")

    def check(self) -> None:
        from models.preference import OBJECTIVES, check_settings

        if self.objective not in ("nll", *OBJECTIVES):
            raise ValueError(f"--objective {self.objective!r} is not one of nll, {', '.join(OBJECTIVES)}")
        check_settings(self.objective, self.beta, self.simpo_gamma, self.orpo_lambda)


@dataclass(frozen=True)
class Lora:
    """A LoRA adapter trained on the frozen model (models/lora.py; docs/lora.md); rank 0: full fine-tuning."""

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

    def check(self) -> None:
        if self.init_adapter is not None:
            object.__setattr__(self, "init_adapter", str(Path(self.init_adapter).resolve()))
            adopted = adapter_settings(self.init_adapter)
            if self.lora_rank not in (0, adopted["lora_rank"]):
                raise ValueError(f"--lora-rank {self.lora_rank} differs from the rank {adopted['lora_rank']} of "
                                 f"--init-adapter {self.init_adapter}; drop --lora-rank (the adapter's is used)")
            for name, value in adopted.items():
                object.__setattr__(self, name, value)
        self.lora  # noqa: B018 -- checks the LoRA settings, each naming its flag

    @property
    def lora(self) -> LoRAConfig:
        """The LoRA section of the run (rank 0: full fine-tuning)."""
        from models.lora import LoRAConfig

        return LoRAConfig(rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                          targets=LoRAConfig.parse_targets(self.lora_targets),
                          train_embeddings_and_norms=self.train_embeddings_and_norms)


def adapter_settings(directory: str) -> dict[str, Any]:
    """The LoRA settings (Lora's fields) of the PEFT adapter in `directory`, for --init-adapter."""
    from models.lora import PEFT_CONFIG, config_from_peft
    from models.storage import read_json

    path = Path(directory) / PEFT_CONFIG
    if not path.is_file():
        raise ValueError(f"--init-adapter {directory} holds no {PEFT_CONFIG}: pass a PEFT LoRA adapter directory "
                         f"(`burst convert-checkpoint RUN DIR --to peft` writes one)")
    lora = config_from_peft(read_json(path), str(path))
    return {"lora_rank": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "lora_targets": ",".join(lora.targets), "train_embeddings_and_norms": lora.train_embeddings_and_norms}


@dataclass(frozen=True)
class Memory:
    """Memory at long sequences (docs/lora.md): none of these changes the result."""

    offload_activations: bool = setting(False, "Keep each block's saved input in pinned host memory between forward "
                                               "and backward (with --activation-checkpointing full or selective; "
                                               "none becomes full).")
    mlp_tile: int = setting(0, "Compute the MLP over slices of this many tokens, so its [tokens, ffn] intermediate "
                               "never spans the whole sequence (0: the whole sequence at once).")
    loss_tile: int = setting(1024, "Tokens whose logits the loss forms at once (the [tokens, vocab] slice).")

    def check(self) -> None:
        for name in ("mlp_tile", "loss_tile"):
            if getattr(self, name) < 0 or (name == "loss_tile" and self.loss_tile == 0):
                raise ValueError(f"{flag(name)} {getattr(self, name)} must be " + ("at least 0 (0: no slicing)" if
                                 name == "mlp_tile" else "at least 1 (1024 is usual)"))


@dataclass(frozen=True)
class Checkpointing:
    """When training checkpoints are written and how many are kept."""

    checkpoint_every: int = setting(0, "Steps between training checkpoints (0: only at the end and when stopped).")
    keep: int = setting(2, "Newest complete checkpoints to keep; older ones are deleted once a newer one is complete.")
    async_checkpoint: bool = setting(False, "Write checkpoints in the background while training goes on (at most "
                                            "one save in flight).")

    def check(self) -> None:
        not_negative(self, "checkpoint_every")
        if self.keep < 1:
            raise ValueError(f"--keep {self.keep} must be at least 1: a run keeps its newest checkpoint")


@dataclass(frozen=True)
class Run:
    """The run as a job: its directory, validation, logging, failures; and this invocation's --resume, --stop-after."""

    val_tokens: int | None = setting(None, "Held-out tokens (the data's validation split) scored at the start and the "
                                           "end of each invocation and every --val-every steps, rounded up to whole "
                                           "sequences and never more than the split holds (no token twice): the "
                                           "validation loss of metrics.jsonl and the summary; 0: none.",
                                     shown=f"{VAL_STEPS} steps' tokens, at least {MIN_VAL_TOKENS}: about 2/3 of a "
                                           f"step's time")
    val_every: int = setting(0, "Steps between validation losses during the run (0: at the start and end only).")
    out: str | None = setting(None, "Run directory (must be new, unless --resume).", shown="runs/DATE-TIME")
    log_every: int = setting(1, "Steps between logged metrics.")
    wandb: str | None = setting(None, "Also plot the metrics in Weights & Biases: offline (kept in OUT/wandb, "
                                      "uploaded later with wandb sync) or online; needs the wandb package. "
                                      "TensorBoard is used whenever it is installed.", shown="off")
    max_bad_steps: int = setting(3, "Non-finite steps in a row that end the run.")
    max_restarts: int = setting(0, "Times the launcher restarts the workers after one dies; they continue from the "
                                   "newest complete checkpoint. Under torchrun, pass torchrun's own --max-restarts.")
    timeout: float = setting(30.0, "Minutes a collective may wait for a rank (a hung or dead one) before the run "
                                   "ends with an error.")
    # This invocation only (not written to config.toml):
    resume: bool = setting(False, "Continue the run in --out from its newest complete checkpoint, with its "
                                  "config.toml (cp, dp may change).")
    stop_after: int | None = setting(None, "End this invocation after this step, with a checkpoint; the schedule "
                                           "stays --steps.", shown="--steps")

    def check(self) -> None:
        at_least_one(self, "log_every", "max_bad_steps")
        check_wandb(self.wandb)
        not_negative(self, "max_restarts", "val_every")
        if self.val_tokens is not None and self.val_tokens < 0:
            raise ValueError(f"--val-tokens {self.val_tokens} must not be negative (0: no validation)")
        if not MIN_TIMEOUT <= self.timeout <= MAX_TIMEOUT:
            raise ValueError(f"--timeout {self.timeout:g} minutes must be between {MIN_TIMEOUT:g} (a collective of a "
                             f"healthy step takes longer than a few seconds) and {MAX_TIMEOUT:g} (a week); 30 suits "
                             f"most runs, more for very long steps on a slow link")


@dataclass(frozen=True)
class Choice:
    """A setting's value in this run and why it has it ("" where the value needs no reason)."""

    value: Any
    reason: str = ""


def sequence_layout(requested: str, doc_mask: bool) -> Choice:
    """--cp-layout: as given, else balanced with --doc-mask (each sequence cut by its documents' work), else zigzag."""
    if requested != "auto":
        return Choice(requested)
    return Choice("balanced" if doc_mask else "zigzag", "with --doc-mask" if doc_mask else "without --doc-mask")


# The sections in the order of config.toml and `burst train --help`.
SECTIONS: tuple[type, ...] = (Model, Data, Parallelism, Optimizer, Objective, Lora, Memory, Checkpointing, Run)
