"""A preference store's sequences: whole pairs packed several to a sequence, never cut across two.

With prefix sharing (the default) a pair of prompt P, chosen C and rejected R is laid out as three documents:

    D0  the prompt but its last token                          positions 0 .. |P| - 2
    D1  the prompt's last token, then the chosen answer         positions |P| - 1 .. |P| - 1 + |C|
    D2  the prompt's last token, then the rejected answer       positions |P| - 1 .. |P| - 1 + |R|

where D1 and D2 also see D0 whole (`doc_sees` = [-1, 0, 0]) and not each other: each answer sees exactly what
it would see after the prompt alone, at the positions it would have, and its first token is predicted from
its own copy of the prompt's last token. The prompt is computed once: |P| + |C| + |R| + 1 tokens a pair. Without
(`prefix_sharing=False`), prompt + chosen and prompt + rejected are two ordinary documents: 2|P| + |C| + |R|.
Only the answers' tokens are scored, each tagged with its pair (numbered within the sequence) and side (0
chosen, 1 rejected), so that the loss can sum each answer's log-probabilities.

Pairs are packed next-fit in a new seeded order every epoch, as conversations are (data/conversation_packing.py,
whose plan this reuses): sequence k of the stream is a function of (seed, k). A pair longer than a sequence
follows --long-conversations: refuse (the default) refuses the run, naming it; truncate cuts the prompt's start
away (a leading BOS kept) so that the pair fits, refused where even its answers do not; split is refused, since
a pair's answers cannot be scored apart from their prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.conversation_packing import NAMED, ConversationStream, LongConversations
from data.store import TokenStore

CHOSEN, REJECTED = 0, 1


@dataclass
class PairSequence:
    """One packed sequence of pairs, seq_len + 1 tokens (the last one only a label)."""

    tokens: np.ndarray  # int64 [seq_len + 1]
    is_start: np.ndarray  # bool [seq_len + 1]: where documents start (the padding is one)
    scored: np.ndarray  # bool [seq_len + 1]: the answers' tokens
    positions: np.ndarray  # int64 [seq_len + 1]: each token's position in its pair's layout
    answer: np.ndarray  # int64 [seq_len + 1]: 2 x pair + side on the answers' tokens, -1 elsewhere
    sees_back: np.ndarray  # int64 [seq_len + 1]: at a document's start, how many documents back lies the one it
    #                        also sees whole (0: none)
    documents: np.ndarray  # int64 [pairs]: the store's (split's) index of each pair, in sequence order


class PreferenceStream(ConversationStream):
    """The sequences of one preference store (or split): `sequence(k)` reads sequence k, `padding_before(k)`
    counts the padding of sequences 0..k-1 without reading any token."""

    def __init__(self, store: TokenStore, seq_len: int, seed: int, stream_id: int = 0, *, policy: str = "refuse",
                 prefix_sharing: bool = True) -> None:
        if policy == "split":
            raise ValueError("--long-conversations split cuts a long conversation into pieces, but a preference pair "
                             "is scored whole (each answer after its whole prompt): use --long-conversations truncate "
                             "(an over-long pair's prompt start is cut) or refuse (the default)")
        self._begin_stream(store, seq_len, seed, stream_id, policy)
        self.prefix_sharing = prefix_sharing
        pairs = store.pair_lengths  # [pairs, 3]: prompt, chosen, rejected
        self._prompt_begin = np.zeros(len(pairs), np.int64)  # prompt tokens cut away by truncate (after a BOS)
        self._keeps_first = np.zeros(len(pairs), bool)
        lengths = self._packed(pairs[:, 0], pairs)
        over = np.flatnonzero(lengths > self.capacity)
        self.long = LongConversations(policy, len(over), 0, 0)
        if len(over) and policy != "truncate":
            raise ValueError(self._too_long(over, lengths, "set --long-conversations truncate (the prompt's start is "
                                                           "cut), or raise --seq-len"))
        if len(over):
            self._truncate(over, pairs)
            lengths = self._packed(pairs[:, 0] - self._prompt_begin, pairs)
        # One piece per pair: the plan of ConversationStream packs them next-fit.
        self._first_piece = np.arange(len(pairs) + 1)
        self._lengths = lengths

    def _packed(self, prompts: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """Tokens each pair takes in a sequence, with prompts of `prompts` tokens."""
        answers = pairs[:, 1] + pairs[:, 2]
        return prompts + answers + 1 if self.prefix_sharing else 2 * prompts + answers

    def _too_long(self, over: np.ndarray, lengths: np.ndarray, fix: str) -> str:
        named = ", ".join(f"{self.store.place(int(i))} ({int(lengths[i]):,} tokens)" for i in over[:NAMED])
        split = "" if self.store.split_name == "all" else f" ({self.store.split_name} split)"
        layout = "prompt once, then both answers" if self.prefix_sharing else \
            "prompt + chosen, then prompt + rejected (--no-prefix-sharing)"
        return (f"{len(over):,} preference pairs of {self.store.directory}{split} are longer than a sequence of "
                f"--seq-len {self.seq_len:,} (+ 1 label) as packed ({layout}), the longest "
                f"{int(lengths[over].max()):,} tokens: {named}" + (" ..." if len(over) > NAMED else "") + f"; {fix}")

    def _truncate(self, over: np.ndarray, pairs: np.ndarray) -> None:
        """Cut each over-long pair's prompt start away (keeping its BOS, and at least one token after it),
        refusing pairs whose answers alone do not fit."""
        keeps = np.array([self.store.document(int(i))[0] == self.store.bos_id for i in over], bool)
        room = self.capacity - pairs[over, 1] - pairs[over, 2]  # for the prompt (x2 without sharing), + 1 with
        prompts = room - 1 if self.prefix_sharing else room // 2
        cut = over[prompts < 1 + keeps]
        if len(cut):
            raise ValueError(self._too_long(cut, self._packed(pairs[:, 0], pairs),
                                            "even with their prompts cut to one token their answers do not fit: "
                                            "raise --seq-len"))
        self._keeps_first[over] = keeps
        self._prompt_begin[over] = pairs[over, 0] - prompts + keeps
        self.long.truncated_tokens = int((self._prompt_begin[over] - keeps).sum())

    def sequence(self, k: int) -> PairSequence:  # type: ignore[override]
        """Sequence k of the stream."""
        epoch, index = self._locate(k)
        pieces, starts, _ = self._plan(epoch)
        documents = pieces[starts[index]:starts[index + 1]]
        out = PairSequence(np.full(self.capacity, self.store.eos_id, np.int64), np.zeros(self.capacity, bool),
                           np.zeros(self.capacity, bool), np.zeros(self.capacity, np.int64),
                           np.full(self.capacity, -1, np.int64), np.zeros(self.capacity, np.int64),
                           documents.astype(np.int64))
        filled = 0
        for pair, document in enumerate(documents.tolist()):
            filled = self._place(out, filled, pair, document)
        if filled < self.capacity:  # the padding: a document of its own
            out.is_start[filled] = True
            out.positions[filled:] = np.arange(self.capacity - filled)
        return out

    def _place(self, out: PairSequence, at: int, pair: int, document: int) -> int:
        """Write pair `pair` (store document `document`) into `out` from offset `at`; returns where it ends."""
        ids = self.store.document(document)
        prompt_length, chosen_length, _ = (int(n) for n in self.store.pair_lengths_of(document))
        begin = int(self._prompt_begin[document])
        prompt = np.concatenate([ids[:1], ids[begin:prompt_length]]) if self._keeps_first[document] and begin \
            else ids[begin:prompt_length]
        answers = (ids[prompt_length:prompt_length + chosen_length], ids[prompt_length + chosen_length:])
        if self.prefix_sharing:
            documents = [prompt[:-1]] if len(prompt) > 1 else []
            documents += [np.concatenate([prompt[-1:], answer]) for answer in answers]
            first = [0, len(prompt) - 1, len(prompt) - 1][-len(documents):]
            sees = [0, 1, 2][-len(documents):] if len(documents) == 3 else [0, 0]
            skip = 1  # an answer's document starts with the prompt's last token, not scored
        else:
            documents = [np.concatenate([prompt, answer]) for answer in answers]
            first, sees, skip = [0, 0], [0, 0], len(prompt)
        answer_documents = len(documents) - 2
        for i, tokens in enumerate(documents):
            span = slice(at, at + len(tokens))
            out.tokens[span] = tokens
            out.is_start[at] = True
            out.positions[span] = first[i] + np.arange(len(tokens))
            out.sees_back[at] = sees[i]
            if i >= answer_documents:
                answer = slice(at + skip, span.stop)
                out.scored[answer] = True
                out.answer[answer] = 2 * pair + (i - answer_documents)
            at = span.stop
        return at
