"""Initial weights that do not depend on how the model is sharded.

Each parameter, flattened in row-major order, is drawn in pieces of PIECE elements, every piece from
its own generator seeded by (seed, parameter name, piece index). Any rows of a parameter can
therefore be drawn alone, and come out the same as the same rows of the whole tensor:

    initial_rows(config, "layers.0.attention.wq.weight", (4096, 4096), seed=0, rows=range(0, 2048))

A rank of a sharded run draws only the rows of its shard (and at most one piece on either side), so
no rank ever builds the whole model, and the same seed gives the same weights on any layout.

The rule (which distribution for which parameter) is the model's: embeddings and linear weights ~
normal(0, init_std); the projections that write into the residual stream (attention.wo,
feed_forward.w2) use init_std / sqrt(2 * n_layers) so the residual variance does not grow with depth
(GPT-2); RMSNorm weights are the identity (1, or 0 for Gemma's (1 + w) norms); biases are 0.
"""

from __future__ import annotations

import hashlib
import math

import torch

from models.config import ModelConfig

PIECE = 2**20  # elements per independently seeded piece (4 MiB of float32)


def constant(config: ModelConfig, name: str) -> float | None:
    """The value every element of parameter `name` starts at, or None: it is drawn (init_std)."""
    if name.endswith("norm.weight"):
        return 0.0 if config.norm_plus_one else 1.0
    return 0.0 if name.endswith(".bias") else None


def init_std(config: ModelConfig, name: str) -> float | None:
    """The standard deviation of parameter `name`'s normal initialisation; None: it starts at a `constant`."""
    if constant(config, name) is not None:
        return None
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        return config.init_std / math.sqrt(2 * config.n_layers)
    return config.init_std


def piece_seed(seed: int, name: str, index: int) -> int:
    """A 63-bit seed for piece `index` of parameter `name`: a hash, so nearby seeds give unrelated pieces."""
    digest = hashlib.sha256(f"{seed}:{name}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_rows(config: ModelConfig, name: str, shape: tuple[int, ...], seed: int, rows: range) -> torch.Tensor:
    """Rows `rows` (along dim 0) of parameter `name`'s initial value, float32 on the CPU:
    [len(rows), *shape[1:]], equal to those rows of the whole parameter drawn at once."""
    std = init_std(config, name)
    row_numel = math.prod(shape[1:])
    if std is None:
        return torch.full((len(rows), *shape[1:]), constant(config, name))
    start, stop = rows.start * row_numel, rows.stop * row_numel  # the flattened elements wanted
    total = math.prod(shape)
    values = torch.empty(stop - start)
    if start == stop:  # a rank past the end of a parameter with fewer rows than ranks
        return values.view(0, *shape[1:])
    for index in range(start // PIECE, -(-stop // PIECE)):
        piece_start, piece_stop = index * PIECE, min((index + 1) * PIECE, total)
        generator = torch.Generator().manual_seed(piece_seed(seed, name, index))
        piece = torch.empty(piece_stop - piece_start).normal_(0.0, std, generator=generator)
        lo, hi = max(start, piece_start), min(stop, piece_stop)
        values[lo - start:hi - start] = piece[lo - piece_start:hi - piece_start]
    return values.view(len(rows), *shape[1:])
