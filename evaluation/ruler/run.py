"""`burst eval --ruler`: RULER's tasks (evaluation/ruler/tasks.py) fitted to each length, answered by greedy
generation across the cp ranks (evaluation/generate.py), scored by RULER's string match.

Each sample is fitted to its length exactly: the largest task size whose prompt, tokenized by the model's own
tokenizer, leaves room for the task's new tokens (prompt + new tokens <= length, RULER's rule). A model with a
chat template reads the task through it, the answer prefix after its generation prompt; a base model reads
RULER's plain prompt and the prefix. Results: a task x length table, the average per length, the effective
length (the longest length up to which every average reaches the threshold; RULER's is Llama-2-7B's 85.6 at
4K), and with --samples-out every sample, so that another engine can re-score them.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from data import Tokenizer
from data.chat import ChatFormat
from evaluation.generate import Stops, generate
from evaluation.ruler.tasks import TASK_NAMES, Sample, Task, question_answering, score, synthetic_tasks, task_score
from evaluation.sampling import Sampling
from runtime.directories import check_writable, write_atomically
from runtime.failure import writing
from runtime.memory import heap_for_large_tensors

DEFAULT_TASKS = tuple(name for name in TASK_NAMES if name != "qa")
DEFAULT_THRESHOLD = 85.6  # Llama-2-7B's average at 4K, RULER's bar for an effective length


@dataclass
class RulerSample:
    """One prompt as the model got it and what it answered (one line of --samples-out)."""

    task: str
    length: int
    prompt: str
    prompt_token_ids: list[int]
    answers: list[str]
    max_new_tokens: int
    output: str = ""
    score: float = 0.0


@dataclass
class RulerResult:
    tasks: list[str]
    lengths: list[int]
    scores: dict[str, dict[int, float]]  # task -> length -> score (0-100)
    threshold: float
    samples: list[RulerSample] = field(default_factory=list)

    def average(self, length: int) -> float:
        return round(sum(self.scores[t][length] for t in self.tasks) / len(self.tasks), 2)

    @property
    def effective_length(self) -> int | None:
        """The longest length up to which every length's average reaches the threshold; None: not even the first."""
        passing = None
        for length in self.lengths:
            if self.average(length) < self.threshold:
                break
            passing = length
        return passing

    def to_json(self) -> dict:
        return {"tasks": self.tasks, "lengths": self.lengths,
                "scores": {t: {str(n): s for n, s in by_length.items()} for t, by_length in self.scores.items()},
                "average": {str(n): self.average(n) for n in self.lengths}, "threshold": self.threshold,
                "effective_length": self.effective_length}


def read_qa(path: Path) -> list[dict]:
    """--ruler-qa: a .jsonl file of {"question": ..., "answers": [...], "documents": [...]} per line (the question's
    own documents; others' serve as distractors)."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--ruler-qa {path} line {number} is not JSON ({err})") from None
        if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                and all(isinstance(row.get(k), list) and row[k] and all(isinstance(x, str) for x in row[k])
                        for k in ("answers", "documents"))):
            raise ValueError(f"--ruler-qa {path} line {number} must hold {{\"question\": TEXT, \"answers\": [TEXT, "
                             f"...], \"documents\": [TEXT, ...]}}")
        rows.append(row)
    if not rows:
        raise ValueError(f"--ruler-qa {path} holds no question")
    return rows


def tasks_at(length: int, names: list[str], qa: list[dict] | None) -> list[Task]:
    every = synthetic_tasks(length)
    if qa is not None:
        every["qa"] = Task("qa", 32, "part", question_answering(qa))
    return [every[name] for name in names]


def prompt_of(sample: Sample, tokenizer: Tokenizer, chat: ChatFormat | None) -> tuple[str, list[int]]:
    """The text the model reads and its ids: through the chat template when there is one, then the answer prefix."""
    if chat is None:
        text = sample.text + sample.answer_prefix
        return text, ([tokenizer.bos_id] if tokenizer.bos_first else []) + tokenizer.encode(text)
    rendered, _ = chat.render_text([{"role": "user", "content": sample.text}], add_generation_prompt=True)
    text = rendered + sample.answer_prefix
    return text, tokenizer.encode(text)


def largest_fitting(fits, start: int, smallest: int) -> int | None:
    """The largest size >= `smallest` for which fits(size) holds (fits grows false with size), searched from the
    guess `start` by doubling steps, then halving them: a few tries near a good guess."""
    step = max(1, start // 64)
    if fits(start):
        low, high = start, start + step
        while fits(high):
            low, step = high, step * 2
            high = low + step
    else:
        high, low = start, start - step
        while low >= smallest and not fits(low):
            high, step = low, step * 2
            low = high - step
        if low < smallest:
            if not fits(smallest):
                return None
            low = smallest
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def fitted_sample(task: Task, length: int, index: int, seed: int, tokenizer: Tokenizer, chat: ChatFormat | None,
                  guess: int | None = None) -> tuple[RulerSample, int]:
    """Sample `index` of `task` at its largest size whose prompt + the task's new tokens fit `length` tokens, and
    that size (the guess for the next sample's search)."""
    budget = length - task.max_new_tokens
    made: dict[int, tuple[Sample, str, list[int]]] = {}

    def fits(size: int) -> bool:
        if size not in made:
            sample = task.make(random.Random(f"{seed}/{task.name}/{length}/{index}"), size)
            made[size] = (sample, *prompt_of(sample, tokenizer, chat))
        return len(made[size][2]) <= budget

    size = largest_fitting(fits, guess or task.min_size, task.min_size)
    if size is None:
        raise ValueError(f"--ruler-lengths {length} is too short for task {task.name}: its smallest prompt and "
                         f"{task.max_new_tokens} new tokens do not fit; use longer lengths")
    sample, text, ids = made[size]
    return RulerSample(task.name, length, text, ids, list(sample.answers), task.max_new_tokens), size


def make_samples(names: list[str], lengths: list[int], count: int, seed: int, tokenizer: Tokenizer,
                 chat: ChatFormat | None, qa: list[dict] | None) -> list[RulerSample]:
    """`count` samples of every task at every length, each fitted to its length."""
    samples = []
    for length in lengths:
        for task in tasks_at(length, names, qa):
            guess = None
            for index in range(count):
                sample, guess = fitted_sample(task, length, index, seed, tokenizer, chat, guess)
                samples.append(sample)
    return samples


BATCH_TOKENS = 32768  # --ruler-batch 0: the samples one batch holds, in tokens per rank


def batch_size(length: int, world_size: int, asked: int) -> int:
    """--ruler-batch: `asked`, or 0: as many samples of `length` tokens as BATCH_TOKENS per rank hold (the cache is
    ~46 KiB a token for SmolLM2 in float32: 1.5 GiB per rank, and as much again of activations at the prefill)."""
    return asked or max(1, BATCH_TOKENS * world_size // length)


def answer_samples(model, samples: list[RulerSample], tokenizer: Tokenizer, stops: Stops, group, say,
                   batch: int = 0) -> None:
    """Greedy answers to every sample, in place, scored as RULER scores them. The samples of one length and one
    number of new tokens are generated together, `batch_size` at a time (a row that ends leaves its batch), with
    freed tensors kept in the heap for the next (`heap_for_large_tensors`)."""
    world_size = 1 if group is None else group.size()
    groups: dict[tuple[int, int], list[RulerSample]] = {}
    for sample in samples:
        groups.setdefault((sample.length, sample.max_new_tokens), []).append(sample)
    done = 0
    with heap_for_large_tensors():
        for (length, new_tokens), members in groups.items():
            size = batch_size(length, world_size, batch)
            for start in range(0, len(members), size):
                chunk = members[start:start + size]
                outputs = generate(model, [s.prompt_token_ids for s in chunk], tokenizer, stops, new_tokens,
                                   Sampling(), group)
                for sample, out in zip(chunk, outputs, strict=True):
                    sample.output = out.text
                    sample.score = score(out.text, tuple(sample.answers), metric_of(sample))
                done += len(chunk)
                say(f"ruler: {done}/{len(samples)} samples answered")


def metric_of(sample: RulerSample) -> str:
    """The string match that scores `sample`'s task (qa: any answer; the others: every answer)."""
    return "part" if sample.task == "qa" else tasks_at(sample.length, [sample.task], None)[0].metric


def summarize(samples: list[RulerSample], names: list[str], lengths: list[int], threshold: float) -> RulerResult:
    scores = {t: {n: task_score([s.score for s in samples if s.task == t and s.length == n]) for n in lengths}
              for t in names}
    return RulerResult(names, lengths, scores, threshold, samples)


def ruler_table(result: RulerResult, title: str) -> Table:
    table = Table(title=title)
    table.add_column("task")
    for length in result.lengths:
        table.add_column(f"{length:,}", justify="right")
    for task in result.tasks:
        table.add_row(task, *(f"{result.scores[task][n]:.1f}" for n in result.lengths))
    table.add_row("average", *(f"{result.average(n):.1f}" for n in result.lengths), style="bold")
    effective = result.effective_length
    table.caption = f"effective length (threshold {result.threshold}): " + \
        (f"{effective:,}" if effective is not None else "none")
    return table


def write_samples(samples: list[RulerSample]) -> str:
    return "".join(json.dumps(asdict(s), ensure_ascii=False) + "\n" for s in samples)


def heatmap(result: RulerResult, path: Path) -> bool:
    """The task x length scores as a PNG at `path`; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [*result.tasks, "average"]
    values = [[result.scores[t][n] for n in result.lengths] for t in result.tasks] + \
        [[result.average(n) for n in result.lengths]]
    figure, axes = plt.subplots(figsize=(1.2 * len(result.lengths) + 3, 0.4 * len(rows) + 1.5))
    image = axes.imshow(values, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    axes.set_xticks(range(len(result.lengths)), [f"{n:,}" for n in result.lengths])
    axes.set_yticks(range(len(rows)), rows)
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            axes.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=8)
    axes.set_xlabel("tokens")
    figure.colorbar(image, label="score")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


@dataclass(frozen=True)
class RulerSettings:
    """`burst eval --ruler`'s settings (the flags --ruler-tasks, --ruler-lengths, --ruler-samples, --ruler-batch,
    --ruler-threshold, --ruler-qa, --samples-out; the seed is --seed)."""

    tasks: tuple[str, ...] = DEFAULT_TASKS
    lengths: tuple[int, ...] = (4096, 8192, 16384, 32768)
    samples: int = 10
    batch: int = 0  # samples generated together; 0: `batch_size` chooses by length
    seed: int = 0
    threshold: float = DEFAULT_THRESHOLD
    qa: Path | None = None
    samples_out: Path | None = None
    force: bool = False

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASK_NAMES]
        if unknown or not self.tasks:
            raise ValueError(f"--ruler-tasks: unknown task {unknown[0]!r}; choose among {', '.join(TASK_NAMES)}"
                             if unknown else "--ruler-tasks names no task")
        if ("qa" in self.tasks) != (self.qa is not None):
            raise ValueError("--ruler-qa FILE gives the questions of task qa: pass both or neither")
        if self.qa is not None and not self.qa.is_file():
            raise ValueError(f"--ruler-qa {self.qa} is not a file")
        if not self.lengths or min(self.lengths) < 256 or list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError(f"--ruler-lengths {','.join(map(str, self.lengths))} must be increasing lengths of at "
                             f"least 256 tokens, e.g. 4096,8192")
        if self.samples < 1:
            raise ValueError(f"--ruler-samples {self.samples} must be at least 1")
        if self.batch < 0:
            raise ValueError(f"--ruler-batch {self.batch} must be at least 1, or 0 (by length)")
        if not 0 <= self.threshold <= 100:
            raise ValueError(f"--ruler-threshold {self.threshold} must be a score between 0 and 100")
        if self.samples_out is not None:
            if self.samples_out.suffix.lower() != ".jsonl":
                raise ValueError(f"--samples-out {self.samples_out} must end in .jsonl (one sample per line)")
            if self.samples_out.exists() and not self.force:
                raise ValueError(f"--samples-out {self.samples_out} already exists; choose another file, or pass "
                                 f"--force")
            check_writable(self.samples_out)


def evaluate_ruler(model, tokenizer: Tokenizer, end_ids: frozenset[int], settings: RulerSettings, group, say,
                   console, json_path: Path | None, title: str) -> RulerResult:
    """Make, answer and score every sample; on rank 0 (`console` given) print the table and write the files."""
    chat = ChatFormat(tokenizer)
    chat = None if chat.is_plain else chat
    qa = read_qa(settings.qa) if settings.qa is not None else None
    say(f"ruler: {len(settings.tasks)} tasks x {len(settings.lengths)} lengths x {settings.samples} samples, "
        f"{'the chat template' if chat else 'plain prompts (no chat template)'}")
    samples = make_samples(list(settings.tasks), list(settings.lengths), settings.samples, settings.seed, tokenizer,
                           chat, qa)
    answer_samples(model, samples, tokenizer, Stops(end_ids), group, say, settings.batch)
    result = summarize(samples, list(settings.tasks), list(settings.lengths), settings.threshold)
    if console is None:
        return result
    console.print(ruler_table(result, title))
    if settings.samples_out is not None:
        with writing(settings.samples_out, kept="; the scores are the table printed above"):
            write_atomically(settings.samples_out, write_samples(samples))
        say(f"wrote {settings.samples_out}")
    if json_path is not None:
        with writing(json_path, kept="; the scores are the table printed above"):
            write_atomically(json_path, json.dumps({"ruler": result.to_json()}, indent=2) + "\n")
            plot = json_path.with_suffix(".png")
            drawn = heatmap(result, plot)
        # escaped: rich markup would eat the extra's "[plot]"
        say(escape(f"wrote {json_path}" + (f" and {plot}" if drawn else
                                           " (no heatmap: matplotlib is not installed; "
                                           "pip install 'burst-attention[plot]')")))
    return result
