"""AdamW with decoupled weight decay on the matrices only, and a warmup + cosine learning-rate schedule.

Both have state_dict()/load_state_dict() (torch's optimizer and LambdaLR), so a checkpoint holds them.
"""

from __future__ import annotations

import functools
import math

from torch import nn
from torch.optim import AdamW, Optimizer
from torch.optim.lr_scheduler import LambdaLR

from trainer.config import TrainConfig


def build_optimizer(model: nn.Module, config: TrainConfig) -> AdamW:
    """AdamW over the model's trainable parameters; norms (1-D weights) and embeddings are not decayed.

    Decay pulls weights towards zero: right for projection matrices, wrong for norm gains (whose
    neutral value is 1) and for embedding rows that rare tokens update seldom.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:  # LoRA's frozen weights: no gradient, no optimizer state
            continue
        (no_decay if param.ndim < 2 or "tok_embeddings" in name else decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2))


def lr_factor(step: int, warmup: int, steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based): linear warmup, then cosine to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)  # 0 after warmup .. 1 at the last step
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def build_schedule(optimizer: Optimizer, config: TrainConfig) -> LambdaLR:
    # A partial of a module-level function (not a lambda), so the schedule's state_dict pickles.
    return LambdaLR(optimizer, functools.partial(lr_factor, warmup=config.warmup, steps=config.steps,
                                                 min_ratio=config.min_lr_ratio))
