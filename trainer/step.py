"""One optimizer step: train_step() -> forward_backward() for each micro-batch.

The loss of a step is the mean over every scored token of the global batch (all dp and cp ranks,
all micro-batches). Each rank divides its summed token loss by the global token count, so its
gradient is its exact share of the true gradient, and FSDP sums the shares (see parallelize.py).
Dividing by the local count instead, as some trainers do, weighs ranks wrongly and reports a loss
cp times too small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor

from burst.module import BurstAttention, set_rank_checks
from data import Batch
from models import Transformer
from models.checkpoint import non_finite
from runtime.process import all_reduce
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.parallelize import end_forward_only, mark_documents_dynamic
from trainer.preference import preference_backward

NO_SCORED_TOKENS = "no scored token (every label of the step is a prompt, padding or a document's start)"
NON_FINITE = "non-finite loss or gradient norm"


@dataclass
class StepResult:
    loss: float | None  # global mean token loss; None when no token was scored
    grad_norm: float | None  # global gradient norm before clipping; None when no token was scored
    applied: bool  # False: the optimizer step was skipped, for `skip_reason`
    scored_tokens: int  # the tokens the loss is the mean over: every label of the global batch
    skip_reason: str | None = None  # NO_SCORED_TOKENS or NON_FINITE when not applied
    metrics: dict[str, float] = field(default_factory=dict)  # a preference objective's (trainer/preference.py)

    @classmethod
    def of(cls, loss: float, grad_norm: float, applied: bool, scored_tokens: int,
           metrics: dict[str, float] | None = None) -> StepResult:
        """The result of a step that scored tokens (`optimizer_step`'s loss, norm and decision)."""
        return cls(loss, grad_norm, applied, scored_tokens, None if applied else NON_FINITE, metrics or {})


def forward_backward(model: Transformer, batch: Batch, global_count: torch.Tensor, config: TrainConfig,
                     device: torch.device) -> torch.Tensor:
    """Backward of this micro-batch's share of the global mean loss; returns its summed token loss."""
    tokens, labels, positions = (t.to(device, non_blocking=True) for t in (batch.tokens, batch.labels,
                                                                           batch.positions))  # [b, seq / cp]
    documents = batch.documents if config.doc_mask else None  # over the full sequence, its layout chosen
    mark_documents_dynamic(config, documents)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16"):
        loss_sum, _ = model.loss(tokens, labels, positions, documents, chunk_size=config.loss_tile,
                                 rope_length=batch.rope_length)
    (loss_sum / global_count).backward()
    return loss_sum.detach()


def checks_ranks(step: int, first_step: int, every: int) -> bool:
    """Whether optimizer step `step` (1-based) compares the cp ranks' attention inputs: the first step of
    this invocation and every `every` steps. Every rank counts the same steps, so all check together."""
    return step == first_step or step % every == 0


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, micro_batches: list[Batch],
               config: TrainConfig, env: Distributed, check_ranks: bool = False) -> StepResult:
    """One optimizer step over `micro_batches` (grad_accum of them), unless the loss or gradient is not finite.

    check_ranks: compare the cp ranks' attention inputs in every attention call of this step (one
    all-gather and host read each; see `burst.burst_attn`). Only BurstAttention (cp > 1) has ranks to
    compare. A compiled model compares them in an eager forward without gradients before the step
    (`check_ranks_eagerly`), so that its graphs never hold the check: it compiles in its first step and
    never again.
    """
    check_ranks = check_ranks and any(isinstance(module, BurstAttention) for module in model.modules())
    if check_ranks and config.compile:
        check_ranks_eagerly(model, micro_batches[0], config, env.device)
        check_ranks = False
    set_rank_checks(model, check_ranks)
    if config.objective != "nll":
        loss, scored, metrics = preference_backward(model, micro_batches, config, env)
        return StepResult.of(*optimizer_step(model, optimizer, config, loss), scored, metrics)
    return _train_step(model, optimizer, micro_batches, config, env)


@torch.no_grad()
def check_ranks_eagerly(model: Transformer, batch: Batch, config: TrainConfig, device: torch.device) -> None:
    """Compare the cp ranks' attention inputs of `batch` (the documents the step attends with) in one eager forward
    without gradients: a compiled step then runs its graphs as they are (a check inside them would be a guard,
    and a recompile when it is turned off again). Costs a forward at each checked step (every
    --check-ranks-every)."""
    set_rank_checks(model, True)
    tokens, labels, positions = (t.to(device) for t in (batch.tokens, batch.labels, batch.positions))
    documents = batch.documents if config.doc_mask else None  # with what each sees, as the step attends
    with torch.compiler.set_stance("force_eager"), \
            torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16"):
        model.loss(tokens, labels, positions, documents, rope_length=batch.rope_length)
    end_forward_only(model)  # FSDP's per-iteration state of a forward without backward


def _train_step(model: Transformer, optimizer: torch.optim.Optimizer, micro_batches: list[Batch],
                config: TrainConfig, env: Distributed) -> StepResult:
    # Known before any backward, so every micro-batch is scaled by the step's global token count.
    scored = all_reduce(torch.tensor(float(sum(b.num_tokens for b in micro_batches)), device=env.device))
    if scored.item() == 0:
        # A step of conversations may score none (all prompts and padding): it has no loss, and AdamW would still
        # move the weights (its moments' momentum, weight decay). Every rank sees the same count: all skip it.
        return StepResult(None, None, False, 0, NO_SCORED_TOKENS)
    loss_sum = torch.zeros((), device=env.device)
    for batch in micro_batches:
        loss_sum += forward_backward(model, batch, scored, config, env.device)
    loss = all_reduce(loss_sum) / scored
    return StepResult.of(*optimizer_step(model, optimizer, config, loss), int(scored.item()))


def optimizer_step(model: Transformer, optimizer: torch.optim.Optimizer, config: TrainConfig,
                   loss: torch.Tensor) -> tuple[float, float, bool]:
    """Clip the gradients and step, unless the loss or the gradient norm is not finite; (loss, norm, applied)."""
    max_norm = config.max_grad_norm or math.inf  # 0: no clipping, but still measure the norm
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # over all shards
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    # Every rank holds the same reduced loss and norm, so every rank takes the same decision.
    applied = bool(torch.isfinite(loss) and torch.isfinite(grad_norm))
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), grad_norm.item(), applied


def non_finite_weights(model: Transformer, env: Distributed) -> list[str]:
    """The names of the parameters holding a non-finite value on any rank (each rank checks its shards)."""
    mine = [name.replace(_CHECKPOINT_PREFIX, "") for name in non_finite(
        (name, (param.to_local() if isinstance(param, DTensor) else param).detach())
        for name, param in model.named_parameters())]
    if env.mesh is None:
        return mine
    every: list[list[str]] = [[] for _ in range(env.world_size)]
    dist.all_gather_object(every, mine, group=env.cpu_group)
    return sorted({name for names in every for name in names})
