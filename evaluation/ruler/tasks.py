"""RULER's tasks (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv 2404.06654; github.com/NVIDIA/RULER), generated here from RULER's own prompt templates.

Each task makes a sample of a given size (`Task.make(rng, size)`: haystack sentences, words, ...); the runner
(evaluation/ruler/run.py) searches the largest size whose prompt fits a length. What differs from RULER's
scripts, and why: the real-text haystack is Python's own English documentation (`pydoc_data.topics`, installed
with every Python) instead of Paul Graham's essays, which burst cannot download; words are that text's words
instead of the wonderwords package's lists, and sentences are cut at ". " instead of by nltk.
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's 40 insertion depths, in percent

NIAH = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will "
        "quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} "
        "for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are")
VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
      "Question: Find all variables that are assigned the value {query} in the text above.",
      " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
      "the value {query}, they are: ")
CWE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
       "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
       " Answer: The top 10 words that appear most often in the list are:")
FWE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
       "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
       "What are the three most frequently appeared words in the above coded text?",
       " Answer: According to the coded text above, the three most frequently appeared words are:")
QA = ("Answer the question based on the given documents. Only give me the answer and do not output any other words."
      "\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only "
      "give me the answer and do not output any other words.\n\nQuestion: {query}", " Answer:")


@dataclass(frozen=True)
class Sample:
    text: str  # the task's prompt, without the answer prefix
    answer_prefix: str  # what the model's answer starts with (after the chat template's generation prompt)
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Task:
    name: str
    max_new_tokens: int
    metric: str  # "all": the share of answers found in the output; "part": 1 if any is
    make: Callable[[random.Random, int], Sample]  # (rng, size) -> a sample; larger sizes make longer prompts
    min_size: int = 1


@cache
def real_text() -> list[str]:
    """Python's documentation as a list of words (whitespace runs made one space), the real-text haystack."""
    from pydoc_data.topics import topics

    return re.sub(r"\s+", " ", " ".join(topics[key] for key in sorted(topics))).split(" ")


@cache
def english_words() -> list[str]:
    """Distinct lowercase words of 4-12 letters from the documentation, sorted."""
    return sorted(set(re.findall(r"\b[a-z]{4,12}\b", " ".join(real_text()))))


def random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return f"{rng.choice(english_words())}-{rng.choice(english_words())}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def sentences_of(words: list[str]) -> list[str]:
    text = " ".join(words).strip()
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def insert_at_depths(rng: random.Random, sentences: list[str], needles: list[str]) -> str:
    """The sentences with each needle placed at one of RULER's depths, joined by spaces."""
    cuts = [0, *sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(needles))), len(sentences)]
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(needles):
            parts.append(needles[i - 1])
    return " ".join(parts)


def niah(haystack: str, key: str = "words", value: str = "numbers", keys: int = 1, values: int = 1,
         queries: int = 1) -> Callable[[random.Random, int], Sample]:
    """Needle in a haystack: `keys` needles "One of the special magic {value kind} for {key} is: {value}." (with
    `values` values each) in noise sentences, real text or other needles; the model must give the values of
    `queries` keys."""
    keys = max(keys, queries)

    def make(rng: random.Random, size: int) -> Sample:
        key_names, key_values, needles = [], [], []
        for _ in range(keys):
            key_names.append(random_value(rng, key))
            key_values.append([random_value(rng, value) for _ in range(values)])
            needles += [NEEDLE.format(type_needle_v=value, key=key_names[-1], value=v) for v in key_values[-1]]
        rng.shuffle(needles)
        if haystack == "essay":
            words = real_text()
            context = insert_at_depths(rng, sentences_of((words * (size // len(words) + 1))[:size]), needles)
        else:
            lines = [NOISE] * size if haystack == "noise" else \
                [NEEDLE.format(type_needle_v=value, key=random_value(rng, key), value=random_value(rng, value))
                 for _ in range(size)]
            for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles,
                                     strict=True):
                lines.insert(index, needle)
            context = "\n".join(lines)
        asked = rng.sample(range(keys), queries)
        query = ", ".join(key_names[i] for i in asked[:-1]) + ", and " + key_names[asked[-1]] if queries > 1 \
            else key_names[asked[0]]
        template, prefix, kind = *NIAH, value
        if queries * values == 1:  # RULER's singular wording
            template, prefix = (singular(t) for t in NIAH)
            kind = value[:-1]
        return Sample(template.format(type_needle_v=kind, context=context, query=query),
                      prefix.format(type_needle_v=kind, query=query),
                      tuple(v for i in asked for v in key_values[i]))
    return make


def singular(template: str) -> str:
    return template.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def variable_tracking(chains: int = 1, hops: int = 4) -> Callable[[random.Random, int], Sample]:
    """Chains "VAR X = 12345", "VAR Y = VAR X ", ... scattered in noise sentences; the model names every variable
    that holds the first chain's value."""
    def make(rng: random.Random, size: int) -> Sample:
        names: list[str] = []
        while len(set(names)) < chains * (hops + 1):
            names.append("".join(rng.choices(string.ascii_uppercase, k=5)))
        names = list(dict.fromkeys(names))
        groups = [names[i:i + hops + 1] for i in range(0, chains * (hops + 1), hops + 1)]
        statements = [[f"VAR {g[0]} = {rng.randint(10000, 99999)}"] + [f"VAR {g[j + 1]} = VAR {g[j]} "
                                                                        for j in range(hops)] for g in groups]
        lines = [NOISE] * size
        for chain in statements:
            for offset, (index, statement) in enumerate(zip(sorted(rng.sample(range(len(lines)), len(chain))),
                                                            chain, strict=True)):
                lines.insert(index + offset, statement)
        value = statements[0][0].split("=")[-1].strip()
        return Sample(VT[0].format(context="\n".join(lines), query=value),
                      VT[1].format(num_v=hops + 1, query=value), tuple(groups[0]))
    return make


def word_list(rng: random.Random, count: int) -> list[str]:
    """`count` distinct words: the documentation's, then made-up ones of six letters where it has too few."""
    words = rng.sample(english_words(), min(count, len(english_words())))
    while len(words) < count:
        made = "".join(rng.choices(string.ascii_lowercase, k=6))
        if made not in words:
            words.append(made)
    return words


def common_words(short: bool) -> Callable[[random.Random, int], Sample]:
    """A numbered list of `size` distinct words, 10 of them repeated most often (30 times, the rest 3; 6 and 1
    under 4K tokens, as RULER does), after one solved example; the model names the 10."""
    def example(rng: random.Random, words: int, common_repeats: int, other_repeats: int) -> tuple[str, list[str]]:
        chosen = word_list(rng, words)
        listed = chosen[:10] * common_repeats + chosen[10:] * other_repeats
        rng.shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), chosen[:10]

    def make(rng: random.Random, size: int) -> Sample:
        shot_context, shot_answer = example(rng, *((20, 3, 1) if short else (40, 10, 3)))
        shot = CWE[0].format(context=shot_context) + CWE[1] + " " + " ".join(f"{i + 1}. {w}" for i, w in
                                                                              enumerate(shot_answer))
        context, answer = example(rng, size, *((6, 1) if short else (30, 3)))
        return Sample(shot + "\n" + CWE[0].format(context=context), CWE[1], tuple(answer))
    return make


def frequent_words(alpha: float = 2.0, vocabulary: int = 2000) -> Callable[[random.Random, int], Sample]:
    """`size` coded words of six letters drawn by a Zipf law of exponent `alpha` (the likeliest is "..." noise);
    the model names the three most frequent."""
    zeta = sum(k ** -alpha for k in range(1, 100_000))

    def make(rng: random.Random, size: int) -> Sample:
        coded: set[str] = set()
        while len(coded) < vocabulary:
            coded.add("".join(rng.choices(string.ascii_lowercase, k=6)))
        ranked = sorted(coded)
        rng.shuffle(ranked)
        ranked[0] = "..."
        words = [w for k, w in enumerate(ranked, 1) for _ in range(int(size * k ** -alpha / zeta))]
        rng.shuffle(words)
        return Sample(FWE[0].format(context=" ".join(words)), FWE[1], tuple(ranked[1:4]))
    return make


def question_answering(rows: list[dict]) -> Callable[[random.Random, int], Sample]:
    """A question from the user's QA file, its documents among `size` others drawn from the file, shuffled."""
    def make(rng: random.Random, size: int) -> Sample:
        row = rng.choice(rows)
        others = [d for r in rng.sample(rows, min(len(rows), size)) if r is not row for d in r["documents"]]
        documents = row["documents"] + others[:max(0, size - len(row["documents"]))]
        rng.shuffle(documents)
        context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(documents))
        return Sample(QA[0].format(context=context, query=row["question"]), QA[1], tuple(row["answers"]))
    return make


def synthetic_tasks(length: int) -> dict[str, Task]:
    """RULER's 11 synthetic tasks (scripts/synthetic.yaml) as they are made at `length` tokens."""
    return {task.name: task for task in (
        Task("niah_single_1", 128, "all", niah("noise")),
        Task("niah_single_2", 128, "all", niah("essay")),
        Task("niah_single_3", 128, "all", niah("essay", value="uuids")),
        Task("niah_multikey_1", 128, "all", niah("essay", keys=4), min_size=4),
        Task("niah_multikey_2", 128, "all", niah("needle")),
        Task("niah_multikey_3", 128, "all", niah("needle", key="uuids", value="uuids")),
        Task("niah_multivalue", 128, "all", niah("essay", values=4), min_size=4),
        Task("niah_multiquery", 128, "all", niah("essay", queries=4), min_size=4),
        Task("vt", 30, "all", variable_tracking(), min_size=5),
        Task("cwe", 120, "all", common_words(short=length < 4096), min_size=10),
        Task("fwe", 50, "all", frequent_words(vocabulary=max(10, (length - 50) // 50)), min_size=1),
    )}


TASK_NAMES = tuple(synthetic_tasks(4096)) + ("qa",)


def score(output: str, answers: tuple[str, ...], metric: str) -> float:
    """RULER's string match of one output, in [0, 100]: control characters made newlines and the ends stripped,
    then each answer looked for case-insensitively; "all": the share found, "part": 100 if any is."""
    text = re.sub(r"[\x00-\x1f]", "\n", output.strip()).strip().lower()
    found = [answer.lower() in text for answer in answers]
    return 100.0 * (sum(found) / len(found) if metric == "all" else float(any(found)))


def task_score(scores: list[float]) -> float:
    """A task's score: the mean of its samples', rounded to 2 decimals as RULER reports it."""
    return round(sum(scores) / len(scores), 2) if scores else math.nan
