"""Question answering at long range, on an instruction store's own validation conversations.

Each sample is one validation conversation up to the end of its last answer: the model must give that answer
(and its end-of-turn token) from everything before it, which for long-context data is a long document and a
question about it. A sample is answered when greedy decoding reproduces the answer's tokens exactly, scored in
one teacher-forced pass as passkey retrieval is (evaluation/passkey.py: `greedy_answer`).

Accuracy is reported by depth: where the answer's text first occurs in the prompt before it, as a fraction of
the prompt's characters (0 = its start, 1 = its end), in DEPTH_BUCKETS equal buckets; samples whose answer
does not occur in the prompt verbatim are counted apart. Conversations longer than --seq-len are skipped,
and counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from burst.groups import group_rank_and_size
from data import Tokenizer, TokenStore
from evaluation.passkey import greedy_answer
from models import Transformer

DEPTH_BUCKETS = 5


@dataclass
class AnswerSample:
    """A prompt and the answer after it: tokens [length] with the answer at [answer_start, answer_end)."""

    tokens: list[int]
    answer_ids: list[int]
    answer_start: int
    answer_end: int
    depth: float | None  # where the answer's text first occurs in the prompt (0..1); None: it does not


@dataclass
class QABucket:
    depth_start: float | None  # None: the samples whose answer is not in the prompt
    depth_end: float | None
    samples: int = 0
    correct: int = 0

    @property
    def accuracy(self) -> float:
        return self.correct / self.samples if self.samples else float("nan")


@dataclass
class QAResult:
    samples: int
    correct: int
    by_depth: list[QABucket]  # DEPTH_BUCKETS equal buckets of depth
    not_in_prompt: QABucket  # answers that do not occur in the prompt verbatim
    skipped_long: int  # validation conversations longer than seq_len, not scored

    @property
    def accuracy(self) -> float:
        return self.correct / self.samples if self.samples else float("nan")


def answer_depth(tokenizer: Tokenizer, prompt: list[int], answer: list[int]) -> float | None:
    """Where the answer's text (without its end-of-turn token, when only that way it is found) first occurs in
    the prompt's text, as a fraction of the prompt's characters before it could start; None: nowhere."""
    text = tokenizer.decode(prompt)
    for candidate in (answer, answer[:-1]):
        needle = tokenizer.decode(candidate).strip()
        if needle and (found := text.find(needle)) >= 0:
            return found / max(len(text) - len(needle), 1)
    return None


def answer_sample(tokenizer: Tokenizer, tokens: np.ndarray, scored: np.ndarray, multiple: int) -> AnswerSample:
    """The conversation up to the end of its last answer (its last run of scored tokens), padded with EOS to a
    multiple of `multiple` tokens (the zigzag layout's 2 x cp chunks)."""
    end = int(np.flatnonzero(scored)[-1]) + 1
    start = end - int(np.argmin(scored[:end][::-1])) if not scored[:end].all() else 0
    prompt, answer = tokens[:start].tolist(), tokens[start:end].tolist()
    padded = prompt + answer + [tokenizer.eos_id] * (-end % multiple)
    return AnswerSample(padded, answer, start, end, answer_depth(tokenizer, prompt, answer))


def answer_samples(split: TokenStore, tokenizer: Tokenizer, seq_len: int, count: int, multiple: int
                   ) -> tuple[list[AnswerSample], int]:
    """The samples of the first `count` validation conversations that fit `seq_len`, and how many were longer."""
    samples, skipped = [], 0
    for i in range(split.num_documents):
        if len(samples) == count:
            break
        tokens = split.document(i)
        if len(tokens) > seq_len:
            skipped += 1
            continue
        samples.append(answer_sample(tokenizer, np.asarray(tokens, np.int64), split.scored(i) != 0, multiple))
    return samples, skipped


def evaluate_qa(model: Transformer, split: TokenStore, tokenizer: Tokenizer, seq_len: int, count: int,
                group: dist.ProcessGroup | None = None, progress: Callable[[int, int], None] | None = None
                ) -> QAResult:
    """Answer accuracy, by depth, over the first `count` validation conversations of at most `seq_len` tokens;
    `progress(done, total)` hears of each sample answered."""
    samples, skipped = answer_samples(split, tokenizer, seq_len, count, 2 * group_rank_and_size(group)[1])
    edges = np.linspace(0, 1, DEPTH_BUCKETS + 1)
    by_depth = [QABucket(float(a), float(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    not_in_prompt = QABucket(None, None)
    for done, sample in enumerate(samples, 1):
        bucket = not_in_prompt if sample.depth is None else \
            by_depth[min(int(sample.depth * DEPTH_BUCKETS), DEPTH_BUCKETS - 1)]
        bucket.samples += 1
        bucket.correct += greedy_answer(model, sample, group) == sample.answer_ids
        if progress is not None:
            progress(done, len(samples))
    correct = sum(b.correct for b in [*by_depth, not_in_prompt])
    return QAResult(len(samples), correct, by_depth, not_in_prompt, skipped)
