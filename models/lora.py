"""LoRA: low-rank adapters on a model's linear layers, applied from outside the model (Hu et al., 2021).

    lora = LoRAConfig(rank=16, alpha=32, targets=("q", "k", "v", "o"))
    apply_lora(model, lora)            # on the meta model, before parallelize: targets become LoRALinear
    with adapters_off(model): ...      # the frozen base alone (a preference objective's reference model)

A targeted linear layer keeps its `weight` (frozen, under its own name, so checkpoints and conversion read it as
before) and gains `lora_a` [rank, in] and `lora_b` [out, rank]:

    y = x W^T + dropout(x) A^T B^T * alpha / rank

with A drawn like PEFT's (Kaiming-uniform) and B zero, so a new adapter starts as the base model. Only the
adapters (and, with `train_embeddings_and_norms`, the embeddings and RMSNorm gains: LongLoRA's finding that
LoRA alone extends context poorly) require gradients; the rest never gets a gradient or optimizer state.

Hugging Face PEFT names the same tensors `base_model.model.<hf linear>.lora_A.weight` / `lora_B.weight`;
`peft_name` / `native_name` translate through models/convert.py's table.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

# --lora-targets' names -> the Transformer's linear layer in each block, and PEFT's (Hugging Face's) module name.
TARGETS = {"q": ("attention.wq", "q_proj"), "k": ("attention.wk", "k_proj"), "v": ("attention.wv", "v_proj"),
           "o": ("attention.wo", "o_proj"), "gate": ("feed_forward.w1", "gate_proj"),
           "up": ("feed_forward.w3", "up_proj"), "down": ("feed_forward.w2", "down_proj")}
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")
PEFT_PREFIX = "base_model.model."
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_TIED_HEAD = PEFT_PREFIX + "lm_head.weight"  # a tied model's trained embeddings, as PEFT's lm_head reads them
# The modules --train-embeddings-and-norms trains, as PEFT's modules_to_save names them.
PEFT_MODULES_TO_SAVE = ["embed_tokens", "input_layernorm", "post_attention_layernorm", "norm"]


@dataclass(frozen=True)
class LoRAConfig:
    """The adapter of a LoRA run; rank 0: no adapter (full fine-tuning)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    train_embeddings_and_norms: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 0:
            raise ValueError(f"--lora-rank {self.rank} must not be negative (0: no adapter; 8 to 64 are usual)")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"--lora-alpha {self.alpha:g} must be a finite number above 0 (often 2 x --lora-rank)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--lora-dropout {self.dropout:g} must be in [0, 1), e.g. 0.05")
        unknown = [name for name in self.targets if name not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"--lora-targets {','.join(self.targets)!r}: name each of {', '.join(TARGETS)} at most "
                             f"once, comma-separated, e.g. q,k,v,o")
        if self.train_embeddings_and_norms and not self.rank:
            raise ValueError("--train-embeddings-and-norms trains them beside a LoRA adapter: pass --lora-rank too "
                             "(full fine-tuning trains them already)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {**asdict(self), "targets": list(self.targets)}

    @classmethod
    def parse_targets(cls, text: str) -> tuple[str, ...]:
        """--lora-targets "q,k,v,o" -> ("q", "k", "v", "o")."""
        return tuple(name.strip() for name in text.split(",") if name.strip())


class LoRALinear(nn.Linear):
    """An nn.Linear whose frozen `weight` (and bias, where the layer has one: Qwen2's q/k/v) is adapted by
    `lora_b @ lora_a` (the module docstring)."""

    def __init__(self, in_features: int, out_features: int, lora: LoRAConfig, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.lora_a = nn.Parameter(torch.empty(lora.rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, lora.rank))
        self.scaling = lora.scaling
        self.dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
        self.adapter_on = True

    def reset_parameters(self) -> None:  # init_lora fills every value; meta tensors hold none
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # [..., out]
        if not self.adapter_on:
            return y
        down = F.linear(self.dropout(x), self.lora_a)  # [..., rank]
        return y + F.linear(down, self.lora_b) * self.scaling  # [..., out]


def target_modules(model: nn.Module, targets: tuple[str, ...]) -> Iterator[tuple[nn.Module, str, str]]:
    """(parent module, attribute, --lora-targets name) of each linear layer `targets` name, block by block."""
    for block in model.layers:
        for target in targets:
            path, _ = TARGETS[target]
            parent_path, attribute = path.rsplit(".", 1)
            yield block.get_submodule(parent_path), attribute, target


def apply_lora(model: nn.Module, lora: LoRAConfig) -> nn.Module:
    """Give `model`'s targeted linear layers adapters, in place (on any device, meta included), and freeze the
    rest: only adapters, and with lora.train_embeddings_and_norms the embeddings and norms, require gradients."""
    for parent, attribute, _ in target_modules(model, lora.targets):
        linear = getattr(parent, attribute)
        with torch.device(linear.weight.device):
            adapted = LoRALinear(linear.in_features, linear.out_features, lora, bias=linear.bias is not None)
        adapted.weight, adapted.bias = linear.weight, linear.bias
        setattr(parent, attribute, adapted)
    for name, param in model.named_parameters():
        param.requires_grad_(is_trainable(name, lora))
    return model


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def is_trainable(name: str, lora: LoRAConfig) -> bool:
    """Whether parameter `name` (the Transformer's own name) trains under `lora`."""
    if not lora.enabled or is_adapter(name):
        return True
    return lora.train_embeddings_and_norms and (name.startswith("tok_embeddings.") or name.endswith("norm.weight"))


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run `model` as its frozen base: every adapter skipped inside the block (no-op without adapters)."""
    adapted = [module for module in model.modules() if isinstance(module, LoRALinear)]
    for module in adapted:
        module.adapter_on = False
    try:
        yield
    finally:
        for module in adapted:
            module.adapter_on = True


def initial_adapter_rows(name: str, shape: tuple[int, ...], seed: int, rows: range) -> torch.Tensor:
    """Rows `rows` of adapter `name`'s initial value, float32: lora_b zero; lora_a Kaiming-uniform as PEFT draws
    it (bound 1 / sqrt(in_features)), each row from its own generator, so any shard draws its rows alone."""
    if name.endswith(".lora_b"):
        return torch.zeros(len(rows), *shape[1:])
    bound = 1 / math.sqrt(shape[1])
    values = torch.empty(len(rows), shape[1])
    for index, row in enumerate(rows):
        digest = hashlib.sha256(f"{seed}:{name}:{row}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        values[index].uniform_(-bound, bound, generator=generator)
    return values


# ---- names and merging ---------------------------------------------------------------------------------------

@dataclass
class Adapter:
    """A trained adapter, apart from its base model: LoRA's tensors, and with lora.train_embeddings_and_norms
    the embeddings and norms it trained, under native names (float32 or as saved)."""

    lora: LoRAConfig
    tensors: dict[str, torch.Tensor]


def base_name(adapter: str) -> str:
    """"layers.0.attention.wq.lora_a" -> "layers.0.attention.wq.weight": the weight an adapter tensor adapts."""
    return adapter.rsplit(".", 1)[0] + ".weight"


def peft_name(native: str, native_to_hf) -> str:
    """A native adapter or trained tensor's name in a PEFT adapter file; `native_to_hf` renames a weight."""
    if is_adapter(native):
        hf = native_to_hf(base_name(native))
        matrix = "lora_A" if native.endswith(".lora_a") else "lora_B"
        return PEFT_PREFIX + hf.removesuffix(".weight") + f".{matrix}.weight"
    return PEFT_PREFIX + native_to_hf(native)


def native_name(peft: str, hf_to_native) -> str:
    """The inverse of `peft_name`; `hf_to_native` renames a Hugging Face weight."""
    hf = peft.removeprefix(PEFT_PREFIX).replace(".modules_to_save.default", "")
    for matrix, suffix in (("lora_A", ".lora_a"), ("lora_B", ".lora_b")):
        if f".{matrix}." in hf:
            weight = hf.replace(f".{matrix}.default", f".{matrix}").replace(f".{matrix}.weight", ".weight")
            return hf_to_native(weight).removesuffix(".weight") + suffix
    return hf_to_native(hf)


def merged(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, lora: LoRAConfig) -> torch.Tensor:
    """W + B A alpha / rank in float32: the adapted layer as one plain weight. Float32 whatever W's dtype: a bf16
    run's frozen W is bf16 (trainer/parallelize.py), and rounding the sum to bf16 would take off much of a small
    update (bf16 keeps 8 bits of a weight; an adapter's change is often below its last)."""
    return weight.float() + (lora_b.float() @ lora_a.float()) * lora.scaling


def peft_config(lora: LoRAConfig, base_model: str | None, tied_embeddings: bool = False) -> dict:
    """PEFT's adapter_config.json for `lora` on a base model whose output matrix is (`tied_embeddings`) or is not its
    embedding matrix. A tied model's trained embeddings project back too: PEFT ties its lm_head to the copy it saves
    only with ensure_weight_tying (else the lm_head keeps the base's matrix and the logits are not the run's)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": [TARGETS[target][1] for target in lora.targets], "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": PEFT_MODULES_TO_SAVE if lora.train_embeddings_and_norms else None,
            "ensure_weight_tying": lora.train_embeddings_and_norms and tied_embeddings}


def config_from_peft(saved: dict, where: str) -> LoRAConfig:
    """The LoRAConfig of a PEFT adapter_config.json; refuses what burst's adapters cannot hold."""
    if saved.get("peft_type") != "LORA":
        raise ValueError(f"{where} is a {saved.get('peft_type')} adapter; burst loads LoRA adapters only")
    unsupported = [key for key in ("use_rslora", "use_dora", "fan_in_fan_out") if saved.get(key)]
    if saved.get("bias", "none") != "none":
        unsupported.append(f"bias={saved['bias']}")
    if saved.get("rank_pattern") or saved.get("alpha_pattern"):
        unsupported.append("rank_pattern/alpha_pattern")
    if unsupported:
        raise ValueError(f"{where} uses {', '.join(unsupported)}, which burst's LoRA does not implement; export a "
                         f"plain LoRA adapter")
    modules = saved.get("target_modules") or []
    if isinstance(modules, str):
        modules = [modules]
    by_hf = {hf: target for target, (_, hf) in TARGETS.items()}
    unknown = [module for module in modules if module not in by_hf]
    if unknown:
        raise ValueError(f"{where} targets {', '.join(unknown)}; burst adapts {', '.join(by_hf)}")
    targets = tuple(target for target in TARGETS if TARGETS[target][1] in modules)
    return LoRAConfig(rank=int(saved["r"]), alpha=float(saved["lora_alpha"]),
                      dropout=float(saved.get("lora_dropout") or 0.0), targets=targets,
                      train_embeddings_and_norms=bool(saved.get("modules_to_save")))
