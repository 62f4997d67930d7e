"""The sequence-parallel loader: documents packed into long sequences, cut into each rank's shard.

The packing stream of an epoch is every document of the store in a seeded random order, each as
BOS + document + EOS; epoch e + 1 (a new order) follows epoch e without a gap. Sequence k of the
stream is stream[k * seq_len : k * seq_len + seq_len + 1], so consecutive sequences share one
token and every stream token is a label exactly once. A long document simply continues into
the next sequence.

At each step the next batch_size x dp_size sequences go to the data-parallel ranks, batch_size
each, in rank order; every sequence-parallel rank of a data-parallel rank builds the same
sequences and keeps its shard (`burst.shard_for_rank`: zigzag, or with cp_layout="balanced" each
sequence's balanced layout, chosen from its document boundaries), so no communication is needed.
The loader's state is one position in the stream: resuming continues with exactly the next tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from burst.layout import check_layout, check_sequence_length, shard_for_rank
from data.store import TokenStore

IGNORE_INDEX = -100  # label of a position whose next token is a document's BOS: nothing to learn there


@dataclass
class Batch:
    """One rank's share of a step: its sequences, cut to its sequence-parallel shard."""

    tokens: torch.Tensor  # int64 [batch, seq_len // cp_size], the rank's shard under the loader's cp_layout
    labels: torch.Tensor  # int64 [batch, seq_len // cp_size], next tokens; IGNORE_INDEX where the next is a BOS
    positions: torch.Tensor  # int64 [batch, seq_len // cp_size], global position ids of the shard's tokens
    doc_boundaries: list[torch.Tensor]  # per sequence, int64 cumulative document starts over the FULL sequence:
    #                                     [0, start_1, ..., seq_len]; a document starts at each BOS
    num_tokens: int  # labels != IGNORE_INDEX in this shard, for normalising the loss across ranks


class SequenceLoader:
    """Iterates forever over `Batch`es of `store` for one (data-parallel, sequence-parallel) rank.

    With `reset_positions`, position ids restart at 0 at every document start inside a sequence
    (a document continued from the previous sequence starts at 0 too), matching document masking.
    """

    def __init__(self, store: TokenStore, seq_len: int, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1,
                 cp_rank: int = 0, cp_size: int = 1, seed: int = 0, reset_positions: bool = False,
                 cp_layout: str = "zigzag") -> None:
        check_sequence_length(seq_len, cp_size)
        check_layout(cp_layout, "cp_layout")
        if batch_size < 1:
            raise ValueError(f"batch size {batch_size} must be at least 1")
        for name, rank, size in (("dp_rank", dp_rank, dp_size), ("cp_rank", cp_rank, cp_size)):
            if not 0 <= rank < size:
                raise ValueError(f"{name} {rank} is out of range for {name[:2]}_size {size}: use 0..{size - 1}")
        if store.num_documents == 0:
            raise ValueError(f"{store!r} has no documents to load; prepare a store with documents, or use "
                             f"another split (the validation split is empty when --val-fraction is 0)")
        self.store, self.seq_len, self.batch_size = store, seq_len, batch_size
        self.dp_rank, self.dp_size, self.cp_rank, self.cp_size = dp_rank, dp_size, cp_rank, cp_size
        self.seed, self.reset_positions, self.cp_layout = seed, reset_positions, cp_layout
        self._lengths = store.document_lengths + 2  # BOS + document + EOS, as packed
        self._epoch_tokens = int(self._lengths.sum())
        self._bos, self._eos = store.bos_id, store.eos_id
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.epoch = 0  # the stream position of the next step: epoch, and token offset inside that epoch
        self.position = 0

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_documents": self.store.num_documents}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_documents"):
            mine = self.seed if key == "seed" else self.store.num_documents
            if state[key] != mine:
                raise ValueError(f"loader state was saved with {key}={state[key]} but this loader has {mine}; "
                                 f"resume with the same data and seed, or start the data stream afresh")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        seq_len, rows = self.seq_len, self.batch_size
        first_row = self.dp_rank * rows * seq_len
        stream, starts = self._read(self.epoch, self.position + first_row, rows * seq_len + 1)
        self.epoch, self.position = self._normalize(self.epoch, self.position + rows * self.dp_size * seq_len)

        sequences = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)[::seq_len]  # [rows, seq_len + 1]
        is_start = np.zeros(rows * seq_len + 1, bool)
        is_start[starts] = True
        is_start = np.lib.stride_tricks.sliding_window_view(is_start, seq_len + 1)[::seq_len]
        boundaries = [np.unique(np.concatenate([[0], np.flatnonzero(row[:-1]), [seq_len]])) for row in is_start]
        full = np.empty((3, rows, seq_len), np.int64)  # tokens, labels, positions: sharded in one call
        full[0] = sequences[:, :-1]
        full[1] = np.where(is_start[:, 1:], IGNORE_INDEX, sequences[:, 1:])
        full[2] = np.arange(seq_len)
        if self.reset_positions:
            for row, b in enumerate(boundaries):
                full[2, row] -= np.repeat(b[:-1], np.diff(b))  # the start of each position's document
        tokens, labels, positions = shard_for_rank(torch.from_numpy(full), self.cp_rank, self.cp_size, dim=2,
                                                   layout=self.cp_layout, doc_boundaries=boundaries, batch_dim=1)
        return Batch(tokens=tokens, labels=labels, positions=positions,  # each [rows, seq_len // cp_size]
                     doc_boundaries=[torch.from_numpy(b.astype(np.int64)) for b in boundaries],
                     num_tokens=int((labels != IGNORE_INDEX).sum()))

    # -- the packing stream -----------------------------------------------------------------

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's document order and the stream offset where each packed document starts."""
        if epoch not in self._layouts:
            if len(self._layouts) > 2:  # iteration only moves forward; keep the current and the next epoch
                self._layouts.pop(min(self._layouts))
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self._lengths))
            starts = np.concatenate([[0], np.cumsum(self._lengths[order])])  # [num_documents + 1]
            self._layouts[epoch] = (order, starts)
        return self._layouts[epoch]

    def _normalize(self, epoch: int, position: int) -> tuple[int, int]:
        """(epoch, position) with position moved into its epoch (an epoch's length never changes)."""
        return epoch + position // self._epoch_tokens, position % self._epoch_tokens

    def _read(self, epoch: int, position: int, count: int) -> tuple[np.ndarray, list[int]]:
        """`count` stream tokens from (epoch, position) and the offsets in them where a document starts.

        Copies whole slices of the memory map: the Python loop runs once per document, not per token.
        """
        out = np.empty(count, np.int64)
        starts: list[int] = []
        epoch, position = self._normalize(epoch, position)
        order, doc_starts = self._layout(epoch)
        k = int(np.searchsorted(doc_starts, position, "right")) - 1  # packed document holding `position`
        filled = 0
        while filled < count:
            if k == len(order):
                epoch, k = epoch + 1, 0
                order, doc_starts = self._layout(epoch)
                position = 0
            begin = position - int(doc_starts[k])  # offset inside BOS + document + EOS
            take = min(count - filled, int(doc_starts[k + 1]) - position)
            self._copy_packed(int(order[k]), begin, out[filled:filled + take])
            if begin == 0:
                starts.append(filled)
            filled, position, k = filled + take, position + take, k + 1
        return out, starts

    def _copy_packed(self, document: int, begin: int, out: np.ndarray) -> None:
        """Write tokens [begin, begin + len(out)) of BOS + document + EOS into `out`."""
        tokens = self.store.document(document)
        end = begin + len(out)
        body_begin, body_end = max(begin, 1), min(end, len(tokens) + 1)  # the part inside the document
        if begin == 0:
            out[0] = self._bos
        out[body_begin - begin:body_end - begin] = tokens[body_begin - 1:body_end - 1]
        if end == len(tokens) + 2:
            out[-1] = self._eos
