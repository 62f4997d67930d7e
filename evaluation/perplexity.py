"""Perplexity and loss by position on the validation split, in one of two POSITION_MODES.

"packed": sequences are read exactly as training reads them (`data.SequenceLoader`: documents
packed between BOS and EOS, causal attention over the whole sequence, global positions, no
label where the next token is a BOS), one sequence at a time, from the start of the split's
packing stream and never past its end, so no token is scored twice. A position there mixes
depths into unrelated documents, so loss by position says little about long-context use.
An instruction store's conversations are packed as --doc-mask training packs them (whole, each
attending only to itself, positions restarting at each), and only their answers are scored: the
loss is the answers', and a position is the depth into a conversation.

"document": each sequence is the start of one validation document of at least seq_len tokens,
[BOS] + document, so position p is depth p into the document: a model that uses its context
has lower loss in later buckets.

Both modes cut every sequence into the rank's zigzag shard and share one scoring loop; loss by
position splits the context into equal buckets of position.

Per-token losses are computed from the hidden states `chunk_size` rows at a time: the
[seq, vocab] logits never exist in full.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from burst.documents import Documents
from burst.groups import group_rank_and_size
from burst.layout import shard_for_rank
from data import SequenceLoader, TokenStore
from data.conversation_packing import ConversationStream
from data.loader import IGNORE_INDEX
from models import Transformer, token_losses
from runtime.process import all_reduce

MAX_LOG_FLOAT = math.log(sys.float_info.max)


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
    positions: str  # a key of POSITION_MODES: what a position is
    loss_by_position: list[PositionBucket]
    answers_only: bool = False  # an instruction store's: only the answers scored, a position the depth into one


class Shard(NamedTuple):
    """One sequence's zigzag shard on this rank."""

    tokens: torch.Tensor  # int64 [1, seq_len // cp]
    labels: torch.Tensor  # int64 [1, seq_len // cp]
    positions: torch.Tensor  # int64 [1, seq_len // cp]
    documents: Documents | None  # the documents attention keeps apart (conversations); None: causal
    rope_length: int  # the length a length-dependent RoPE is computed for, as training computes it


def available_sequences(split: TokenStore, seq_len: int, long_conversations: str = "refuse") -> int:
    """How many whole sequences of `seq_len` the split's packing stream holds ([BOS] + document + EOS each), or its
    conversations pack into in one pass."""
    if split.is_conversations:
        return ConversationStream(split, seq_len, 0, policy=long_conversations).sequences_in_epoch(0)
    return max(split.packed_tokens - 1, 0) // seq_len  # each sequence also needs the next token as its last label


def long_documents(split: TokenStore, seq_len: int) -> np.ndarray:
    """Indices, in split order, of the split's documents that fill `seq_len` scored positions once framed: at
    least `seq_len` tokens after a BOS, `seq_len` + 1 without one (the first token has nothing to predict it)."""
    return np.flatnonzero(split.document_lengths >= seq_len + 1 - len(split.document_prefix))


def bucket_starts(seq_len: int, buckets: int) -> list[int]:
    """Start positions of `buckets` near-equal buckets over [0, seq_len); bucket i is [starts[i], starts[i + 1])."""
    return [-(-i * seq_len // buckets) for i in range(buckets)]


def packed_sequences(split: TokenStore, seq_len: int, count: int, cp_rank: int, cp_size: int,
                     long_conversations: str = "refuse") -> Iterator[Shard]:
    """This rank's shards of the first `count` sequences of the split's packing stream, as training reads them
    (conversations as --doc-mask training reads them)."""
    conversations = split.is_conversations
    loader = SequenceLoader(split, seq_len, batch_size=1, cp_rank=cp_rank, cp_size=cp_size,
                            reset_positions=conversations, long_conversations=long_conversations)
    for _ in range(count):
        batch = next(loader)
        yield Shard(batch.tokens, batch.labels, batch.positions, batch.documents if conversations else None,
                    batch.rope_length)


def document_sequences(split: TokenStore, seq_len: int, count: int, cp_rank: int, cp_size: int,
                       long_conversations: str = "refuse") -> Iterator[Shard]:
    """This rank's shards of the starts of the first `count` documents of at least `seq_len` tokens.

    The document is framed as its tokenizer frames a text, [BOS] + document (data/tokenizer.py): tokens are its
    first `seq_len` tokens and labels the `seq_len` after the first, so position p predicts the token after it
    from the p + 1 tokens up to it, as transformers scores `AutoTokenizer(text)`.
    """
    prefix = split.document_prefix
    for index in long_documents(split, seq_len)[:count]:
        document = split.document(int(index))[:seq_len + 1 - len(prefix)].astype(np.int64)
        framed = torch.cat([torch.tensor(prefix, dtype=torch.int64), torch.from_numpy(document)])  # [seq_len + 1]
        full = torch.stack([framed[:-1],  # tokens
                            framed[1:],  # labels
                            torch.arange(seq_len)])  # positions; [3, seq_len]
        tokens, labels, positions = shard_for_rank(full[:, None], cp_rank, cp_size, dim=2)  # each [1, seq // cp]
        yield Shard(tokens, labels, positions, None, seq_len)


POSITION_MODES = {"packed": packed_sequences, "document": document_sequences}


def bucket_losses(model: Transformer, shards: Iterable[Shard], boundaries: torch.Tensor,
                  chunk_size: int = 1024, progress: Callable[[int], None] | None = None) \
        -> tuple[torch.Tensor, torch.Tensor, int]:
    """Summed loss and scored tokens per position bucket over `shards`, and how many shards there were;
    `progress(n)` hears of each shard scored.

    boundaries: the start of every bucket but the first. Returns float64 [buckets] and
    int64 [buckets] sums of this rank only.
    """
    device = model.output_weight.device
    loss_sums = torch.zeros(len(boundaries) + 1, dtype=torch.float64, device=device)  # [buckets]
    counts = torch.zeros(len(boundaries) + 1, dtype=torch.int64, device=device)  # [buckets]
    sequences = 0
    for shard in shards:
        tokens, labels, positions = (t.to(device) for t in shard[:3])
        masked = {} if shard.documents is None else {"doc_boundaries": shard.documents}
        hidden = model.hidden_states(tokens, positions, rope_length=shard.rope_length, **masked)  # [1, seq // cp, dim]
        losses = token_losses(hidden.flatten(0, 1), model.output_weight, labels.flatten(), chunk_size, IGNORE_INDEX)
        bucket = torch.bucketize(positions.flatten(), boundaries, right=True)  # [seq // cp]
        loss_sums.index_add_(0, bucket, losses.double())
        counts.index_add_(0, bucket, (labels.flatten() != IGNORE_INDEX).long())
        sequences += 1
        if progress is not None:
            progress(sequences)
    return loss_sums, counts, sequences


@torch.no_grad()
def evaluate_perplexity(model: Transformer, split: TokenStore, seq_len: int, num_sequences: int, buckets: int,
                        group: dist.ProcessGroup | None = None, chunk_size: int = 1024,
                        positions: str = "packed", long_conversations: str = "refuse",
                        progress: Callable[[int], None] | None = None) -> PerplexityResult:
    """Perplexity and loss by position over the first `num_sequences` sequences of `split` in mode `positions`.

    In "document" mode fewer are scored when fewer documents are long enough; the result counts
    those scored. With a process group each rank scores its zigzag shard of every sequence (the
    model's attention must already be BurstAttention over `group`) and the sums are added across ranks.
    """
    if positions not in POSITION_MODES:
        raise ValueError(f"positions {positions!r} is not one of {', '.join(POSITION_MODES)}")
    rank, cp_size = group_rank_and_size(group)
    shards = POSITION_MODES[positions](split, seq_len, num_sequences, rank, cp_size, long_conversations)
    starts = bucket_starts(seq_len, buckets) + [seq_len]
    boundaries = torch.tensor(starts[1:-1], device=model.output_weight.device)
    loss_sums, counts, sequences = bucket_losses(model, shards, boundaries, chunk_size, progress)
    all_reduce(loss_sums, group)
    all_reduce(counts, group)
    by_position = [PositionBucket(start=starts[i], end=starts[i + 1], tokens=int(counts[i]),
                                  mean_loss=float(loss_sums[i] / counts[i]) if counts[i] else math.nan)
                   for i in range(buckets)]
    total = int(counts.sum())
    loss = float(loss_sums.sum() / total) if total else math.nan
    perplexity = math.exp(loss) if loss < MAX_LOG_FLOAT else math.inf  # exp overflows past e^709.78
    return PerplexityResult(perplexity=perplexity, loss=loss, tokens=total, sequences=sequences,
                            seq_len=seq_len, positions=positions, loss_by_position=by_position,
                            answers_only=split.is_conversations)
