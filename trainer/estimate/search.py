"""Settings that fit: the layouts of the same GPUs (cp x dp), each recomputation mode, and the longest sequence.

`burst plan --search` ranks what fits by speed; the preflight names the first few when it refuses a run.
"""

from __future__ import annotations

import dataclasses

from models.config import ModelConfig
from trainer.config import TrainConfig
from trainer.estimate import fits
from trainer.estimate.hardware import Hardware

MODES = ("none", "selective", "full")  # --activation-checkpointing, from the least recomputation


def layouts(config: TrainConfig, gpus: int) -> list[TrainConfig]:
    """Every cp x dp = gpus that can cut --seq-len (2 x cp must divide it), under each recomputation mode."""
    return [dataclasses.replace(config, cp=cp, dp=gpus // cp, activation_checkpointing=mode)
            for cp in range(1, gpus + 1) if gpus % cp == 0 and config.seq_len % (2 * cp if cp > 1 else 1) == 0
            for mode in MODES]


def fitting(config: TrainConfig, model_config: ModelConfig, hardware: Hardware, gpus: int, *,
            local_ranks: int | None = None, forward_only: bool = False) -> list[TrainConfig]:
    """The configs of `layouts` that fit, in the order of `layouts` (fewest cp ranks, least recomputation first);
    forward_only (evaluation): --cp 1, 2, 4 or 8, a local process each."""
    if forward_only:  # evaluation: more context-parallel ranks (each a local process) split the sequence further
        candidates = [dataclasses.replace(config, cp=cp, dp=1) for cp in (1, 2, 4, 8)
                      if config.seq_len % (2 * cp if cp > 1 else 1) == 0]
        return [c for c in candidates if fits(c, model_config, hardware, forward_only=True)]
    return [c for c in layouts(config, gpus) if fits(c, model_config, hardware, local_ranks=local_ranks and min(
        local_ranks, c.world_size))]


def longest_sequence(config: TrainConfig, model_config: ModelConfig, hardware: Hardware, *,
                     local_ranks: int | None = None, forward_only: bool = False) -> int | None:
    """The longest --seq-len (a power of two times 1,024, at most 16M tokens) at which `config` fits; None: not
    even 1,024."""
    best, seq_len = None, 1024
    while seq_len <= 2**24:
        trial = dataclasses.replace(config, seq_len=seq_len)
        if not fits(trial, model_config, hardware, local_ranks=local_ranks, forward_only=forward_only):
            break
        best, seq_len = seq_len, seq_len * 2
    return best


def describe(config: TrainConfig, forward_only: bool = False) -> str:
    """The flags that set one candidate."""
    if forward_only:
        return f"--cp {config.cp}"
    return f"--cp {config.cp} --dp {config.dp} --activation-checkpointing {config.activation_checkpointing}"
