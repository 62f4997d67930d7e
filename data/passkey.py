"""Passkey retrieval: a number hidden at a chosen depth of a long filler text, asked for at the end.

The sample is built in tokens, each part encoded on its own, so that it has exactly the length
asked for and the answer's place is known exactly:

    [BOS]  intro  filler[:a]  needle  filler[:b]  question  answer
                <-------- depth * filler --->

The answer's ids are those it has after the question in one text ("... The pass key is 12345"), not the
passkey encoded alone: a byte-level BPE (LLaMA-3, SmolLM2) gives " 12345" a space token of its own, which a
model predicts first; the passkey alone starts at its first digit, a continuation no model makes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from data.tokenizer import Tokenizer

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {passkey}. Remember it. {passkey} is the pass key. "
QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeySample:
    tokens: list[int]  # [length]: BOS (when its tokenizer frames text so), the prompt, and the answer at the end
    answer_ids: list[int]  # == tokens[answer_start:answer_end]
    answer_start: int  # logits at positions answer_start - 1 ... answer_end - 2 must predict the answer
    answer_end: int
    passkey: str
    depth: float  # where the needle sits in the filler: 0 = start, 1 = end


def passkey_sample(tokenizer: Tokenizer, length: int, depth: float, seed: int = 0, digits: int = 5) -> PasskeySample:
    """A passkey-retrieval sample of exactly `length` tokens, the needle at `depth` of the filler.

    The passkey is a `digits`-digit number drawn from `seed`, so equal arguments give equal samples.
    """
    if not 0 <= depth <= 1:
        raise ValueError(f"depth {depth} must be in [0, 1]: 0 puts the pass key at the start, 1 at the end")
    passkey = str(random.Random(seed).randrange(10 ** (digits - 1), 10**digits))
    intro, needle = tokenizer.encode(INTRO), tokenizer.encode(NEEDLE.format(passkey=passkey))
    question, answer = tokenizer.encode(QUESTION), answer_after(tokenizer, QUESTION, passkey)
    prefix = [tokenizer.bos_id] if tokenizer.bos_first else []  # as documents are framed (data/tokenizer.py)
    fixed = len(prefix) + len(intro) + len(needle) + len(question) + len(answer)
    filler_tokens = length - fixed
    if filler_tokens < 0:
        raise ValueError(f"a passkey sample needs at least {fixed} tokens with this tokenizer; asked for {length}")
    unit = tokenizer.encode(FILLER)
    filler = unit * (filler_tokens // len(unit) + 1)  # cut at a token, so the length comes out exact
    before = round(depth * filler_tokens)
    tokens = (prefix + intro + filler[:before] + needle + filler[:filler_tokens - before]
              + question + answer)
    return PasskeySample(tokens=tokens, answer_ids=answer, answer_start=length - len(answer), answer_end=length,
                         passkey=passkey, depth=depth)


def answer_after(tokenizer: Tokenizer, question: str, answer: str) -> list[int]:
    """The ids `answer` has when it follows `question` after a space in one text, as a model would write it."""
    asked, joint = tokenizer.encode(question), tokenizer.encode(f"{question} {answer}")
    if joint[:len(asked)] != asked:  # the tokenizer merges across the question's end: no place to score from
        raise ValueError(f"this tokenizer encodes {question!r} differently when {answer!r} follows it, so the "
                         f"answer's ids cannot be told apart from the question's")
    return joint[len(asked):]
