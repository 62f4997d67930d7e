"""`burst eval`: perplexity, loss by position and passkey retrieval of a model checkpoint; on an instruction store,
the answers' loss and question answering on its validation conversations (evaluation/qa.py); on a preference
store, how the model ranks the chosen answers of its validation pairs (evaluation/preference.py).

    result = evaluate(EvalConfig(checkpoint=Path("out/model"), seq_len=4096, cp=2))

Every input is checked before the weights are read (style principle 8); the work itself lives
in perplexity.py and passkey.py, the output in report.py. With cp > 1 `evaluate` starts cp
local ranks itself, unless torchrun started them already; rank 0 prints and writes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from burst.groups import group_rank_and_size
from burst.kernels import check_kernel_name
from burst.layout import check_sequence_length
from data import Tokenizer, TokenStore, default_store, passkey_sample
from data.conversation_packing import check_policy
from data.loader import IGNORE_INDEX
from evaluation.checkpoint import EvalCheckpoint, check_tokenizer, load_for_eval, recorded_store
from evaluation.distributed import context_parallel_group, use_burst_attention
from evaluation.generate import use_decode_attention
from evaluation.generate_run import end_tokens, model_tokenizer
from evaluation.passkey import evaluate_passkey
from evaluation.perplexity import (
    POSITION_MODES,
    available_sequences,
    evaluate_perplexity,
    long_documents,
    packed_sequences,
)
from evaluation.preference import PreferenceResult, pair_logps, preference_table, summarize
from evaluation.preference import to_json as preference_json
from evaluation.qa import evaluate_qa
from evaluation.report import tables, write_files
from evaluation.result import EvalResult
from evaluation.ruler.run import RulerResult, RulerSettings, evaluate_ruler
from planner import RunShape
from planner.fit import check_fits
from runtime.console import make_console
from runtime.device import resolve_device
from runtime.directories import check_writable, write_atomically
from runtime.failure import WriteFailed, writing
from runtime.given import refuse_ignored
from runtime.launch import first_failure, local_world_size, run_local, under_torchrun
from runtime.precision import resolve_precision

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


RULER_IGNORES = ("data", "seq_len", "batches", "buckets", "positions", "passkey_lengths", "passkey_depths",
                 "passkey_trials", "qa_samples", "long_conversations", "reference", "beta")


class EvaluationFailed(RuntimeError):
    """The evaluation ran but its figures mean nothing (a non-finite loss); the message says why."""


@dataclass
class EvalConfig:
    """What to evaluate and how. passkey_lengths None: a quarter, half and all of seq_len."""

    checkpoint: Path
    data: Path | None = None  # token store; None: the one a run's checkpoint trained on, else the embedded corpus
    seq_len: int = 4096
    batches: int = 16  # validation sequences to score, one per batch; fewer if the split holds fewer
    buckets: int = 8  # equal position buckets for loss by position
    positions: str = "packed"  # a key of POSITION_MODES: packed training sequences, or document starts
    passkey_lengths: list[int] | None = None
    passkey_depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    passkey_trials: int = 5  # samples (different passkeys) per cell; 0 skips passkey retrieval
    cp: int = 1  # context-parallel ranks: started here, or by torchrun
    # a key of PRECISIONS, the dtype the weights are cast to; "auto": bf16 where the hardware computes in
    # bf16 natively (runtime/precision.py), resolved on construction (`precision_reason` says why)
    precision: str = "fp32"
    json_path: Path | None = None  # also write JSON here, and the loss-by-position PNG beside it
    force: bool = False  # replace an existing json_path (and its PNG)
    seed: int = 0  # of the passkeys
    long_conversations: str = "refuse"  # conversations longer than seq_len (data/conversation_packing.py)
    qa_samples: int = 32  # an instruction store's validation conversations answered; 0 skips question answering
    precision_reason: str = ""  # why `precision` is what it is (set on construction)
    reference: Path | None = None  # a preference store's reference model, for DPO's implicit rewards
    beta: float = 0.1  # the rewards' beta
    given: frozenset[str] = frozenset()  # the settings the user set (flags): one that does not apply is refused
    # auto, cpu or cuda (runtime/device.py; None: BURST_DEVICE, else auto), resolved on construction to the kind
    # the ranks run on (`device_reason` says why), so that ranks started here all take the same
    device: str | None = None
    device_reason: str = ""
    attention_kernel: str = "auto"  # the local attention kernel (burst.select_kernel's names), checked on construction
    ruler: RulerSettings | None = None  # --ruler: RULER's tasks instead of perplexity (evaluation/ruler/)

    def __post_init__(self) -> None:
        """Refuse values that cannot work, naming the flag; the checks that need files come later."""
        if self.ruler is not None:
            refuse_ignored(self.given, {name: "scores perplexity, passkeys or pairs, which --ruler does not run"
                                        for name in RULER_IGNORES})
        if self.json_path is not None and self.json_path.suffix.lower() != ".json":
            raise ValueError(f"--json {self.json_path} must end in .json: the plot is written beside it, with .png "
                             f"for .json; e.g. --json {self.json_path.with_suffix('.json')}")
        if self.json_path is not None and not self.force:
            existing = [p for p in (self.json_path, self.json_path.with_suffix(".png")) if p.exists()]
            if existing:
                raise ValueError(f"--json: {existing[0]} already exists; choose another file, or pass --force to "
                                 f"replace it")
        if self.json_path is not None:
            if self.json_path.is_dir():
                raise ValueError(f"--json {self.json_path} is a directory; pass a file, e.g. {self.json_path}.json")
            check_writable(self.json_path)  # a read-only or closed destination: refused before the weights are read
        if self.cp < 1:
            raise ValueError(f"--cp {self.cp} must be at least 1")
        check_sequence_length(self.seq_len, self.cp)
        if self.batches < 1:
            raise ValueError(f"--batches {self.batches} must be at least 1")
        if not 1 <= self.buckets <= self.seq_len:
            raise ValueError(f"--buckets {self.buckets} must be between 1 and --seq-len {self.seq_len}")
        if self.positions not in POSITION_MODES:
            raise ValueError(f"--positions {self.positions!r} is not one of {', '.join(POSITION_MODES)}")
        if self.precision not in (*PRECISIONS, "auto"):
            raise ValueError(f"--precision {self.precision!r} is not one of auto, {', '.join(PRECISIONS)}")
        where = resolve_device(self.device, local_ranks=local_world_size(self.cp),
                               ranks_flag="--cp")
        self.device, self.device_reason = where.kind, where.reason
        chosen = resolve_precision(self.precision, torch.device(where.kind))
        self.precision, self.precision_reason = chosen.name, chosen.reason
        check_policy(self.long_conversations)
        check_kernel_name(self.attention_kernel, "--attention-kernel")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"--beta {self.beta} must be a finite number above 0 (0.1 is TRL's default)")
        if self.qa_samples < 0:
            raise ValueError(f"--qa-samples {self.qa_samples} must be >= 0 (0 skips question answering)")
        if self.passkey_trials < 0:
            raise ValueError(f"--passkey-trials {self.passkey_trials} must be >= 0 (0 skips passkey retrieval)")
        if self.passkey_lengths is None:
            step = 2 * self.cp  # every length must split into the zigzag layout's 2 x cp chunks
            self.passkey_lengths = sorted({n - n % step for n in (self.seq_len // 4, self.seq_len // 2, self.seq_len)
                                           if n >= step})
        if self.passkey_trials and not (self.passkey_lengths and self.passkey_depths):
            raise ValueError("--passkey-lengths and --passkey-depths need at least one value each "
                             "(or pass --passkey-trials 0 to skip passkey retrieval)")
        for length in self.passkey_lengths:
            try:
                check_sequence_length(length, self.cp)
            except ValueError as err:
                raise ValueError(f"--passkey-lengths: {err}") from None
        for depth in self.passkey_depths:
            if not 0 <= depth <= 1:
                raise ValueError(f"--passkey-depths: depth {depth} must be in [0, 1] (0 = start, 1 = end)")


@dataclass
class EvalInputs:
    """Everything `evaluate` reads, opened and checked before any weight is loaded."""

    checkpoint: EvalCheckpoint
    store: TokenStore
    tokenizer: Tokenizer
    sequences: int  # validation sequences that will be scored
    warnings: list[str]


def available_val_sequences(config: EvalConfig, store: TokenStore) -> int:
    """How many sequences of `config.seq_len` the validation split offers in mode `config.positions`.

    Refuses a split that offers none, saying how to get one.
    """
    val = store.split("val")
    if config.reference is not None and not store.is_preferences:
        raise ValueError(f"--reference scores preference pairs against a reference model, but {store.directory} is "
                         f"not a preference store (`burst prepare --preference`); drop --reference")
    if store.is_preferences:
        if config.positions == "document" or val.num_documents == 0:
            raise ValueError(f"{store.directory} is a preference store: its validation pairs are scored whole, "
                             + ("packed as training packs them; drop --positions document" if val.num_documents else
                                "but it holds none; prepare it with --val-fraction above 0"))
        return val.num_documents
    if config.positions == "document" and store.is_conversations:
        raise ValueError(f"--positions document scores the starts of long documents, but {store.directory} is an "
                         f"instruction store, scored on its answers: use --positions packed (its conversations packed "
                         f"as training packs them, a position the depth into a conversation)")
    if config.positions == "document":
        available = len(long_documents(val, config.seq_len))
        if available == 0:
            longest = int(val.document_lengths.max(initial=0))
            raise ValueError(f"--positions document scores validation documents of at least --seq-len "
                             f"{config.seq_len:,} tokens, but the validation split of {store.directory} holds "
                             f"{val.num_documents} documents, the longest of {longest:,} tokens; lower --seq-len, "
                             f"or prepare a store with longer documents or a larger --val-fraction")
        return available
    if store.is_conversations and val.num_documents == 0:
        raise ValueError(f"the validation split of {store.directory} holds no conversation; prepare the store with "
                         f"--val-fraction above 0")
    available = available_sequences(val, config.seq_len, config.long_conversations)
    if available == 0:
        raise ValueError(f"the validation split of {store.directory} has {val.num_tokens:,} tokens in "
                         f"{val.num_documents} documents, not enough for one sequence of {config.seq_len:,}; "
                         f"lower --seq-len, or prepare the store with a larger --val-fraction")
    return available


def open_inputs(config: EvalConfig) -> EvalInputs:
    """Open checkpoint and data and check that they fit each other and the config."""
    checkpoint = load_for_eval(config.checkpoint)
    store = TokenStore(eval_store(config))
    check_tokenizer(checkpoint, store)
    if config.reference is not None:
        check_tokenizer(load_for_eval(config.reference), store)
    available = available_val_sequences(config, store)
    refuse_ignored(config.given, ignored_settings(config, store))
    tokenizer = store.tokenizer()
    if config.passkey_trials and not store.is_preferences:  # no passkey runs on preference pairs
        for trial in range(config.passkey_trials):  # the passkey's digits may tokenize to different lengths
            try:
                passkey_sample(tokenizer, min(config.passkey_lengths), 0.0, seed=config.seed + trial)
            except ValueError as err:
                raise ValueError(f"--passkey-lengths: {err}; use longer lengths") from None
    warnings = []
    if available < config.batches:
        held = "documents of at least" if config.positions == "document" else "sequences of"
        warnings.append(f"the validation split holds {available} {held} {config.seq_len:,} tokens; "
                        f"scoring {available}, not --batches {config.batches}")
    max_seq_len = checkpoint.config.max_seq_len
    longest = max([config.seq_len] + (config.passkey_lengths if config.passkey_trials and not store.is_preferences
                                       else []))
    if longest > max_seq_len:
        warnings.append(f"sequences of up to {longest:,} tokens are longer than the model's max_seq_len "
                        f"{max_seq_len:,}: positions past it were never trained, so expect worse results there")
    sequences = min(available, config.batches)
    if store.is_conversations:
        check_answers_scored(config, store, sequences)
    return EvalInputs(checkpoint=checkpoint, store=store, tokenizer=tokenizer, sequences=sequences,
                      warnings=warnings)


def eval_store(config: EvalConfig) -> Path:
    """The store to score: --data, else the one the checkpoint's run trained on, else the embedded corpus."""
    if config.data is not None:
        return config.data
    recorded = recorded_store(config.checkpoint)
    if recorded is None:
        return default_store()
    path, origin = recorded
    if not path.exists():
        raise ValueError(f"--data not given, and the store {path} that {config.checkpoint}'s run trained on ({origin}) "
                         f"no longer exists; pass --data STORE")
    return path


def ignored_settings(config: EvalConfig, store: TokenStore) -> dict[str, str]:
    """The settings this evaluation of `store` never reads, each with why."""
    ignored = {}
    if store.is_preferences:
        what = "is for a store of documents or conversations; a preference store's pairs are scored by their answers"
        ignored.update({name: what for name in ("passkey_trials", "passkey_lengths", "passkey_depths")})
        ignored["qa_samples"] = "is for an instruction store's conversations; a preference store's pairs are ranked"
        ignored["batches"] = ("counts the sequences perplexity scores; a preference store's validation pairs are all "
                              "ranked")
    elif not store.is_conversations:
        ignored["qa_samples"] = ("is for an instruction store's conversations (`burst prepare --chat`); "
                                 f"{store.directory} holds documents")
    if config.passkey_trials == 0:
        ignored.update({name: "places the passkeys, and --passkey-trials 0 skips passkey retrieval"
                        for name in ("passkey_lengths", "passkey_depths")})
    if config.reference is None:
        ignored["beta"] = "scales DPO's implicit rewards against --reference, which is not given"
    return ignored


def check_answers_scored(config: EvalConfig, store: TokenStore, sequences: int) -> None:
    """Refuse to score `sequences` of an instruction store's validation conversations that hold no answer token:
    their loss would be 0 / 0, which says nothing of the model (reading them needs no weights)."""
    shards = packed_sequences(store.split("val"), config.seq_len, sequences, 0, 1, config.long_conversations)
    if any(int((shard.labels != IGNORE_INDEX).sum()) for shard in shards):
        return
    split = config.long_conversations == "split"
    raise ValueError(f"the {sequences} validation sequence{'s' if sequences > 1 else ''} of {config.seq_len:,} "
                     f"tokens of {store.directory} that --batches {config.batches} scores hold no answer token (an "
                     f"instruction store scores only its answers"
                     + (", and --long-conversations split cuts conversations into pieces, the first ones prompts "
                        "only" if split else "") + "): their loss says nothing; raise --seq-len or --batches"
                     + (", use --long-conversations truncate" if split else "") + ", or evaluate another store")


def evaluate_pairs(config: EvalConfig, inputs: EvalInputs, model: torch.nn.Module, group: dist.ProcessGroup | None,
                   device: torch.device, say, console: Console | None, started: float) -> PreferenceResult:
    """A preference store's validation pairs: the policy's log-probabilities, its ranking, and with --reference
    DPO's implicit rewards; printed (rank 0, `console`) and written with --json."""
    val = inputs.store.split("val")
    say(f"preference pairs: {val.num_documents:,} validation pairs of {inputs.store.directory}, packed into "
        f"{config.seq_len:,}-token sequences")
    logps, counts = pair_logps(model, val, config.seq_len, group, config.long_conversations)
    reference = None
    if config.reference is not None:
        say(f"reference: {config.reference}")
        reference_model = load_for_eval(config.reference).model(device, PRECISIONS[config.precision])
        use_burst_attention(reference_model, group, config.attention_kernel)
        reference, _ = pair_logps(reference_model, val, config.seq_len, group, config.long_conversations)
    try:
        result = summarize(logps, counts, reference, config.beta)
    except ValueError as err:
        raise EvaluationFailed(f"{config.checkpoint}: {err}") from None
    seconds = time.perf_counter() - started
    if console is not None:
        console.print(preference_table(result, config.checkpoint, inputs.store.directory, seconds))
        if config.json_path is not None:
            with writing(config.json_path, kept="; the results are the table printed above"):
                write_atomically(config.json_path, json.dumps(preference_json(
                    result, config.checkpoint, inputs.store.directory, config.reference, seconds), indent=2) + "\n")
            say(f"wrote {config.json_path}")
    return result


def check_memory(config: EvalConfig) -> None:
    """Refuse an evaluation whose ranks cannot fit, before any rank starts or any data is read: the planner's fit
    check of its longest sequence, forward only (the weights in its precision, one block's activations, attention's
    buffers and the loss's chunk)."""
    longest = max([config.seq_len] + (config.passkey_lengths if config.passkey_trials else []))
    if config.ruler is not None:
        longest = max(config.ruler.lengths)
    shape = RunShape(seq_len=longest, cp=config.cp, precision=config.precision, forward_only=True,
                     models=1 if config.reference is None else 2)  # --reference: its model is held beside
    check_fits(shape, load_for_eval(config.checkpoint).config, local_world_size(config.cp),
               config.device)


def evaluate(config: EvalConfig, console: Console | None = None) -> EvalResult | PreferenceResult | RulerResult:
    """Evaluate `config.checkpoint`; print tables on rank 0 and, with `json_path`, write the JSON and PNG there."""
    check_memory(config)
    if config.cp > 1 and not dist.is_initialized() and not under_torchrun():
        # bad input is refused here, once, rather than as a crash of every rank
        if config.ruler is not None:
            model_tokenizer(load_for_eval(config.checkpoint))
        else:
            open_inputs(config)
        try:
            return run_local(evaluate, nproc=config.cp, args=(config,))[0]  # each rank's device, threads: worker_device
        except ChildFailedError as err:  # what the weights turned out to hold: one message, as in one process
            rank, error_type, text, traceback = first_failure(err)
            if error_type == "ValueError":
                raise ValueError(f"rank {rank}: {text}") from None
            if error_type == "WriteFailed":  # --json on a full disk: the same line as in one process
                raise WriteFailed(f"rank {rank}: {text}") from None
            raise EvaluationFailed(f"rank {rank}: {text}" if error_type == "EvaluationFailed" else
                                   f"rank {rank}: {error_type}: {text}\n{traceback}" if error_type else
                                   f"rank {rank} {text}") from None
    started = time.perf_counter()
    console = console or make_console()  # the results: stdout, for a pipe or a file
    log = make_console(stderr=True)  # what happens meanwhile
    with context_parallel_group(config.cp, config.device) as (group, device):
        is_main = group_rank_and_size(group)[0] == 0
        say = log.print if is_main else lambda *_: None
        if config.ruler is not None:
            return ruler(config, group, device, say, console if is_main else None)
        inputs = open_inputs(config)
        for warning in inputs.warnings:
            say(f"[yellow]warning:[/] {escape(warning)}")
        model = inputs.checkpoint.model(device, PRECISIONS[config.precision])
        use_burst_attention(model, group, config.attention_kernel)
        say(f"weights in {config.precision} ({config.precision_reason}), on {config.device} ({config.device_reason})")
        if inputs.store.is_preferences:
            return evaluate_pairs(config, inputs, model, group, device, say, console if is_main else None, started)
        conversations = inputs.store.is_conversations
        say(f"perplexity: {inputs.sequences} x {config.seq_len:,} tokens of {inputs.store.directory} (val), "
            f"positions {config.positions}" + (", answers scored" if conversations else ""))
        perplexity = evaluate_perplexity(model, inputs.store.split("val"), config.seq_len, inputs.sequences,
                                         config.buckets, group, positions=config.positions,
                                         long_conversations=config.long_conversations,
                                         progress=lambda n: say(f"perplexity: sequence {n} of {inputs.sequences} "
                                                                f"scored ({time.perf_counter() - started:.0f} s)"))
        if not math.isfinite(perplexity.perplexity):
            raise EvaluationFailed(f"the loss of {config.checkpoint} on {inputs.store.directory} is {perplexity.loss} "
                                   f"(perplexity {perplexity.perplexity}): the model diverged or its weights are "
                                   f"damaged; evaluate an earlier checkpoint")
        passkey = None
        if config.passkey_trials:
            say(f"passkey: lengths {config.passkey_lengths}, depths {config.passkey_depths}, "
                f"{config.passkey_trials} trials each")
            passkey = evaluate_passkey(model, inputs.tokenizer, config.passkey_lengths, config.passkey_depths,
                                       config.passkey_trials, group, config.seed, answered(say, "passkey", started))
        qa = None
        if conversations and config.qa_samples:
            say(f"question answering: the last answer of up to {config.qa_samples} validation conversations of at "
                f"most {config.seq_len:,} tokens")
            qa = evaluate_qa(model, inputs.store.split("val"), inputs.tokenizer, config.seq_len, config.qa_samples,
                             group, answered(say, "question answering", started))
    result = EvalResult(checkpoint=config.checkpoint, format=inputs.checkpoint.format, data=inputs.store.directory,
                        cp=config.cp, precision=config.precision, perplexity=perplexity, passkey=passkey,
                        warnings=inputs.warnings, seconds=time.perf_counter() - started, qa=qa)
    if is_main:
        for table in tables(result):
            console.print(table)
        if config.json_path is not None:
            plot = write_files(result, config.json_path)
            if plot is None:
                say(f"[yellow]warning:[/] {escape(result.warnings[-1])}")
            say(f"wrote {config.json_path}" + (f" and {plot}" if plot else ""))
    return result



def answered(say, probe: str, started: float) -> Callable[[int, int], None]:
    """A probe's progress line (on stderr, where `say` prints) after its first, every tenth and its last sample,
    as RULER's, so that minutes of long samples show they are under way."""
    def progress(done: int, total: int) -> None:
        if done == 1 or done % 10 == 0 or done == total:
            say(f"{probe}: {done}/{total} samples answered ({time.perf_counter() - started:.0f} s)")
    return progress


def ruler(config: EvalConfig, group: dist.ProcessGroup | None, device: torch.device, say,
          console: Console | None) -> RulerResult:
    """`burst eval --ruler`: RULER's tasks answered by the model across the group (evaluation/ruler/)."""
    checkpoint = load_for_eval(config.checkpoint)
    tokenizer = model_tokenizer(checkpoint)
    model = checkpoint.model(device, PRECISIONS[config.precision])
    use_decode_attention(model, group, kernel=config.attention_kernel)
    say(f"weights in {config.precision} ({config.precision_reason}), on {config.device} ({config.device_reason})")
    return evaluate_ruler(model, tokenizer, end_tokens(checkpoint, tokenizer), config.ruler, group, say, console,
                          config.json_path, f"RULER, cp {config.cp}")
