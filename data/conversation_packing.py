"""An instruction store's sequences: whole conversations packed into sequences, never cut across two.

Every epoch takes the store's conversations in a new seeded order and packs them next-fit: each goes into
the current sequence if it fits in what is left of it, else it starts the next one; what a sequence has
left over is padding (EOS ids, never scored, a document of its own: it attends only to itself under
--doc-mask). A sequence holds seq_len + 1 tokens, the last one only a label, as a plain stream's do, so a
conversation of up to seq_len + 1 tokens fits. A conversation's first token is never scored (nothing in the
sequence predicts it); the others are scored where the store marks them (the answers), or all of them with
`train_on_prompt`.

A conversation longer than a sequence follows LONG_CONVERSATIONS, chosen with --long-conversations:

    refuse    (the default) the run is refused before it starts, naming the conversations and their rows
    truncate  the start of the prompt is cut away, so that the rest fills one sequence exactly; a conversation
              that starts with BOS keeps it first. Refused when even that would cut an answer
    split     the conversation is cut into sequence-long pieces, each packed as a conversation of its own
              (an answer in a later piece is then scored without the question before the cut)

Sequence k of the stream is a function of (seed, k): a resumed run continues with exactly the next one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.store import TokenStore

LONG_CONVERSATIONS = ("refuse", "truncate", "split")
NAMED = 3  # over-long conversations named in a refusal


@dataclass
class LongConversations:
    """What the policy does to a store's conversations longer than a sequence (counted for the run's report)."""

    policy: str
    count: int  # conversations longer than a sequence
    truncated_tokens: int  # tokens cut away by "truncate"
    pieces: int  # sequence-long pieces "split" makes of them

    def describe(self, conversations: int) -> str:
        """What packing does to a store of `conversations`, as the run reports it: those packed whole, then those
        longer than a sequence and what the policy does to them (a split one is not packed whole)."""
        if self.policy == "truncate":  # a truncated conversation is still packed whole, from its cut on
            return f"{conversations:,} conversations packed whole" + (
                f", {self.count:,} of them longer than a sequence truncated, {self.truncated_tokens:,} prompt "
                f"tokens cut" if self.count else "")
        return f"{conversations - self.count:,} conversations packed whole" + (
            f", {self.count:,} longer than a sequence split into {self.pieces:,} pieces" if self.count else "")


def check_policy(policy: str, flag: str = "--long-conversations") -> None:
    if policy not in LONG_CONVERSATIONS:
        raise ValueError(f"{flag} {policy!r} is not one of {', '.join(LONG_CONVERSATIONS)}")


class ConversationStream:
    """The sequences of one instruction store (or split): `sequence(k)` reads sequence k, `padding_before(k)`
    counts the padding of sequences 0..k-1 without reading any token."""

    def __init__(self, store: TokenStore, seq_len: int, seed: int, stream_id: int = 0, *, policy: str = "refuse",
                 train_on_prompt: bool = False) -> None:
        self._begin_stream(store, seq_len, seed, stream_id, policy)
        self.train_on_prompt = train_on_prompt
        lengths = store.document_lengths
        over = np.flatnonzero(lengths > self.capacity)
        self.long = LongConversations(policy, len(over), 0, 0)
        if len(over) and policy == "refuse":
            raise ValueError(self._too_long(over, "set --long-conversations truncate (the prompt's start is cut) or "
                                                  "split, or raise --seq-len"))
        # The pieces packed, in store order: conversation `document[i]`, its tokens [begin[i], end[i]), after its
        # first token when keeps_first[i] (a truncated conversation keeps its BOS).
        pieces = np.where(lengths > self.capacity, -(-lengths // self.capacity), 1) if policy == "split" else \
            np.ones(len(lengths), np.int64)
        self._document = np.repeat(np.arange(len(lengths)), pieces)
        self._first_piece = np.concatenate([[0], np.cumsum(pieces)])  # [num_documents + 1]
        within = np.arange(len(self._document)) - self._first_piece[self._document]  # piece number in its document
        self._begin = within * self.capacity
        self._end = np.minimum(self._begin + self.capacity, lengths[self._document])
        self._keeps_first = np.zeros(len(self._document), bool)
        if len(over) and policy == "truncate":
            self._truncate(over, lengths)
        elif len(over):
            self.long.pieces = int(pieces[over].sum())
        self._lengths = self._end - self._begin + self._keeps_first  # [pieces]

    def _begin_stream(self, store: TokenStore, seq_len: int, seed: int, stream_id: int, policy: str) -> None:
        """What every stream of whole units (conversations, pairs) starts with: the policy checked, no epoch
        planned yet."""
        check_policy(policy)
        self.store, self.seq_len, self.capacity = store, seq_len, seq_len + 1
        self._seed = [seed] + ([stream_id] if stream_id else [])
        self._plans: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._epoch_bins: list[int] = []  # sequences of each epoch planned so far
        self._epoch_padding: list[int] = []  # their padding tokens

    def _too_long(self, over: np.ndarray, fix: str) -> str:
        named = ", ".join(f"{self.store.place(int(i))} ({int(self.store.document_lengths[i]):,} tokens)"
                          for i in over[:NAMED])
        split = "" if self.store.split_name == "all" else f" ({self.store.split_name} split)"
        longest = int(self.store.document_lengths[over].max())
        return (f"{len(over):,} conversations of {self.store.directory}{split} are longer than a sequence of "
                f"--seq-len {self.seq_len:,} (+ 1 label), the longest {longest:,} tokens: {named}"
                + (" ..." if len(over) > NAMED else "") + f"; {fix}")

    def _truncate(self, over: np.ndarray, lengths: np.ndarray) -> None:
        """Cut each over-long conversation's start away (keeping its BOS), refusing one whose answers would go."""
        bos = self.store.bos_id
        keeps = np.array([self.store.document(int(d))[0] == bos for d in over], bool)
        begin = lengths[over] - self.capacity + keeps
        first_scored = np.array([int(np.argmax(self.store.scored(int(d)) != 0)) for d in over])
        cut_answers = over[first_scored < begin]
        if len(cut_answers):
            raise ValueError(self._too_long(cut_answers, "even with their prompts' start cut away their answers do "
                                                         "not fit: set --long-conversations split, or raise "
                                                         "--seq-len"))
        # one piece per document under truncate: piece i is conversation i
        self._begin[over], self._end[over], self._keeps_first[over] = begin, lengths[over], keeps
        self.long.truncated_tokens = int((begin - keeps).sum())

    # -- the packing plan -------------------------------------------------------------------------------------

    def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Epoch `epoch`'s pieces in packing order, the first of each sequence's (and one past the last), and each
        sequence's padding tokens among its seq_len inputs."""
        if epoch not in self._plans:
            if len(self._plans) > 2:  # reading moves forward; keep the current and the next epoch
                self._plans.pop(min(self._plans))
            order = np.random.default_rng([self._seed[0], epoch, *self._seed[1:]]).permutation(
                self.store.num_documents)
            counts = np.diff(self._first_piece)[order]
            # each document's pieces, in order: [pieces]
            pieces = np.repeat(self._first_piece[order] - np.cumsum(counts) + counts, counts) + \
                np.arange(int(counts.sum()))
            starts, fills, fill = [], [], self.capacity
            for i, length in enumerate(self._lengths[pieces].tolist()):  # next-fit
                if fill + length > self.capacity:
                    starts.append(i)
                    fills.append(fill)
                    fill = 0
                fill += length
            fills = fills[1:] + [fill]
            padding = self.seq_len - np.minimum(np.asarray(fills, np.int64), self.seq_len)
            self._plans[epoch] = (pieces, np.asarray([*starts, len(pieces)], np.int64), padding)
        return self._plans[epoch]

    def _locate(self, k: int) -> tuple[int, int]:
        """(epoch, sequence within it) of the stream's sequence k."""
        epoch, before = 0, 0
        while True:
            if epoch == len(self._epoch_bins):
                _, _, padding = self._plan(epoch)
                self._epoch_bins.append(len(padding))
                self._epoch_padding.append(int(padding.sum()))
            if k < before + self._epoch_bins[epoch]:
                return epoch, k - before
            before += self._epoch_bins[epoch]
            epoch += 1

    def sequences_in_epoch(self, epoch: int = 0) -> int:
        return len(self._plan(epoch)[2])

    @property
    def first_epoch_sequences(self) -> int:
        """How many sequences it takes to read every conversation of the first epoch."""
        return self.sequences_in_epoch(0)

    def in_first_epoch(self, k: int) -> np.ndarray:
        """Which tokens of sequence k belong to the first epoch: bool [seq_len + 1] (a sequence is in one epoch)."""
        return np.full(self.capacity, k < self.sequences_in_epoch(0))

    def padding_before(self, k: int) -> int:
        """Padding tokens among the inputs of sequences 0..k-1."""
        if k == 0:
            return 0
        epoch, index = self._locate(k - 1)
        return sum(self._epoch_padding[:epoch]) + int(self._plan(epoch)[2][:index + 1].sum())

    def sequence(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sequence k: tokens int64 [seq_len + 1], where documents start bool [seq_len + 1] (the padding is one),
        and which tokens are scored bool [seq_len + 1]."""
        epoch, index = self._locate(k)
        pieces, starts, _ = self._plan(epoch)
        tokens = np.full(self.capacity, self.store.eos_id, np.int64)
        is_start = np.zeros(self.capacity, bool)
        scored = np.zeros(self.capacity, bool)
        filled = 0
        for piece in pieces[starts[index]:starts[index + 1]].tolist():
            document, begin, end = int(self._document[piece]), int(self._begin[piece]), int(self._end[piece])
            parts = ([slice(0, 1)] if self._keeps_first[piece] else []) + [slice(begin, end)]
            is_start[filled] = True
            for part in parts:
                span = slice(filled, filled + part.stop - part.start)
                tokens[span] = self.store.document(document)[part]
                scored[span] = True if self.train_on_prompt else self.store.scored(document)[part]
                filled = span.stop
        if filled < self.capacity:
            is_start[filled] = True  # the padding: a document of its own
        return tokens, is_start, scored & ~is_start
