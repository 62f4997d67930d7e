"""The sequence-parallel loader: documents packed into long sequences, cut into each rank's shard.

Each source (one token store, or several mixed by share: data/mixture.py) has its own packing
stream: every document of the source in a seeded random order, each as BOS + document + EOS (document + EOS
when its tokenizer puts no BOS before a text, as SmolLM2's: `TokenStore.bos_first`); epoch
e + 1 (a new order) follows epoch e without a gap. Sequence k of a stream is
stream[k * seq_len : k * seq_len + seq_len + 1], so consecutive sequences share one token and every
stream token is a label exactly once. A long document simply continues into the next sequence.
An instruction store's conversations are packed whole instead, never cut across two sequences, the rest
of a sequence padding, and only their answers scored (data/conversation_packing.py). A preference store's pairs
are packed whole too, with or without a shared prompt, each answer's tokens tagged with its pair and side
(data/preference_packing.py); a preference store mixes only with other preference stores.

Every sequence comes from one source, chosen by the mixture's schedule (the source furthest below
its share). At each step the next batch_size x dp_size sequences go to the data-parallel ranks,
batch_size each, in rank order; every sequence-parallel rank of a data-parallel rank builds the
same sequences and keeps its shard (`burst.shard_for_rank`: zigzag, or with cp_layout="balanced" each
sequence's balanced layout, chosen from its document boundaries), so no communication is needed.
The loader's state is how many sequences each source has given: resuming continues with exactly
the next tokens, on any cp x dp layout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from burst.documents import Documents
from burst.layout import check_layout, check_layout_windows, check_sequence_length
from data.conversation_packing import ConversationStream, check_policy
from data.mixture import MixtureSchedule
from data.preference_packing import PairSequence, PreferenceStream
from data.store import TokenStore

IGNORE_INDEX = -100  # label of a position whose next token is not scored: a document's start, a prompt, padding


@dataclass
class Batch:
    """One rank's share of a step: its sequences, cut to its sequence-parallel shard."""

    tokens: torch.Tensor  # int64 [batch, seq_len // cp_size], the rank's shard under the loader's cp_layout
    labels: torch.Tensor  # int64 [batch, seq_len // cp_size], next tokens; IGNORE_INDEX where the next is not
    #                       scored (a document's first token, its BOS if it has one; in conversations the prompts
    #                       and padding too)
    positions: torch.Tensor  # int64 [batch, seq_len // cp_size], global position ids of the shard's tokens
    documents: Documents | None  # the sequences' documents (burst/documents.py): per sequence, the cumulative
    #                              document starts over the FULL sequence [0, start_1, ..., seq_len] (a document
    #                              starts at its BOS, or after an EOS), what each sees, and the layout the shards
    #                              were cut with, chosen once here; attention uses it as it is
    num_tokens: int  # labels != IGNORE_INDEX in this shard, for normalising the loss across ranks
    rope_length: int  # max(position id) + 1 over the WHOLE sequences, the same on every cp rank: the length
    #                   a length-dependent RoPE scaling (dynamic NTK, longrope) is computed for (models/rope.py)
    # Preference pairs only (None otherwise); the same on every cp rank of a dp rank:
    answers: torch.Tensor | None = None  # int64 [batch, seq_len // cp_size], beside labels: the answer each label
    #                                      belongs to, 2 x pair + side (0 chosen, 1 rejected), pairs numbered over
    #                                      the batch's rows; -1 where the label is not an answer's
    pair_documents: torch.Tensor | None = None  # int64 [pairs]: each pair's index in its store split
    reference_logps: torch.Tensor | None = None  # float64 [pairs, 2], set by the trainer: the reference model's
    #                                              log-probabilities of each pair's chosen and rejected answer

    @property
    def doc_boundaries(self) -> list[torch.Tensor]:
        """Per sequence, int64 cumulative document starts over the full sequence (the documents' offsets)."""
        return [] if self.documents is None else [torch.tensor(row) for row in self.documents.offsets]

    @property
    def doc_sees(self) -> list[torch.Tensor] | None:
        """Per sequence, int64 [documents]: the earlier document each one also sees whole (a shared prompt), -1
        none; None where no document sees another."""
        sees = None if self.documents is None else self.documents.sees
        return None if sees is None else [torch.tensor(row) for row in sees]

    @property
    def num_pairs(self) -> int:
        return 0 if self.pair_documents is None else len(self.pair_documents)


class PackedStream:
    """One source's packing stream: its documents, each framed as its tokenizer frames a text (BOS + document + EOS,
    or document + EOS: `TokenStore.bos_first`), in a new seeded order every epoch.
    Reads copy whole slices of the memory map: the Python loop runs once per document, not per token.

    `stream_id` tells sources apart in the seed; source 0 draws its orders as a single store always has.
    """

    def __init__(self, store: TokenStore, seq_len: int, seed: int, stream_id: int = 0) -> None:
        self.store, self.seq_len = store, seq_len
        self._seed = [seed] + ([stream_id] if stream_id else [])
        self._prefix = store.document_prefix
        self._lengths = store.document_lengths + len(self._prefix) + 1  # [BOS] + document + EOS
        self.epoch_tokens = int(self._lengths.sum())
        self._eos = store.eos_id
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's document order and the stream offset where each packed document starts."""
        if epoch not in self._layouts:
            if len(self._layouts) > 2:  # iteration only moves forward; keep the current and the next epoch
                self._layouts.pop(min(self._layouts))
            seed = [self._seed[0], epoch, *self._seed[1:]]
            order = np.random.default_rng(seed).permutation(len(self._lengths))
            starts = np.concatenate([[0], np.cumsum(self._lengths[order])])  # [num_documents + 1]
            self._layouts[epoch] = (order, starts)
        return self._layouts[epoch]

    def sequence(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sequence k: tokens int64 [seq_len + 1], where documents start bool [seq_len + 1], and which tokens are
        scored bool [seq_len + 1] (all but a document's first: its BOS, or with no BOS its first token, which
        nothing of the document comes before)."""
        tokens, starts = self.read(k * self.seq_len, self.seq_len + 1)
        is_start = np.zeros(self.seq_len + 1, bool)
        is_start[starts] = True
        return tokens, is_start, ~is_start

    def padding_before(self, k: int) -> int:
        return 0  # documents run on from one sequence into the next: there is none

    @property
    def first_epoch_sequences(self) -> int:
        """How many sequences it takes to read every token of the first epoch (the last one partly): stream
        position epoch_tokens - 1 is a label of sequence (epoch_tokens - 2) // seq_len."""
        return (self.epoch_tokens - 2) // self.seq_len + 1

    def in_first_epoch(self, k: int) -> np.ndarray:
        """Which tokens of sequence k belong to the first epoch: bool [seq_len + 1]."""
        return k * self.seq_len + np.arange(self.seq_len + 1) < self.epoch_tokens

    def read(self, position: int, count: int) -> tuple[np.ndarray, list[int]]:
        """`count` stream tokens from `position` (counted from the start of epoch 0) and the offsets in them
        where a document starts."""
        out = np.empty(count, np.int64)
        starts: list[int] = []
        epoch, position = divmod(position, self.epoch_tokens)  # an epoch's length never changes
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
        """Write tokens [begin, begin + len(out)) of [BOS] + document + EOS into `out`."""
        tokens = self.store.document(document)
        end, prefix = begin + len(out), len(self._prefix)
        body_begin, body_end = max(begin, prefix), min(end, len(tokens) + prefix)  # the part inside the document
        out[:max(prefix - begin, 0)] = self._prefix[begin:prefix]
        out[body_begin - begin:body_end - begin] = tokens[body_begin - prefix:body_end - prefix]
        if end == len(tokens) + prefix + 1:
            out[-1] = self._eos


class SequenceLoader:
    """Iterates forever over `Batch`es of `sources` for one (data-parallel, sequence-parallel) rank.

    sources: one TokenStore (or split), or several with their shares of the sequences (`shares`, summing
    to 1; see data/mixture.py). With `reset_positions`, position ids restart at 0 at every document start
    inside a sequence (a document continued from the previous sequence starts at 0 too), matching
    document masking. Instruction stores pack their conversations with the `long_conversations` policy and
    score their answers, or every token but the first of each conversation with `train_on_prompt`. With
    `once` (validation) no token is scored twice: what a source gives past its first epoch is input only.
    `layout_windows`: the model's layers' sliding windows (`ModelConfig.windows`), whose work a balanced
    `cp_layout` weighs; the attention refuses documents laid out for other windows than its own.
    """

    def __init__(self, sources: TokenStore | Sequence[TokenStore], seq_len: int, batch_size: int, *,
                 shares: Sequence[float] | None = None, dp_rank: int = 0, dp_size: int = 1, cp_rank: int = 0,
                 cp_size: int = 1, seed: int = 0, reset_positions: bool = False, cp_layout: str = "zigzag",
                 long_conversations: str = "refuse", train_on_prompt: bool = False, once: bool = False,
                 prefix_sharing: bool = True, layout_windows=None) -> None:
        stores = [sources] if isinstance(sources, TokenStore) else list(sources)
        shares = [1.0] if shares is None and len(stores) == 1 else shares
        check_sequence_length(seq_len, cp_size)
        check_layout(cp_layout, "cp_layout")
        self.layout_windows = check_layout_windows(layout_windows)
        check_policy(long_conversations)
        if train_on_prompt and not any(store.is_conversations for store in stores):
            raise ValueError("--train-on-prompt scores the prompts of conversations as well as their answers, but no "
                             "--data source is an instruction store (`burst prepare --chat`): a store of documents "
                             "scores every token already; drop --train-on-prompt")
        if batch_size < 1:
            raise ValueError(f"batch size {batch_size} must be at least 1")
        if shares is None or len(shares) != len(stores):
            raise ValueError(f"{len(stores)} sources need {len(stores)} shares, got {shares}")
        for name, rank, size in (("dp_rank", dp_rank, dp_size), ("cp_rank", cp_rank, cp_size)):
            if not 0 <= rank < size:
                raise ValueError(f"{name} {rank} is out of range for {name[:2]}_size {size}: use 0..{size - 1}")
        if len({store.is_preferences for store in stores}) > 1:
            raise ValueError("preference stores (`burst prepare --preference`) mix only with other preference stores: "
                             "a pair's loss is not a token's; train on documents or conversations in another run")
        for store in stores:
            if store.num_documents == 0:
                raise ValueError(f"{store!r} has no documents to load; prepare a store with documents, or use "
                                 f"another split (the validation split is empty when --val-fraction is 0)")
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_size, self.cp_rank, self.cp_size = dp_rank, dp_size, cp_rank, cp_size
        self.seed, self.reset_positions, self.cp_layout, self.once = seed, reset_positions, cp_layout, once
        self.preferences = stores[0].is_preferences
        self.streams = [PreferenceStream(store, seq_len, seed, i, policy=long_conversations,
                                         prefix_sharing=prefix_sharing) if store.is_preferences
                        else ConversationStream(store, seq_len, seed, i, policy=long_conversations,
                                                train_on_prompt=train_on_prompt) if store.is_conversations
                        else PackedStream(store, seq_len, seed, i) for i, store in enumerate(stores)]
        self.schedule = MixtureSchedule(list(shares))

    @property
    def sequences_by_source(self) -> list[int]:
        """How many sequences each source has given so far (to every rank together)."""
        return list(self.schedule.counts)

    @property
    def first_epoch_sequences(self) -> int:
        """How many sequences hold every source's first epoch (every token of each, scored once)."""
        return sum(stream.first_epoch_sequences for stream in self.streams)

    @property
    def padding_tokens(self) -> int:
        """Padding among the inputs of every sequence given so far (to every rank together): what packing whole
        conversations leaves empty."""
        return sum(stream.padding_before(count) for stream, count in zip(self.streams, self.schedule.counts,
                                                                         strict=True))

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"sequences": self.sequences_by_source, "seed": self.seed,
                "num_documents": [stream.store.num_documents for stream in self.streams],
                "content": [stream.store.content_digest for stream in self.streams]}  # compared on resume (preflight)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        documents = [stream.store.num_documents for stream in self.streams]
        if "sequences" not in state and len(documents) == 1:  # a one-store run of before mixtures
            position = int(state["epoch"]) * self.streams[0].epoch_tokens + int(state["position"])
            state = {"sequences": [position // self.seq_len], "seed": state["seed"],
                     "num_documents": [state["num_documents"]]}
        for key, mine in (("seed", self.seed), ("num_documents", documents)):
            if state[key] != mine:
                raise ValueError(f"loader state was saved with {key}={state[key]} but this loader has {mine}; "
                                 f"resume with the same data and seed, or start the data stream afresh")
        self.schedule.counts = [int(count) for count in state["sequences"]]

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        rows = self.batch_size
        sequences = []
        mine = range(self.dp_rank * rows, (self.dp_rank + 1) * rows)
        for index in range(rows * self.dp_size):  # every dp rank's sequences are drawn, only this one's are read
            source = self.schedule.next()
            if index in mine:
                k = self.schedule.counts[source] - 1  # the source's sequence number
                sequence = self.streams[source].sequence(k)
                if self.once:  # what a source gives past its first epoch is input only
                    first = self.streams[source].in_first_epoch(k)
                    if isinstance(sequence, PairSequence):
                        sequence.scored &= first
                    else:
                        sequence = (*sequence[:2], sequence[2] & first)
                sequences.append(sequence)
        if self.preferences:
            return self._pair_batch(sequences)
        return self._batch(*(np.stack(arrays) for arrays in zip(*sequences, strict=True)))

    def _batch(self, sequences: np.ndarray, is_start: np.ndarray, scored: np.ndarray,
               positions: np.ndarray | None = None, answers: np.ndarray | None = None,
               doc_sees: list[torch.Tensor] | None = None) -> Batch:
        """This rank's shard of the rows `sequences` [rows, seq_len + 1] (the last token is only a label),
        with `is_start` marking where documents begin and `scored` the tokens that are labels; the positions
        [rows, seq_len + 1], the answers [rows, seq_len + 1] of each token and the documents each document also
        sees where the stream gives them."""
        rows, seq_len = sequences.shape[0], self.seq_len
        boundaries = [np.unique(np.concatenate([[0], np.flatnonzero(row[:-1]), [seq_len]])) for row in is_start]
        full = np.empty((3 if answers is None else 4, rows, seq_len), np.int64)  # sharded in one call
        full[0] = sequences[:, :-1]
        full[1] = np.where(scored[:, 1:], sequences[:, 1:], IGNORE_INDEX)
        full[2] = np.arange(seq_len) if positions is None else positions[:, :-1]
        if self.reset_positions and positions is None:
            for row, b in enumerate(boundaries):
                full[2, row] -= np.repeat(b[:-1], np.diff(b))  # the start of each position's document
        if answers is not None:
            full[3] = np.where(scored[:, 1:], answers[:, 1:], -1)
        documents = Documents.of(boundaries, seq_len, self.cp_size, self.cp_layout, doc_sees,  # the layout chosen
                                 layout_windows=self.layout_windows)
        sharded = documents.shard(torch.from_numpy(full), self.cp_rank, dim=2, batch_dim=1)
        tokens, labels, positions_ = sharded[:3]
        return Batch(tokens=tokens, labels=labels, positions=positions_,  # each [rows, seq_len // cp_size]
                     documents=documents, num_tokens=int((labels != IGNORE_INDEX).sum()),
                     rope_length=int(full[2].max()) + 1, answers=sharded[3] if answers is not None else None)

    def _pair_batch(self, sequences: list[PairSequence]) -> Batch:
        """The batch of packed pairs: answers numbered over the rows, and which documents see a shared prompt."""
        pairs_before = np.cumsum([0] + [len(s.documents) for s in sequences])
        answers = np.stack([np.where(s.answer >= 0, s.answer + 2 * before, -1)
                            for s, before in zip(sequences, pairs_before, strict=False)])
        doc_sees = None
        if self.streams[0].prefix_sharing:
            doc_sees = []
            for s in sequences:
                back = s.sees_back[np.flatnonzero(s.is_start[:-1])]  # per document (the first starts at 0)
                doc_sees.append(torch.from_numpy(np.where(back > 0, np.arange(len(back)) - back, -1)))
        batch = self._batch(np.stack([s.tokens for s in sequences]), np.stack([s.is_start for s in sequences]),
                            np.stack([s.scored for s in sequences]), np.stack([s.positions for s in sequences]),
                            answers, doc_sees)
        batch.pair_documents = torch.from_numpy(np.concatenate([s.documents for s in sequences]))
        return batch
