"""Perplexity and loss by position on the validation split.

Sequences are read exactly as training reads them (`data.SequenceLoader`: documents packed
between BOS and EOS, causal attention over the whole sequence, global positions, no label
where the next token is a BOS), one sequence at a time, from the start of the split's packing
stream and never past its end, so no token is scored twice. Loss by position splits the
context into equal buckets of global position: a model that uses its context has lower loss
in later buckets.

Per-token losses are computed from the hidden states `chunk_size` rows at a time: the
[seq, vocab] logits never exist in full.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from data import SequenceLoader, TokenStore
from data.loader import IGNORE_INDEX
from evaluation.distributed import all_reduce_sum, rank_and_size
from models import Transformer


@dataclass
class PositionBucket:
    start: int  # first global position of the bucket
    end: int  # one past its last position
    mean_loss: float  # nan when no token in it was scored
    tokens: int  # scored tokens in the bucket, over all sequences


@dataclass
class PerplexityResult:
    perplexity: float  # exp(loss)
    loss: float  # token-weighted mean cross-entropy, nats
    tokens: int  # scored tokens
    sequences: int
    seq_len: int
    loss_by_position: list[PositionBucket]


def available_sequences(split: TokenStore, seq_len: int) -> int:
    """How many whole sequences of `seq_len` the split's packing stream holds (BOS + document + EOS each)."""
    stream_tokens = int(split.document_lengths.sum()) + 2 * split.num_documents
    return max(stream_tokens - 1, 0) // seq_len  # each sequence also needs the next token as its last label


def bucket_starts(seq_len: int, buckets: int) -> list[int]:
    """Start positions of `buckets` near-equal buckets over [0, seq_len); bucket i is [starts[i], starts[i + 1])."""
    return [-(-i * seq_len // buckets) for i in range(buckets)]


def token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 chunk_size: int = 1024) -> torch.Tensor:
    """Cross-entropy of each row: hidden [N, dim], weight [vocab, dim], labels [N] -> float32 [N], 0 where ignored."""
    weight32 = weight.float()
    valid = labels != IGNORE_INDEX
    safe_labels = torch.where(valid, labels, 0)
    losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [N]
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        logits = hidden[rows].float() @ weight32.t()  # [chunk, vocab]
        target = logits.gather(1, safe_labels[rows, None]).squeeze(1)  # [chunk]
        losses[rows] = torch.logsumexp(logits, dim=-1) - target
    return losses * valid


@torch.no_grad()
def evaluate_perplexity(model: Transformer, split: TokenStore, seq_len: int, num_sequences: int, buckets: int,
                        group: dist.ProcessGroup | None = None, chunk_size: int = 1024) -> PerplexityResult:
    """Perplexity and loss by position over the first `num_sequences` sequences of `split`.

    With a process group each rank scores its zigzag shard of every sequence (the model's
    attention must already be BurstAttention over `group`) and the sums are added across ranks.
    """
    rank, cp_size = rank_and_size(group)
    device = model.output_weight.device
    loader = SequenceLoader(split, seq_len, batch_size=1, cp_rank=rank, cp_size=cp_size)
    boundaries = torch.tensor(bucket_starts(seq_len, buckets)[1:], device=device)
    loss_sums = torch.zeros(buckets, dtype=torch.float64, device=device)  # [buckets]
    counts = torch.zeros(buckets, dtype=torch.int64, device=device)  # [buckets]
    for _ in range(num_sequences):
        batch = next(loader)
        tokens, labels, positions = (t.to(device) for t in (batch.tokens, batch.labels, batch.positions))
        hidden = model.hidden_states(tokens, positions)  # [1, seq // cp, dim]
        losses = token_losses(hidden.flatten(0, 1), model.output_weight, labels.flatten(), chunk_size)
        bucket = torch.bucketize(positions.flatten(), boundaries, right=True)  # [seq // cp]
        loss_sums.index_add_(0, bucket, losses.double())
        counts.index_add_(0, bucket, (labels.flatten() != IGNORE_INDEX).long())
    all_reduce_sum(loss_sums, group)
    all_reduce_sum(counts, group)
    starts = bucket_starts(seq_len, buckets) + [seq_len]
    by_position = [PositionBucket(start=starts[i], end=starts[i + 1], tokens=int(counts[i]),
                                  mean_loss=float(loss_sums[i] / counts[i]) if counts[i] else math.nan)
                   for i in range(buckets)]
    total = int(counts.sum())
    loss = float(loss_sums.sum() / total) if total else math.nan
    return PerplexityResult(perplexity=math.exp(loss), loss=loss, tokens=total, sequences=num_sequences,
                            seq_len=seq_len, loss_by_position=by_position)
