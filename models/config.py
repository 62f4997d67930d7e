"""The model configuration: one typed dataclass and its named presets.

`debug` and `tiny` run on a laptop CPU (tests, smoke runs); the others carry the published
hyperparameters of the LLaMA-2/3 checkpoints, so a converted Hugging Face checkpoint and a
preset describe the same model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from models.rope import Llama3Rope, RopeScaling, check_theta, rope_scaling_from_dict


@dataclass
class ModelConfig:
    """Hyperparameters of a decoder-only LLaMA-style transformer.

    `ffn_hidden_dim` is derived from dim, multiple_of and ffn_dim_multiplier (as Meta's LLaMA
    code does) only when it is None; `dataclasses.replace(config, dim=...)` therefore needs
    `ffn_hidden_dim=None` as well to re-derive it. `max_seq_len` is the context length the
    model is meant for (written to exported configs); RoPE itself works at any position.
    `rope_scaling` is one of the types of models/rope.py, or None for plain RoPE. `bos_token_id`,
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

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
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
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}; "
                             f"pick n_heads that divides dim")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}; "
                             f"grouped-query attention needs each kv head to serve the same number of heads")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim = dim / n_heads = {self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            self.rope_scaling.check_head_dim(self.head_dim)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """A fresh copy of the preset `name` (see PRESETS)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name])

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


LLAMA32_ROPE_SCALING = Llama3Rope(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8192)

PRESETS: dict[str, ModelConfig] = {
    # GQA (4 heads share 2 kv heads) so that tests exercise it.
    "debug": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32,
                         max_seq_len=4096),
    "tiny": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=4096, multiple_of=256,
                        max_seq_len=131072),
    "llama2-7b": ModelConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256,
                             norm_eps=1e-5, max_seq_len=4096),
    "llama2-13b": ModelConfig(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, multiple_of=256,
                              norm_eps=1e-5, max_seq_len=4096),
    "llama3-8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                             ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192),
    "llama3.1-8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                               ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0,
                               rope_scaling=Llama3Rope(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                        original_max_position_embeddings=8192),
                               max_seq_len=131072),
    # The small LLaMA-3.2 models people fine-tune for long context on few GPUs: tied embeddings and
    # the LLaMA-3 rope scaling stretched 32-fold (from 8K to 128K positions).
    "llama3.2-1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                               ffn_hidden_dim=8192, norm_eps=1e-5, rope_theta=500000.0,
                               rope_scaling=LLAMA32_ROPE_SCALING, max_seq_len=131072, tie_embeddings=True),
    "llama3.2-3b": ModelConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
                               ffn_hidden_dim=8192, norm_eps=1e-5, rope_theta=500000.0,
                               rope_scaling=LLAMA32_ROPE_SCALING, max_seq_len=131072, tie_embeddings=True),
}
