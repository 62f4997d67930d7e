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

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.loss import chunked_token_losses

OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
NEEDS_REFERENCE = ("dpo", "ipo")
# Each objective's --beta that can train, and why: outside, every step is skipped (a gradient norm of inf) or
# no weight moves. orpo's beta only scales the rewards it logs.
BETA_RANGES = {
    "dpo": (1e-3, 1e3, "beta scales the log-ratio margin and its gradient: below 0.001 the gradient falls under "
                       "AdamW's epsilon and no weight moves, above 1,000 the sigmoid saturates and the gradient "
                       "overflows"),
    "ipo": (1e-3, 1e3, "IPO's target margin is 1/(2 beta) nats per token: below 0.001 it is above 500, which no "
                       "log-probability reaches, and its square overflows; above 1,000 it is 0"),
    "simpo": (1e-3, 1e3, "beta scales the averaged margin and its gradient: below 0.001 no weight moves, above "
                         "1,000 the sigmoid saturates and the gradient overflows"),
}
SIMPO_MARGIN_MAX = 100.0  # gamma / beta, nats per token: no model's averaged log-probabilities differ by more
ORPO_LAMBDA_MAX = 100.0


def check_settings(objective: str, beta: float, simpo_gamma: float, orpo_lambda: float) -> None:
    """Refuse, naming the flag, a preference setting that cannot train `objective` (each setting's sign and
    finiteness whatever the objective)."""
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"--beta {beta:g} must be a finite number above 0 (0.1 is TRL's default)")
    if not (math.isfinite(simpo_gamma) and simpo_gamma >= 0):
        raise ValueError(f"--simpo-gamma {simpo_gamma:g} must be a finite number, at least 0: SimPO's target reward "
                         f"margin (0.5 is TRL's default)")
    if not (math.isfinite(orpo_lambda) and orpo_lambda >= 0):
        raise ValueError(f"--orpo-lambda {orpo_lambda:g} must be a finite number, at least 0: the weight of ORPO's "
                         f"odds-ratio term (0.1 is TRL's default)")
    if objective in BETA_RANGES:
        low, high, why = BETA_RANGES[objective]
        if not low <= beta <= high:
            raise ValueError(f"--beta {beta:g} cannot train --objective {objective}: it must lie in [{low:g}, "
                             f"{high:g}] ({why})")
    if objective == "simpo" and simpo_gamma > SIMPO_MARGIN_MAX * beta:
        raise ValueError(f"--simpo-gamma {simpo_gamma:g} asks for a margin of gamma / beta = {simpo_gamma / beta:g} "
                         f"nats per token, above {SIMPO_MARGIN_MAX:g}, which no model's averaged log-probabilities "
                         f"reach: the loss stays about gamma; use at most {SIMPO_MARGIN_MAX:g} x --beta (SimPO uses "
                         f"gamma / beta of 0.3 to 1.6)")
    if objective == "orpo" and orpo_lambda > ORPO_LAMBDA_MAX:
        raise ValueError(f"--orpo-lambda {orpo_lambda:g} is above {ORPO_LAMBDA_MAX:g}: the chosen answer's NLL, which "
                         f"keeps it likely, would be lost beside the odds-ratio term (ORPO uses 0.1 to 1)")


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
