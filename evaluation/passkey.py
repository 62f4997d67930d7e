"""Passkey retrieval over a grid of context lengths x needle depths.

A sample is retrieved when greedy decoding after the question reproduces the passkey's tokens
exactly. That is scored in one forward pass: with the answer fed in (teacher forcing), greedy
decoding reproduces all answer tokens iff the argmax at every answer position is the answer
token, because greedy decoding follows the fed-in answer for as long as it agrees with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from data import Tokenizer, passkey_sample
from evaluation.distributed import shard_tokens
from models import Transformer
from runtime.process import all_reduce


@dataclass
class PasskeyCell:
    length: int  # tokens in each sample, answer included
    depth: float  # 0 = needle at the start of the filler, 1 = at its end
    trials: int
    retrieved: int

    @property
    def accuracy(self) -> float:
        return self.retrieved / self.trials


@dataclass
class PasskeyResult:
    lengths: list[int]
    depths: list[float]
    cells: list[PasskeyCell]  # lengths-major: cells[i * len(depths) + j] is (lengths[i], depths[j])

    def rows(self) -> list[list[PasskeyCell]]:
        """The cells as a grid: rows()[i][j] is (lengths[i], depths[j])."""
        width = len(self.depths)
        return [self.cells[i * width:(i + 1) * width] for i in range(len(self.lengths))]

    @property
    def accuracy(self) -> float:
        """Retrieved samples over all samples of the grid."""
        return sum(c.retrieved for c in self.cells) / sum(c.trials for c in self.cells)


class Answered(Protocol):
    """A sample with its answer at its end: a passkey's, or a conversation's (evaluation/qa.py)."""

    tokens: list[int]
    answer_ids: list[int]  # tokens[answer_start:answer_start + len(answer_ids)]
    answer_start: int


@torch.no_grad()
def greedy_answer(model: Transformer, sample: Answered, group: dist.ProcessGroup | None = None) -> list[int]:
    """The tokens greedy decoding puts at the answer positions, scored in one teacher-forced pass.

    With a process group each rank runs its zigzag shard (the model's attention must already be
    BurstAttention over `group`) and contributes the predictions at the positions it holds.
    """
    device = model.output_weight.device
    tokens, positions = shard_tokens(torch.tensor([sample.tokens], device=device), group)  # [1, L // cp], [L // cp]
    hidden = model.hidden_states(tokens, positions, rope_length=len(sample.tokens))[0]  # [L // cp, dim]
    # The logits at position p predict token p + 1, so the answer is read one position early.
    answer_offset = positions - (sample.answer_start - 1)  # [L // cp]
    held = (answer_offset >= 0) & (answer_offset < len(sample.answer_ids))
    predicted = torch.zeros(len(sample.answer_ids), dtype=torch.int64, device=device)  # [answer]
    predicted[answer_offset[held]] = (hidden[held].float() @ model.output_weight.float().t()).argmax(-1)
    return all_reduce(predicted, group).tolist()  # every answer position is held by exactly one rank


def evaluate_passkey(model: Transformer, tokenizer: Tokenizer, lengths: list[int], depths: list[float], trials: int,
                     group: dist.ProcessGroup | None = None, seed: int = 0,
                     progress: Callable[[int, int], None] | None = None) -> PasskeyResult:
    """Retrieval accuracy of every (length, depth) cell over `trials` samples with different passkeys.

    Trial t uses seed + t in every cell, so the cells differ only in length and depth. `progress(done, total)`
    hears of each sample answered.
    """
    cells, total = [], len(lengths) * len(depths) * trials
    for length in lengths:
        for depth in depths:
            retrieved = 0
            for trial in range(trials):
                sample = passkey_sample(tokenizer, length, depth, seed=seed + trial)
                retrieved += greedy_answer(model, sample, group) == sample.answer_ids
                if progress is not None:
                    progress((len(cells) * trials) + trial + 1, total)
            cells.append(PasskeyCell(length=length, depth=depth, trials=trials, retrieved=retrieved))
    return PasskeyResult(lengths=list(lengths), depths=list(depths), cells=cells)
