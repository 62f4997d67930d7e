"""`burst eval` on a preference store: how the model ranks the chosen over the rejected answer of validation pairs.

Every validation pair is packed as training packs them (a shared prompt; each answer's log-probability summed over
its tokens on every cp rank, then over the ranks) and scored once. Reported, as means over the pairs:

    logps/chosen, logps/rejected   the policy's summed log-probabilities of each answer (TRL's names)
    accuracy, margin               share of pairs whose chosen answer has the higher mean token log-probability,
                                   and the mean difference (reference-free: SimPO's and ORPO's implicit reward)
    rewards/accuracies, margins    with --reference: DPO's implicit rewards beta x (logp - ref_logp): the share of
                                   pairs whose chosen reward is the higher, and the mean difference
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from rich.table import Table

from burst.groups import group_rank_and_size
from data import SequenceLoader, TokenStore
from models import Transformer
from models.preference import summed
from runtime.process import all_reduce


@dataclass
class PreferenceResult:
    pairs: int
    logps_chosen: float
    logps_rejected: float
    accuracy: float  # chosen's mean token log-probability above rejected's
    margin: float  # mean of (chosen's - rejected's mean token log-probability)
    beta: float
    reward_accuracy: float | None = None  # against the reference; None without one
    reward_margin: float | None = None


@torch.no_grad()
def pair_logps(model: Transformer, val: TokenStore, seq_len: int, group: dist.ProcessGroup | None,
               long_conversations: str) -> tuple[np.ndarray, np.ndarray]:
    """float64 [pairs, 2] each: the summed log-probabilities and the token counts of every pair's chosen and
    rejected answer, every rank of `group` holding a zigzag shard of each sequence."""
    rank, size = group_rank_and_size(group)
    loader = SequenceLoader(val, seq_len, 1, cp_rank=rank, cp_size=size, reset_positions=True,
                            long_conversations=long_conversations)
    device = next(model.parameters()).device
    totals = torch.zeros(val.num_documents, 2, 2, dtype=torch.float64, device=device)  # [pair, side, logp|count]
    for _ in range(loader.streams[0].sequences_in_epoch(0)):  # every pair once
        batch = next(loader)
        tokens, labels, positions, answers = (t.to(device) for t in (batch.tokens, batch.labels, batch.positions,
                                                                     batch.answers))
        logps, counts = model.answer_logps(tokens, labels, answers, 2 * batch.num_pairs, positions,
                                           batch.documents, rope_length=batch.rope_length)
        logps, counts = summed(logps, lambda t: all_reduce(t, group)), all_reduce(counts, group)
        totals[batch.pair_documents.to(device)] = torch.stack([logps, counts], 1).double().view(-1, 2, 2)
    return totals[..., 0].cpu().numpy(), totals[..., 1].cpu().numpy()


def summarize(logps: np.ndarray, counts: np.ndarray, reference: np.ndarray | None, beta: float) -> PreferenceResult:
    """The means over the pairs of what the module docstring lists."""
    average = logps / counts
    result = PreferenceResult(pairs=len(logps), logps_chosen=float(logps[:, 0].mean()),
                              logps_rejected=float(logps[:, 1].mean()),
                              accuracy=float((average[:, 0] > average[:, 1]).mean()),
                              margin=float((average[:, 0] - average[:, 1]).mean()), beta=beta)
    if reference is not None:
        rewards = beta * (logps - reference)
        result.reward_accuracy = float((rewards[:, 0] > rewards[:, 1]).mean())
        result.reward_margin = float((rewards[:, 0] - rewards[:, 1]).mean())
    if not all(math.isfinite(x) for x in (result.logps_chosen, result.logps_rejected)):
        raise ValueError("the log-probabilities of the validation answers are not finite: the model diverged or its "
                         "weights are damaged; evaluate an earlier checkpoint")
    return result


def preference_table(result: PreferenceResult, checkpoint: object, data: object, seconds: float) -> Table:
    """The summary `burst eval` prints for a preference store."""
    table = Table(title=f"burst eval {checkpoint}: preference pairs", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("validation pairs", f"{result.pairs:,} of {data}")
    table.add_row("logps/chosen, logps/rejected", f"{result.logps_chosen:.4f}, {result.logps_rejected:.4f}")
    table.add_row("accuracy (mean token logp)", f"{result.accuracy:.1%}, margin {result.margin:.4f} nats/token")
    if result.reward_accuracy is not None:
        table.add_row(f"rewards/accuracies (beta {result.beta:g})",
                      f"{result.reward_accuracy:.1%}, rewards/margins {result.reward_margin:.4f}")
    table.add_row("time", f"{seconds:.1f} s")
    return table


def to_json(result: PreferenceResult, checkpoint: object, data: object, reference: object, seconds: float) -> dict:
    """The `--json` document of a preference store's evaluation."""
    return {"checkpoint": str(checkpoint), "data": str(data), "reference": None if reference is None else
            str(reference), "pairs": result.pairs, "logps/chosen": result.logps_chosen,
            "logps/rejected": result.logps_rejected, "accuracy": result.accuracy, "margin": result.margin,
            "beta": result.beta, "rewards/accuracies": result.reward_accuracy, "rewards/margins": result.reward_margin,
            "seconds": seconds}
