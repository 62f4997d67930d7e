"""The model configuration: one typed dataclass and its named presets.

`debug` and `tiny` run on a laptop CPU (tests, smoke runs); the others carry the published
hyperparameters of the LLaMA-2/3 checkpoints, so a converted Hugging Face checkpoint and a
preset describe the same model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """LLaMA-3.1 rotary frequency scaling: long wavelengths are stretched by `factor`.

    Wavelengths shorter than original_max_position_embeddings / high_freq_factor are kept,
    longer than original_max_position_embeddings / low_freq_factor are divided by `factor`,
    and the band in between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    """Hyperparameters of a decoder-only LLaMA-style transformer.

    `ffn_hidden_dim` is derived from dim, multiple_of and ffn_dim_multiplier (as Meta's LLaMA
    code does) only when it is None; `dataclasses.replace(config, dim=...)` therefore needs
    `ffn_hidden_dim=None` as well to re-derive it. `max_seq_len` is the context length the
    model is meant for (written to exported configs); RoPE itself works at any position.
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
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
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
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`; an unknown key is an error rather than silently dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; valid keys: {sorted(known)}")
        return cls(**fields)


LLAMA32_ROPE_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
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
                               rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
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
