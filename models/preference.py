"""Preference objectives over packed pairs: each answer's summed log-probability, then DPO, IPO, SimPO or ORPO.

For a pair (prompt x, chosen y_w, rejected y_l), logp(y) is the SUM over the answer's tokens of
log pi(token | everything before it) and ref_logp(y) the same under the frozen reference model; avg(y) is
logp(y) / tokens(y). The per-pair losses are TRL's:

    dpo    -log sigmoid(beta * ((logp(y_w) - ref_logp(y_w)) - (logp(y_l) - ref_logp(y_l))))
    ipo    (delta_avg - 1 / (2 beta))^2, delta_avg the same difference of log-ratios, each divided by its tokens
    simpo  -log sigmoid(beta * (avg(y_w) - avg(y_l)) - gamma)
    orpo   nll + lambda * -log sigmoid(log_odds(y_w) - log_odds(y_l)), log_odds(y) = avg(y) - log(1 - exp(avg(y)));
           nll is TRL's: the mean token loss over ALL the chosen tokens of the batch (not a mean of per-pair
           means), so each pair carries -logp(y_w) / (the batch's chosen tokens per pair)

and the implicit rewards TRL logs: beta times the log-ratio (dpo; ipo: the length-averaged one), beta times the
averaged log-probability (simpo, orpo). The model knows nothing of ranks: under sequence parallelism each rank
holds part of an answer's tokens, so `answer_logps` gives this rank's partial sums and counts, and the caller
sums them over the cp group (before any nonlinearity: `summed`, given the group's all-reduce) and then calls
`pair_losses`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.loss import chunked_token_losses

OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
NEEDS_REFERENCE = ("dpo", "ipo")


@dataclass
class PairLosses:
    """Per-pair values, each float [pairs]."""

    losses: torch.Tensor
    rewards_chosen: torch.Tensor
    rewards_rejected: torch.Tensor


def answer_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, answers: torch.Tensor,
                 num_answers: int, chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's summed label log-probability and its scored tokens, over this shard's labels.

    hidden [batch, seq, dim], weight [vocab, dim], labels [batch, seq] (-100: not scored), answers [batch, seq]
    (the answer each label belongs to, -1 none) -> (logps float32 [num_answers], differentiable; counts float32
    [num_answers]).
    """
    token_logps = -chunked_token_losses(hidden.flatten(0, 1), weight, labels.flatten(), chunk_size)  # [N]
    index = answers.flatten()
    mine = index >= 0
    logps = torch.zeros(num_answers, dtype=torch.float32, device=hidden.device).index_add(
        0, index[mine], token_logps[mine])
    counts = torch.zeros(num_answers, dtype=torch.float32, device=hidden.device).index_add(
        0, index[mine], torch.ones_like(token_logps[mine]))
    return logps, counts


def summed(local: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The sum of `local` over the ranks `reduce` (an in-place all-reduce) spans, its gradient flowing back to this
    rank's own part: what a nonlinearity of whole answers needs under sequence parallelism."""
    total = reduce(local.detach().clone())
    return local + (total - local.detach())


def pair_losses(objective: str, logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None, *,
                beta: float, simpo_gamma: float = 0.5, orpo_lambda: float = 0.1,
                chosen_tokens_per_pair: float | None = None) -> PairLosses:
    """The per-pair losses and rewards of `objective` from each answer's WHOLE logp and token count; their mean
    over the batch's pairs is the batch's loss.

    logps, counts [2 x pairs] (chosen, rejected of pair 0, then of pair 1, ...); reference float [pairs, 2]
    (the reference's logps of chosen and rejected; dpo and ipo only); chosen_tokens_per_pair: orpo's NLL
    denominator, the whole batch's chosen tokens over its pairs (every rank's, every micro-batch's), by default
    these pairs'.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    chosen, rejected = logps.view(-1, 2).unbind(1)  # [pairs] each
    chosen_tokens, rejected_tokens = counts.view(-1, 2).unbind(1)
    if objective in NEEDS_REFERENCE:
        if reference is None:
            raise ValueError(f"--objective {objective} needs the reference model's log-probabilities")
        reference = reference.to(logps)
        chosen_ratio, rejected_ratio = chosen - reference[:, 0], rejected - reference[:, 1]
        if objective == "ipo":
            chosen_ratio, rejected_ratio = chosen_ratio / chosen_tokens, rejected_ratio / rejected_tokens
            losses = (chosen_ratio - rejected_ratio - 1 / (2 * beta)) ** 2
        else:
            losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
        return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
    chosen_avg, rejected_avg = chosen / chosen_tokens, rejected / rejected_tokens
    if objective == "simpo":
        losses = -F.logsigmoid(beta * (chosen_avg - rejected_avg) - simpo_gamma)
    else:
        log_odds = (chosen_avg - rejected_avg) - (torch.log1p(-torch.exp(chosen_avg)) -
                                                 torch.log1p(-torch.exp(rejected_avg)))
        per_pair = float(chosen_tokens.sum()) / len(chosen) if chosen_tokens_per_pair is None \
            else chosen_tokens_per_pair
        losses = -chosen / per_pair - orpo_lambda * F.logsigmoid(log_odds)
    return PairLosses(losses, beta * chosen_avg.detach(), beta * rejected_avg.detach())
