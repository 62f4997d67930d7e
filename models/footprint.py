"""What a model is made of, counted without building it: parameters by part and FLOPs per token.

The counts follow models/checkpoint.py's `expected_shapes` (the shapes a checkpoint must have), so the
planner (planner/) and the model cannot disagree on what a block holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from models.checkpoint import expected_shapes
from models.config import ModelConfig


@dataclass(frozen=True)
class Footprint:
    """Parameter counts of one model."""

    parameters: int  # every parameter (a tied embedding once)
    block: int  # the largest transformer block's
    outer: int  # outside the blocks: embeddings, final norm, output head
    matmul: int  # those that multiply every token in forward: the blocks' matrices and the output head
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    windows: tuple[int | None, ...] = ()  # each layer's sliding window, None for a causal layer; (): all causal

    def layer_windows(self) -> dict[int | None, int]:
        """How many layers attend with each window (None: causal over the whole sequence)."""
        windows = self.windows or (None,) * self.layers
        return {window: windows.count(window) for window in dict.fromkeys(windows)}

    @property
    def block_width(self) -> int:
        """Values per token a block's forward writes at its widest layers: q, out, the two norms' input and output
        (6 x dim), k and v (2 x the key-value width) and the MLP's gate and up projections (2 x hidden)."""
        return 6 * self.dim + 2 * self.kv_heads * self.head_dim + 2 * self.ffn


_FOOTPRINTS: dict[str, Footprint] = {}  # by the config's repr: a search counts one model thousands of times


def footprint(model_config: ModelConfig) -> Footprint:
    """The parameter counts of `model_config` (counted once per process: building an 8B model on the meta device
    takes about a second)."""
    key = repr(model_config)
    if key not in _FOOTPRINTS:
        _FOOTPRINTS[key] = _count(model_config)
    return _FOOTPRINTS[key]


def _count(model_config: ModelConfig) -> Footprint:
    count = {name: math.prod(shape) for name, shape in expected_shapes(model_config).items()}
    blocks = [sum(n for name, n in count.items() if name.startswith(f"layers.{i}."))
              for i in range(model_config.n_layers)]
    outer = sum(n for name, n in count.items() if not name.startswith("layers."))
    matrices = sum(n for name, shape in expected_shapes(model_config).items()
                   if name.startswith("layers.") and len(shape) == 2 for n in [math.prod(shape)])
    head = model_config.vocab_size * model_config.dim  # the output projection, tied or not
    return Footprint(parameters=sum(count.values()), block=max(blocks), outer=outer, matmul=matrices + head,
                     dim=model_config.dim, layers=model_config.n_layers, heads=model_config.n_heads,
                     kv_heads=model_config.n_kv_heads, head_dim=model_config.head_dim,
                     ffn=model_config.ffn_hidden_dim, vocab=model_config.vocab_size,
                     windows=model_config.windows)


def matmul_flops_per_token(model: Footprint) -> int:
    """Forward + backward FLOPs of the matrices per token: 2 per multiply-add forward, twice that backward."""
    return 6 * model.matmul


def attention_flops(model: Footprint, pairs: int) -> int:
    """Forward FLOPs of attention over `pairs` visible (query, key) position pairs summed over the layers (each
    layer's under its own window): QK^T and PV, 2 FLOPs per multiply-add each, over every query head."""
    return 4 * pairs * model.heads * model.head_dim
