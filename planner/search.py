"""Settings that fit: the layouts of the same GPUs (cp x dp), each recomputation mode, and the longest sequence.

`burst plan --search` ranks what fits by speed; the fit check names the first few when it refuses a run.
"""

from __future__ import annotations

import dataclasses

from models.config import ModelConfig
from planner.estimate import fits
from planner.hardware import Hardware
from planner.shape import MODES, RunShape


def layouts(shape: RunShape, gpus: int) -> list[RunShape]:
    """Every cp x dp = gpus that can cut the sequence (2 x cp must divide it), under each recomputation mode."""
    return [dataclasses.replace(shape, cp=cp, dp=gpus // cp, activation_checkpointing=mode)
            for cp in range(1, gpus + 1) if gpus % cp == 0 and shape.seq_len % (2 * cp if cp > 1 else 1) == 0
            for mode in MODES]


def fitting(shape: RunShape, model_config: ModelConfig, hardware: Hardware, gpus: int, *,
            local_ranks: int | None = None) -> list[RunShape]:
    """The shapes of `layouts` that fit, in the order of `layouts` (fewest cp ranks, least recomputation first);
    forward only (evaluation): --cp 1, 2, 4 or 8, a local process each."""
    if shape.forward_only:  # evaluation: more context-parallel ranks (each a local process) split the sequence further
        candidates = [dataclasses.replace(shape, cp=cp, dp=1) for cp in (1, 2, 4, 8)
                      if shape.seq_len % (2 * cp if cp > 1 else 1) == 0]
        return [c for c in candidates if fits(c, model_config, hardware)]
    return [c for c in layouts(shape, gpus) if fits(c, model_config, hardware, local_ranks=local_ranks and min(
        local_ranks, c.world_size))]


def longest_sequence(shape: RunShape, model_config: ModelConfig, hardware: Hardware, *,
                     local_ranks: int | None = None) -> int | None:
    """The longest sequence (a power of two times 1,024, at most 16M tokens) at which `shape` fits; None: not even
    1,024."""
    best, seq_len = None, 1024
    while seq_len <= 2**24:
        if not fits(dataclasses.replace(shape, seq_len=seq_len), model_config, hardware, local_ranks=local_ranks):
            break
        best, seq_len = seq_len, seq_len * 2
    return best


MLP_TILE = 8192  # the tile the searches try (an [8K, ffn] intermediate: ALST's size of tile)


def memory_settings(shape: RunShape, hardware: Hardware) -> list[RunShape]:
    """`shape` as it is, then with a tiled MLP (MLP_TILE, unless it has a tile), then on GPUs with its recomputed
    blocks' inputs offloaded, then both: what a search tries, the least changed first, when `shape` does not fit
    (on a CPU the host is the device, and offloading holds nothing less)."""
    offload = dict.fromkeys((shape.offload_activations, shape.offload_activations or (
        hardware.device == "cuda" and shape.activation_checkpointing != "none")))
    tiles = dict.fromkeys((shape.mlp_tile, shape.mlp_tile or MLP_TILE))
    return [dataclasses.replace(shape, offload_activations=offloaded, mlp_tile=tile)
            for offloaded in offload for tile in tiles]


def longest_settings(shape: RunShape, model_config: ModelConfig, hardware: Hardware, gpus: int, *,
                     local_ranks: int | None = None) -> tuple[int, RunShape] | None:
    """The longest sequence (`longest_sequence`'s powers of two) any setting of `gpus` ranks fits, and that setting:
    cp x dp, selective or full recomputation, each with `memory_settings` (the shape's own --offload-activations and
    --mlp-tile, and beside them a tiled MLP and, on GPUs, offloaded activations); of equal lengths the first of that
    order (nothing offloaded or tiled, least recomputation, fewest cp ranks). None: not even 1,024 tokens fit."""
    variants = [(setting.offload_activations, setting.mlp_tile)
                for setting in memory_settings(dataclasses.replace(shape, activation_checkpointing="full"), hardware)]
    candidates = [dataclasses.replace(shape, cp=cp, dp=gpus // cp, activation_checkpointing=mode,
                                      offload_activations=offloaded, mlp_tile=tile)
                  for offloaded, tile in variants
                  for mode in ("selective", "full") for cp in range(1, gpus + 1) if gpus % cp == 0]
    best = None
    for candidate in candidates:
        length = longest_sequence(candidate, model_config, hardware, local_ranks=local_ranks)
        if length is not None and (best is None or length > best[0]):
            best = (length, dataclasses.replace(candidate, seq_len=length))
    return best
