"""The model configuration: one typed dataclass and its named presets, each with its training recipe.

`debug` and `tiny` run on a laptop CPU (tests, smoke runs); the others carry the published
hyperparameters of the LLaMA-2/3 checkpoints, so a converted Hugging Face checkpoint and a
preset describe the same model, and the optimizer settings their family was published with
(each `Preset` carries its `TrainingRecipe`: `burst train --model NAME` starts from it; docs/training-defaults.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from models.rope import LinearRope, Llama3Rope, RopeScaling, check_theta, rope_scaling_from_dict

# The architectures burst reads and writes (models/hf_config.py maps each to its Hugging Face model_type).
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


@dataclass
class ModelConfig:
    """Hyperparameters of a decoder-only LLaMA-style transformer.

    `ffn_hidden_dim` is derived from dim, multiple_of and ffn_dim_multiplier (as Meta's LLaMA
    code does) only when it is None; `dataclasses.replace(config, dim=...)` therefore needs
    `ffn_hidden_dim=None` as well to re-derive it, and `head_dim=None` with another dim or n_heads. `max_seq_len`
    is the context length the model is meant for (written to exported configs); RoPE itself works at any position.
    `rope_scaling` is one of the types of models/rope.py, or None for plain RoPE.

    The families beside LLaMA are configuration (models/llama.py): `head_dim` (None: dim // n_heads), q/k/v and
    output-projection biases, per-head q/k norms, (1 + w) RMSNorms, sandwich norms, scaled embeddings, the MLP's
    activation, `query_pre_attn_scalar`, and sliding windows: `sliding_window` W on the layers `layer_types`
    names "sliding_attention" (None: on every layer), each a query at i seeing keys i - W < j <= i, with
    RoPE base `rope_local_theta` on those layers when it is set. `family` names the Hugging Face architecture the
    model is exported as (models/hf_config.py); the model itself never reads it. `bos_token_id`,
    `eos_token_id` (`pad_token_id`, `unk_token_id`) name the tokenizer's specials the model was trained with
    (exports write them); they
    do not change the model, so two configs that differ only there compare equal.
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: multi-head attention (n_kv_heads = n_heads)
    vocab_size: int = 32000
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    ffn_hidden_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    init_std: float = 0.02
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_id: int | list[int] | None = field(default=None, compare=False)  # a list: several stop tokens
    pad_token_id: int | None = field(default=None, compare=False)  # kept from a Hugging Face config, for exports
    unk_token_id: int | None = field(default=None, compare=False)
    family: str = "llama"  # one of FAMILIES
    head_dim: int | None = None  # None: dim // n_heads
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    activation: str = "silu"  # or "gelu_tanh"
    query_pre_attn_scalar: float | None = None  # None: head_dim
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer "sliding_attention" or "full_attention"; None: all sliding
    rope_local_theta: float | None = None  # the sliding layers' RoPE base; None: rope_theta and rope_scaling

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        self._check_families()
        sizes = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len")
        for name in (*sizes, "ffn_hidden_dim", "norm_eps", "rope_theta", "init_std", "ffn_dim_multiplier"):
            value, whole = getattr(self, name), name in sizes or name == "ffn_hidden_dim"
            if value is None and name in ("ffn_hidden_dim", "ffn_dim_multiplier"):
                continue
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
                raise ValueError(f"{name} = {value!r} must be a {'whole number' if whole else 'number'}")
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be at least 1")
        check_theta(self.rope_theta, "rope_theta =")
        if isinstance(self.rope_scaling, dict):  # a native config.json; before the other types, llama3's had no type
            self.rope_scaling = rope_scaling_from_dict(self.rope_scaling, "rope_scaling", default_type="llama3")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling = {self.rope_scaling!r} must be a rope scaling (models/rope.py) or None")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, list) and value and name == "eos_token_id" else [value]
            if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise ValueError(f"{name} = {value!r} must be a token id (a whole number >= 0)"
                                 + (" or a list of them" if name == "eos_token_id" else ""))
        if self.ffn_hidden_dim is None:
            hidden = int(2 * 4 * self.dim / 3)
            if self.ffn_dim_multiplier is not None:
                hidden = int(self.ffn_dim_multiplier * hidden)
            self.ffn_hidden_dim = self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)
        if self.head_dim is None and self.dim % self.n_heads != 0:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}; "
                             f"pick n_heads that divides dim, or give head_dim")
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}; "
                             f"grouped-query attention needs each kv head to serve the same number of heads")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim = {self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            self.rope_scaling.check_head_dim(self.head_dim)

    def _check_families(self) -> None:
        """The fields that tell the families apart, each of its type (before anything derives from them)."""
        if self.family not in FAMILIES:
            raise ValueError(f"family = {self.family!r} is not one burst knows; choose one of {', '.join(FAMILIES)}")
        for name in ("qkv_bias", "out_bias", "qk_norm", "norm_plus_one", "sandwich_norms", "scale_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} = {getattr(self, name)!r} must be true or false")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation = {self.activation!r} must be 'silu' or 'gelu_tanh'")
        for name in ("head_dim", "sliding_window"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} = {value!r} must be a whole number >= 1 (or null)")
        for name in ("query_pre_attn_scalar", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name} = {value!r} must be a number > 0 (or null)")
        if self.layer_types is not None:
            kinds = ("sliding_attention", "full_attention")
            if (not isinstance(self.layer_types, (list, tuple)) or len(self.layer_types) != self.n_layers
                    or any(kind not in kinds for kind in self.layer_types)):
                raise ValueError(f"layer_types = {self.layer_types!r} must list {self.n_layers} layers (n_layers), "
                                 f"each one of {kinds}")
            self.layer_types = list(self.layer_types)
            if self.sliding_window is None and "sliding_attention" in self.layer_types:
                raise ValueError("layer_types names sliding_attention layers but sliding_window is null; give the "
                                 "window")

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (a query at i sees keys i - W < j <= i), or None: causal over all."""
        if self.sliding_window is None:
            return None
        sliding = self.layer_types is None or self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Every layer's sliding window in order (None for a causal layer): what the balanced layout weighs
        (burst's `layout_windows`), the data loader and the attention alike."""
        return tuple(self.window(layer) for layer in range(self.n_layers))

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """A fresh copy of the preset `name` (see PRESETS)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name].model)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the content of a native config.json)."""
        fields = dataclasses.asdict(self)
        fields["rope_scaling"] = None if self.rope_scaling is None else self.rope_scaling.to_dict()
        return fields

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`; an unknown key is an error rather than silently dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; valid keys: {sorted(known)}")
        return cls(**fields)


@dataclass(frozen=True)
class TrainingRecipe:
    """The optimizer settings a model family was trained with: AdamW (beta1, beta2, weight_decay), a linear
    warmup to `lr` over `warmup` steps (or `warmup_ratio` of the run's steps), then a cosine decay to
    lr x min_lr_ratio, the global gradient norm clipped to max_grad_norm. `source` says where they come from."""

    lr: float
    warmup: int | None
    min_lr_ratio: float
    weight_decay: float
    beta1: float
    beta2: float
    max_grad_norm: float
    source: str
    warmup_ratio: float | None = None  # instead of `warmup`: a fraction of the run's steps

    def warmup_steps(self, steps: int) -> int:
        """The recipe's warmup for a run of `steps` steps, before any cut to fit the run."""
        return self.warmup if self.warmup is not None else math.ceil(self.warmup_ratio * steps)


LLAMA2_SOURCE = ("LLaMA 2 paper (arXiv 2307.09288, section 2.2 and Table 1): AdamW betas 0.9/0.95 (eps 1e-5), cosine "
                 "to 10% of the peak, 2,000 warmup steps, weight decay 0.1, gradient clipping 1.0, peak lr 3e-4 at "
                 "7B and 13B")
LLAMA3_SOURCE = ("Llama 3 paper (arXiv 2407.21783): peak lr 3e-4 for 8B (Table 3); 8,000 linear warmup steps and a "
                 "cosine to 1% of the peak (section 3.4.1, stated for 405B: 8e-5 to 8e-7; no 8B schedule is given, "
                 "so 8B decays to 3e-6); betas, weight decay and clipping are not stated there: LLaMA 2's "
                 "(0.9/0.95, 0.1, 1.0)")
LLAMA2 = TrainingRecipe(lr=3e-4, warmup=2000, min_lr_ratio=0.1, weight_decay=0.1, beta1=0.9, beta2=0.95,
                        max_grad_norm=1.0, source=LLAMA2_SOURCE)
LLAMA3 = TrainingRecipe(lr=3e-4, warmup=8000, min_lr_ratio=0.01, weight_decay=0.1, beta1=0.9, beta2=0.95,
                        max_grad_norm=1.0, source=LLAMA3_SOURCE)
# Not a published recipe: a high rate and a short warmup, so that a few dozen CPU steps of a small model learn.
QUICK = TrainingRecipe(lr=2e-3, warmup=5, min_lr_ratio=0.1, weight_decay=0.1, beta1=0.9, beta2=0.95,
                       max_grad_norm=1.0, source="burst's own for quick CPU runs of a small model, not a published "
                                             "recipe")

LLAMA32_ROPE_SCALING = Llama3Rope(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8192)
# Meta published no pretraining recipe for Llama 3.2 (its 1B and 3B were pruned from and distilled by 3.1 8B).
LLAMA32 = dataclasses.replace(LLAMA3, source="Meta published no pretraining recipe for Llama 3.2: the Llama 3.1 8B "
                                             "one. " + LLAMA3_SOURCE)


# Qwen, Mistral and Google published no pretraining optimizer settings for these models.
QWEN, MISTRAL, GEMMA3 = (dataclasses.replace(LLAMA3, source=f"{who} published no pretraining recipe for these models: "
                                                            f"LLaMA 3's. " + LLAMA3_SOURCE)
                         for who in ("Qwen", "Mistral AI", "Google"))


def gemma3(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_hidden_dim: int, window: int,
           max_seq_len: int, vocab_size: int = 262144, head_dim: int = 256, **rest: Any) -> ModelConfig:
    """A Gemma 3 text model: every sixth layer global, the others local with a RoPE base of 10,000."""
    return ModelConfig(family="gemma3", dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=head_dim, vocab_size=vocab_size, ffn_hidden_dim=ffn_hidden_dim, norm_eps=1e-6,
                       rope_theta=1e6, rope_local_theta=10000.0, max_seq_len=max_seq_len, tie_embeddings=True,
                       qk_norm=True, norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
                       activation="gelu_tanh", query_pre_attn_scalar=rest.pop("query_pre_attn_scalar", head_dim),
                       sliding_window=window, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                       layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)],
                       **rest)


@dataclass(frozen=True)
class Preset:
    """A named model: its shape and the training recipe its family was published with (`burst train --model NAME`
    starts from both)."""

    model: ModelConfig
    recipe: TrainingRecipe


PRESETS: dict[str, Preset] = {
    # GQA (4 heads share 2 kv heads) so that tests exercise it.
    "debug": Preset(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32,
                                max_seq_len=4096), QUICK),
    "tiny": Preset(ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=4096, multiple_of=256,
                               max_seq_len=131072), QUICK),
    "llama2-7b": Preset(ModelConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256,
                                    norm_eps=1e-5, max_seq_len=4096), LLAMA2),
    "llama2-13b": Preset(ModelConfig(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, multiple_of=256,
                                     norm_eps=1e-5, max_seq_len=4096), LLAMA2),
    "llama3-8b": Preset(ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                    multiple_of=1024, ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0,
                                    max_seq_len=8192), LLAMA3),
    "llama3.1-8b": Preset(ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                      multiple_of=1024, ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0,
                                      rope_scaling=Llama3Rope(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                              original_max_position_embeddings=8192),
                                      max_seq_len=131072), LLAMA3),
    # The small LLaMA-3.2 models people fine-tune for long context on few GPUs: tied embeddings and
    # the LLaMA-3 rope scaling stretched 32-fold (from 8K to 128K positions).
    "llama3.2-1b": Preset(ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                      ffn_hidden_dim=8192, norm_eps=1e-5, rope_theta=500000.0,
                                      rope_scaling=LLAMA32_ROPE_SCALING, max_seq_len=131072, tie_embeddings=True),
                          LLAMA32),
    "llama3.2-3b": Preset(ModelConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
                                      ffn_hidden_dim=8192, norm_eps=1e-5, rope_theta=500000.0,
                                      rope_scaling=LLAMA32_ROPE_SCALING, max_seq_len=131072, tie_embeddings=True),
                          LLAMA32),
    # Qwen2.5 (Qwen2 architecture): q/k/v biases, rope_theta 1e6, tied embeddings at the small sizes; its sliding
    # window is off in every published config.
    "qwen2.5-0.5b": Preset(ModelConfig(family="qwen2", dim=896, n_layers=24, n_heads=14, n_kv_heads=2,
                                       vocab_size=151936, ffn_hidden_dim=4864, norm_eps=1e-6, rope_theta=1e6,
                                       max_seq_len=32768, tie_embeddings=True, qkv_bias=True), QWEN),
    "qwen2.5-1.5b": Preset(ModelConfig(family="qwen2", dim=1536, n_layers=28, n_heads=12, n_kv_heads=2,
                                       vocab_size=151936, ffn_hidden_dim=8960, norm_eps=1e-6, rope_theta=1e6,
                                       max_seq_len=32768, tie_embeddings=True, qkv_bias=True), QWEN),
    "qwen2.5-7b": Preset(ModelConfig(family="qwen2", dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                                     vocab_size=152064, ffn_hidden_dim=18944, norm_eps=1e-6, rope_theta=1e6,
                                     max_seq_len=131072, qkv_bias=True), QWEN),
    # Qwen3: per-head q/k norms, head_dim 128 whatever the width (0.6B's 1024 / 16 heads would be 64).
    "qwen3-0.6b": Preset(ModelConfig(family="qwen3", dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                                     vocab_size=151936, ffn_hidden_dim=3072, norm_eps=1e-6, rope_theta=1e6,
                                     max_seq_len=40960, tie_embeddings=True, qk_norm=True), QWEN),
    "qwen3-4b": Preset(ModelConfig(family="qwen3", dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                                   vocab_size=151936, ffn_hidden_dim=9728, norm_eps=1e-6, rope_theta=1e6,
                                   max_seq_len=40960, tie_embeddings=True, qk_norm=True), QWEN),
    "qwen3-8b": Preset(ModelConfig(family="qwen3", dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                                   vocab_size=151936, ffn_hidden_dim=12288, norm_eps=1e-6, rope_theta=1e6,
                                   max_seq_len=40960, qk_norm=True), QWEN),
    # Mistral 7B v0.1 slides a 4,096-token window over every layer; v0.3 has none; Nemo an explicit head_dim.
    "mistral-7b-v0.1": Preset(ModelConfig(family="mistral", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                          vocab_size=32000, ffn_hidden_dim=14336, norm_eps=1e-5, rope_theta=10000.0,
                                          max_seq_len=32768, sliding_window=4096), MISTRAL),
    "mistral-7b-v0.3": Preset(ModelConfig(family="mistral", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                          vocab_size=32768, ffn_hidden_dim=14336, norm_eps=1e-5, rope_theta=1e6,
                                          max_seq_len=32768), MISTRAL),
    "mistral-nemo-12b": Preset(ModelConfig(family="mistral", dim=5120, n_layers=40, n_heads=32, n_kv_heads=8,
                                           head_dim=128, vocab_size=131072, ffn_hidden_dim=14336, norm_eps=1e-5,
                                           rope_theta=1e6, max_seq_len=131072), MISTRAL),
    # Gemma 3: five local layers (window 512 at 270M and 1B, 1,024 above) per global one; the global layers' RoPE
    # stretched 8-fold from 4B on; the text models of 4B and up have 64 more (image) tokens.
    "gemma3-270m": Preset(gemma3(dim=640, n_layers=18, n_heads=4, n_kv_heads=1, ffn_hidden_dim=2048, window=512,
                                 max_seq_len=32768), GEMMA3),
    "gemma3-1b": Preset(gemma3(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, ffn_hidden_dim=6912, window=512,
                               max_seq_len=32768), GEMMA3),
    "gemma3-4b": Preset(gemma3(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, ffn_hidden_dim=10240, window=1024,
                               max_seq_len=131072, vocab_size=262208, rope_scaling=LinearRope(factor=8.0)), GEMMA3),
    "gemma3-12b": Preset(gemma3(dim=3840, n_layers=48, n_heads=16, n_kv_heads=8, ffn_hidden_dim=15360, window=1024,
                                max_seq_len=131072, vocab_size=262208, rope_scaling=LinearRope(factor=8.0)), GEMMA3),
    "gemma3-27b": Preset(gemma3(dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, ffn_hidden_dim=21504, window=1024,
                                max_seq_len=131072, vocab_size=262208, rope_scaling=LinearRope(factor=8.0),
                                head_dim=128, query_pre_attn_scalar=168), GEMMA3),
}

# Fine-tuning a trained model (--model DIR, --init-from): a rate two orders below pretraining's, so that the
# weights move little from what they learnt.
FINE_TUNING = TrainingRecipe(
    lr=2e-5, warmup=None, warmup_ratio=0.03, min_lr_ratio=0.0, weight_decay=0.1, beta1=0.9, beta2=0.95,
    max_grad_norm=1.0,
    source="lr 2e-5 and weight decay 0.1: LLaMA 2-Chat's supervised fine-tuning (arXiv 2307.09288, section 3.1); "
           "warmup 3% of the steps and a cosine to 0: Stanford Alpaca's (github.com/tatsu-lab/stanford_alpaca); "
           "betas 0.9/0.95 and clipping 1.0: LLaMA 2's AdamW")
