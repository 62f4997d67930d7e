"""How the next token is chosen from the logits: greedy, or sampled with temperature, top-k and top-p.

Every rank of a context-parallel group holds the same logits and a generator seeded alike, so every rank
draws the same token with no communication. A draw is one uniform number per row, compared with the
cumulative probabilities of the kept tokens in descending order: a difference of rounding between two
cp sizes changes the token only when the number falls within that rounding of a boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (top_k, top_p and seed then do nothing). top_k 0: every token; top_p 1: no nucleus."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature {self.temperature} must be a finite number >= 0 (0: greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p} must be in (0, 1] (1: no nucleus filtering)")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k} must be >= 0 (0: every token)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device) -> torch.Generator:
        """The random stream of one generation, the same on every rank."""
        return torch.Generator(device=device).manual_seed(self.seed)


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """logits [batch, vocab] float32 -> the chosen token of each row, int64 [batch]."""
    if sampling.greedy:
        return logits.argmax(-1)
    probs, order = torch.softmax(logits / sampling.temperature, dim=-1).sort(dim=-1, descending=True)
    if sampling.top_k:
        probs[:, sampling.top_k:] = 0
    if sampling.top_p < 1:
        before = probs.cumsum(-1) - probs  # the probability of the more likely tokens: keep while below top_p
        probs[before >= sampling.top_p] = 0
    cumulative = probs.cumsum(-1)
    drawn = torch.rand(logits.shape[0], 1, generator=generator, device=logits.device) * cumulative[:, -1:]
    choice = (cumulative <= drawn).sum(-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    return order.gather(-1, choice).squeeze(-1)
