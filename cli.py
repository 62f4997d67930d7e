"""The `burst` command line: a thin Typer layer over plain functions in burst/, models/, data/.

Each command parses flags, builds a config and calls one function; no logic lives here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib.metadata
import inspect
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer

from runtime.failure import Stopped, WriteFailed, os_error_message, stopping_on_sigterm  # plain Python: no torch
from runtime.settings import flag, shown_default, value_kind  # plain Python: no torch
from trainer.config import TrainConfig  # plain Python: no torch

# Plain help (rich_markup_mode None): at 80 columns rich's four-column boxes cut flags and defaults off.
app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False,
                  rich_markup_mode=None, help="Long-context LLaMA training with exact BurstAttention sequence "
                                              "parallelism.")
bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Benchmarks.")
app.add_typer(bench_app, name="bench")


def _print_version(asked: bool) -> None:
    if asked:
        try:
            version = importlib.metadata.version("burst-attention")
        except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
            version = "(not installed: pip install -e .)"
        typer.echo(f"burst {version}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print burst's version and exit.")) -> None:
    """Long-context LLaMA training with exact BurstAttention sequence parallelism."""


def _fail(message: object, code: int) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


@contextlib.contextmanager
def _exits(failed: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """How prepare, convert-checkpoint and eval end: one line on stderr and exit 2 for bad input refused before any
    work (ValueError, ImportError, or an OSError such as a read-only destination), 1 when work under way failed
    (WriteFailed: disk full; or one of `failed`), 130 after Ctrl-C and 143 after SIGTERM, whose temporaries the
    command removes as it stops."""
    try:
        with stopping_on_sigterm():
            yield
    except (WriteFailed, *failed) as err:
        raise _fail(err, 1) from None
    except (ValueError, ImportError) as err:
        raise _fail(err, 2) from None
    except OSError as err:
        raise _fail(os_error_message(err), 2) from None
    except KeyboardInterrupt:
        raise _fail("interrupted by Ctrl-C; what it had begun to write was removed", 130) from None
    except Stopped as err:
        raise _fail(f"{err}; what it had begun to write was removed", err.exit_code) from None


def _options(names: tuple[str, ...] | None = None) -> list[inspect.Parameter]:
    """The options of TrainConfig's settings `names` (None: all), each as its field declares it: --name
    (--name/--no-name for a switch), its type, help and default shown. Every option defaults to None, so an unset
    flag leaves the config file's value (flags > config file > defaults), or the command's own default."""
    hints = typing.get_type_hints(TrainConfig)
    parameters = []
    for setting in dataclasses.fields(TrainConfig):
        if names is not None and setting.name not in names:
            continue
        kind, name = value_kind(hints[setting.name]), flag(setting.name)
        option = typer.Option(None, f"{name}/--no-{name[2:]}" if kind is bool else name,
                              help=setting.metadata["help"], show_default=shown_default(setting))
        parameters.append(inspect.Parameter(setting.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                            annotation=kind | None))
    return parameters


def _taking(*names: str) -> Callable[[Any], Any]:
    """A decorator: the command takes TrainConfig's settings `names` as options besides its own (into its
    **keywords), declared once there; train, eval and bench take --device and --attention-kernel alike."""
    def taking(command: Any) -> Any:
        own = [p for p in inspect.signature(command).parameters.values() if p.kind is not p.VAR_KEYWORD]
        command.__signature__ = inspect.Signature([*own, *_options(names)])
        return command
    return taking


# What every command that runs attention takes: where its ranks run, and with which local kernel.
PLACEMENT = ("device", "attention_kernel")


class TargetFormat(str, enum.Enum):
    burst = "burst"
    hf = "hf"
    peft = "peft"


@app.command("convert-checkpoint")
def convert_checkpoint_command(
    src: Path = typer.Argument(..., help="Checkpoint directory to convert (format detected): Hugging Face, native, "
                                         "a training checkpoint, or a run directory (its newest checkpoint)."),
    dst: Path = typer.Argument(..., help="Directory to write; created only once complete."),
    to: TargetFormat = typer.Option(..., "--to", help="Format to write: burst (native), hf (Hugging Face; a LoRA "
                                                           "run's adapter merged in) or peft (a LoRA run's adapter "
                                                           "alone, for PEFT)."),
    force: bool = typer.Option(False, "--force", help="Replace DST if it is a model directory burst wrote."),
) -> None:
    """Convert a model checkpoint between the Hugging Face LLaMA and native formats.

    Exits 2 on bad input (refused before any work), 1 when a write failed during the work (disk full), 130 after
    Ctrl-C and 143 after SIGTERM; DST is then as it was.
    """
    from checkpoints import convert_checkpoint  # here, so `burst --help` does not import torch

    with _exits():
        convert_checkpoint(src, dst, to=to.value, force=force)
    typer.echo(f"wrote {dst} ({to.value})")


@app.command("prepare")
def prepare_command(
    inputs: list[Path] = typer.Argument(..., help="Text/source files, .jsonl(.gz), .parquet, or directories."),
    out: Path = typer.Option(..., "--out", help="Token store directory to write; created only once complete."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="Existing tokenizer to use: a Hugging Face "
                                                                    "tokenizer.json, a SentencePiece .model, or a "
                                                                    "model directory holding one."),
    vocab_size: int | None = typer.Option(None, "--vocab-size", help="Train a tokenizer of this size (32000)."),
    text_field: str | None = typer.Option(None, "--text-field", help="Field holding the text in .jsonl/.parquet "
                                                                     "(text)."),
    val_fraction: float = typer.Option(0.01, "--val-fraction", help="Fraction of documents for validation."),
    workers: int | None = typer.Option(None, "--workers", help="SentencePiece encoding threads (default: all "
                                                               "cores; a tokenizer.json uses all, or "
                                                               "RAYON_NUM_THREADS)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the tokenizer sample and the validation split."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it is a token store."),
    chat: bool = typer.Option(False, "--chat", help="The rows are conversations (`messages`, or `prompt` and "
                                                    "`completion`): render them with the tokenizer's chat template "
                                                    "(or burst's plain one) into an instruction store that marks the "
                                                    "answers. Needs --tokenizer."),
    preference: bool = typer.Option(False, "--preference", help="The rows are preference pairs (`prompt`, `chosen`, "
                                                                "`rejected`: TRL's format): render them with the "
                                                                "tokenizer's chat template into a preference store "
                                                                "for --objective dpo|ipo|simpo|orpo. Needs "
                                                                "--tokenizer."),
) -> None:
    """Tokenize a corpus into a token store for training, or conversations into an instruction store (--chat).

    Exits 2 on bad input (refused before any work: OUT busy or not a store, unreadable inputs), 1 when a write
    failed during the work (disk full), 130 after Ctrl-C and 143 after SIGTERM; OUT is then as it was.
    """
    from data.prepare import prepare  # here, so `burst --help` does not import torch

    with _exits():
        prepare(inputs, out, tokenizer=tokenizer, vocab_size=vocab_size, text_field=text_field,
                val_fraction=val_fraction, workers=workers, seed=seed, force=force, chat=chat, preference=preference)


def _number_list(text: str | None, kind: type, flag: str) -> list | None:
    """'1024,2048' -> [1024, 2048]; None stays None (the config's default)."""
    if text is None:
        return None
    try:
        return [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated {kind.__name__} values, got {text!r}",
                                 param_hint=flag) from None


@app.command("eval")
@_taking(*PLACEMENT)
def eval_command(
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Run directory, training checkpoint, or native / "
                                                              "Hugging Face model directory."),
    data: Path | None = typer.Option(None, "--data", help="Token store (default: the one a run's checkpoint "
                                                         "trained on, else the embedded stdlib corpus)."),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Tokens per validation sequence (4096)."),
    batches: int | None = typer.Option(None, "--batches", help="Validation sequences to score (16)."),
    buckets: int | None = typer.Option(None, "--buckets", help="Position buckets for loss by position (8)."),
    positions: str | None = typer.Option(None, "--positions",
                                         help="packed: the training stream's sequences; document: the start of "
                                              "validation documents of at least --seq-len tokens, so position = "
                                              "depth into the document (packed)."),
    passkey_lengths: str | None = typer.Option(None, "--passkey-lengths",
                                               help="Passkey sample lengths, e.g. 1024,2048 (seq-len/4, /2, 1)."),
    passkey_depths: str | None = typer.Option(None, "--passkey-depths", help="Needle depths (0,0.25,0.5,0.75,1)."),
    passkey_trials: int | None = typer.Option(None, "--passkey-trials", help="Samples per cell; 0 skips (5)."),
    qa_samples: int | None = typer.Option(None, "--qa-samples", help="An instruction store's validation "
                                                                     "conversations whose last answer the model "
                                                                     "must give; 0 skips (32)."),
    long_conversations: str | None = typer.Option(None, "--long-conversations",
                                                  help="An instruction store's conversations longer than --seq-len: "
                                                       "refuse, truncate or split, as in training (refuse)."),
    cp: int | None = typer.Option(None, "--cp", help="Context-parallel ranks, started here or by torchrun (1)."),
    precision: str | None = typer.Option(None, "--precision", help="Weights dtype: fp32, bf16 or auto (bf16 where "
                                                                   "the hardware has it natively) (fp32)."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the results to this .json file, and a PNG plot "
                                                                "beside it (same name, .png)."),
    force: bool = typer.Option(False, "--force", help="Replace the --json file (and its PNG) if they exist."),
    reference: Path | None = typer.Option(None, "--reference", help="A preference store's reference model (a run, "
                                                                    "checkpoint or model directory): report DPO's "
                                                                    "implicit rewards against it."),
    beta: float | None = typer.Option(None, "--beta", help="The implicit rewards' beta, with --reference (0.1)."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the passkeys and of RULER's samples (0)."),
    ruler: bool = typer.Option(False, "--ruler", help="Run RULER's tasks instead (docs/evaluation.md#ruler): "
                                                      "generation, scored by string match."),
    ruler_tasks: str | None = typer.Option(None, "--ruler-tasks", help="RULER tasks, comma-separated (the 11 "
                                                                       "synthetic ones; qa needs --ruler-qa)."),
    ruler_lengths: str | None = typer.Option(None, "--ruler-lengths", help="Prompt lengths in tokens, new tokens "
                                                                           "included (4096,8192,16384,32768)."),
    ruler_samples: int | None = typer.Option(None, "--ruler-samples", help="Samples per task and length (10)."),
    ruler_batch: int | None = typer.Option(None, "--ruler-batch", help="Samples generated together (0: as many as "
                                                                       "32,768 tokens per rank hold)."),
    ruler_threshold: float | None = typer.Option(None, "--ruler-threshold", help="The average an effective length "
                                                                                 "reaches (85.6, RULER's)."),
    ruler_qa: Path | None = typer.Option(None, "--ruler-qa", help="A .jsonl file of {\"question\", \"answers\", "
                                                                  "\"documents\"} per line: task qa."),
    samples_out: Path | None = typer.Option(None, "--samples-out", help="Write every RULER sample (prompt, ids, "
                                                                        "answers, output, score) to this .jsonl."),
    **placement: Any,
) -> None:
    """Perplexity, loss by position and passkey retrieval of a model checkpoint: results on stdout. On an
    instruction store (`burst prepare --chat`): the answers' loss, and question answering by depth. On a preference
    store (`burst prepare --preference`): the policy's log-probabilities of the chosen and rejected answers of the
    validation pairs, how often it prefers the chosen one, and with --reference DPO's reward accuracy and margin.

    With --cp N it starts N local ranks; on several machines start them with torchrun instead.
    Exits 2 on bad input, 1 when the model's loss is not finite (a diverged or damaged model).
    """
    from evaluation import EvalConfig, evaluate  # here, so `burst --help` does not import torch
    from evaluation.run import EvaluationFailed

    flags = dict(data=data, seq_len=seq_len, batches=batches, buckets=buckets, positions=positions,
                 passkey_trials=passkey_trials, qa_samples=qa_samples, long_conversations=long_conversations,
                 passkey_lengths=_number_list(passkey_lengths, int, "--passkey-lengths"),
                 passkey_depths=_number_list(passkey_depths, float, "--passkey-depths"),
                 cp=cp, precision=precision, json_path=json_path, reference=reference, beta=beta, **placement)
    with _exits(failed=(EvaluationFailed,)):
        given = {name: v for name, v in flags.items() if v is not None}
        ruler_settings = _ruler_settings(ruler, ruler_tasks, ruler_lengths, ruler_samples, ruler_batch,
                                         ruler_threshold, ruler_qa, samples_out, seed, force)
        eval_config = EvalConfig(checkpoint=checkpoint, force=force, given=frozenset(given), ruler=ruler_settings,
                                 **given, **({"seed": seed} if seed is not None else {}))
        evaluate(eval_config)


def _ruler_settings(ruler: bool, tasks: str | None, lengths: str | None, samples: int | None, batch: int | None,
                    threshold: float | None, qa: Path | None, samples_out: Path | None, seed: int | None, force: bool):
    """--ruler's settings, or None without --ruler (refusing a --ruler-* flag given without it)."""
    from evaluation.ruler.run import RulerSettings

    given = {"tasks": tasks and tuple(_name_list(tasks)),
             "lengths": tuple(_number_list(lengths, int, "--ruler-lengths") or ()) or None,
             "samples": samples, "batch": batch, "threshold": threshold, "qa": qa, "samples_out": samples_out}
    given = {name: value for name, value in given.items() if value is not None}
    if not ruler:
        if given:
            flag = f"--{'samples-out' if 'samples_out' in given else 'ruler-' + next(iter(given))}"
            raise ValueError(f"{flag} is a setting of RULER; add --ruler, or drop it")
        return None
    return RulerSettings(**given, seed=seed or 0, force=force)


@app.command("generate")
@_taking(*PLACEMENT)
def generate_command(
    model: Path = typer.Option(..., "--model", help="Run directory, training checkpoint, or native / Hugging Face "
                                                    "model directory (with its tokenizer)."),
    prompt: str | None = typer.Option(None, "--prompt", help="The prompt text."),
    prompt_file: Path | None = typer.Option(None, "--prompt-file", help="A .jsonl file of {\"prompt\": ...} or "
                                            "{\"messages\": [...]} per line, or any other file: one prompt."),
    output: Path | None = typer.Option(None, "--output", help="Also write one JSON object per prompt to this "
                                                              ".jsonl file (text, token_ids, prompt_token_ids, "
                                                              "finish_reason)."),
    force: bool = typer.Option(False, "--force", help="Replace the --output file if it exists."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Tokens to generate at most per prompt."),
    chat: bool = typer.Option(False, "--chat", help="Give plain prompts to the model's chat template as a user "
                                                    "message (.jsonl messages always go through it)."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling: keep the likeliest tokens up to this "
                                                     "probability (1: all)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k likeliest tokens (0: all)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling: the same tokens at every --cp."),
    stop: list[str] = typer.Option([], "--stop", help="A string that ends the generation (repeatable); EOS "
                                                      "always does."),
    batch_size: int = typer.Option(1, "--batch-size", help="Prompts generated together, padded to one length."),
    cp: int = typer.Option(1, "--cp", help="Context-parallel ranks that share the prompt and its KV cache."),
    layout: str = typer.Option("zigzag", "--layout", help="How the prompt is cut over the ranks: zigzag or "
                                                          "balanced."),
    precision: str = typer.Option("fp32", "--precision", help="Weights dtype: fp32, bf16 or auto."),
    **placement: Any,
) -> None:
    """Generate text from a model: texts on stdout, prefill and decode tokens/s on stderr.

    With --cp N it starts N local ranks: the prompt is read by BurstAttention over them, each keeping its slice of
    the KV cache. Exits 2 on bad input.
    """
    from evaluation.generate_run import GenerateConfig, Prompt, read_prompts, run_generate

    with _exits():
        if (prompt is None) == (prompt_file is None):
            raise ValueError("give one of --prompt TEXT or --prompt-file FILE")
        prompts = [Prompt(text=prompt)] if prompt is not None else read_prompts(prompt_file)
        run_generate(GenerateConfig(model=model, prompts=prompts, output=output, force=force,
                                    max_new_tokens=max_new_tokens, chat=chat, temperature=temperature, top_p=top_p,
                                    top_k=top_k, seed=seed, stop=stop, batch_size=batch_size, cp=cp, layout=layout,
                                    precision=precision,
                                    **{name: value for name, value in placement.items() if value is not None}))


@bench_app.command("attention")
@_taking(*PLACEMENT)
def bench_attention_command(
    nproc: int = typer.Option(2, "--nproc", help="Local ranks the sequence is split across."),
    seq_len: int = typer.Option(8192, "--seq-len", help="Global sequence length (a multiple of 2 x nproc)."),
    heads: int = typer.Option(8, "--heads", help="Query heads."),
    kv_heads: int | None = typer.Option(None, "--kv-heads", help="Key/value heads (default: --heads)."),
    head_dim: int = typer.Option(64, "--head-dim"),
    batch: int = typer.Option(1, "--batch"),
    dtype: str = typer.Option("auto", "--dtype", help="bf16, fp16, fp32 or auto (bf16 where the hardware has it "
                                                      "natively, else fp32)."),
    causal: bool = typer.Option(True, "--causal/--non-causal"),
    iters: int = typer.Option(2, "--iters", help="Timed iterations after one warm-up."),
    modes: str = typer.Option("burst,ring", "--modes", help="Backward modes to run: burst, ring, auto."),
    doc_length: int | None = typer.Option(None, "--doc-length",
                                          help="Also run document-masked, packing documents of this many tokens."),
    layouts: str | None = typer.Option(None, "--layouts", help="Sequence layouts of the document-masked runs, side "
                                                               "by side: zigzag, balanced (default: zigzag; with "
                                                               "--docs both)."),
    docs: Path | None = typer.Option(None, "--docs", help="Token store: time and count real packed sequences, "
                                                          "packed as `burst train --doc-mask` packs them."),
    sequences: int = typer.Option(32, "--sequences", help="With --docs: packed sequences to plan."),
    plan_only: bool = typer.Option(False, "--plan-only", help="With --docs or --window: count the plans only, run "
                                                              "no kernel (any --nproc and --seq-len on any machine)."),
    window: int | None = typer.Option(None, "--window", help="Sliding window W (a query at i sees keys i - W < j <= "
                                                             "i): windowed runs beside full causal ones, and each "
                                                             "rank's kernel calls, pairs and bytes against the "
                                                             "band's own (docs/benchmarks-window.md)."),
    replay: bool = typer.Option(False, "--replay", help="With --docs: replay each rank's kernel calls one after "
                                                         "another in this process and time them in CPU seconds, "
                                                         "instead of running the ranks."),
    time_quantiles: str = typer.Option("0.9,0", "--time-quantiles",
                                       help="With --docs: time the sequences at these quantiles of zigzag's "
                                            "imbalance (0.9: the p90-imbalanced one, 0: the most balanced)."),
    topology: str = typer.Option("auto", "--topology", help="flat, two-level, ulysses or auto: how blocks travel "
                                                            "between nodes (see --node-size)."),
    node_size: int | None = typer.Option(None, "--node-size", help="Local ranks per simulated node "
                                                                   "(default: all on one node)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
    **placement: Any,
) -> None:
    """Time burst_attn forward and backward on local ranks against a single process; with --docs, compare the
    sequence layouts on real packed sequences."""
    from bench.attention import AttentionBenchConfig, print_table, run_attention_bench, write_json
    from bench.documents import DocumentsBenchConfig, print_documents, run_documents_bench, write_documents_json

    layout_list = _name_list(layouts) if layouts is not None else None
    try:
        config = AttentionBenchConfig(nproc=nproc, seq_len=seq_len, heads=heads, kv_heads=kv_heads,
                                      head_dim=head_dim, batch=batch, dtype=dtype, causal=causal, iters=iters,
                                      modes=_name_list(modes), doc_length=doc_length, window=window,
                                      layouts=layout_list if layout_list and docs is None else ["zigzag"],
                                      topology=topology, node_size=node_size,
                                      kernel=placement["attention_kernel"] or "auto",
                                      device="cpu" if plan_only else placement["device"])  # plans run no kernel
        if docs is None and (plan_only and window is None or replay
                             or layout_list and layout_list != ["zigzag"] and doc_length is None):
            raise ValueError("--plan-only, --replay and --layouts balanced count or time packed documents: pass "
                             "--docs STORE (or --doc-length N for equal documents); --plan-only also counts a "
                             "--window")
        if docs is not None and window is not None:
            raise ValueError("--window counts and times a sequence without documents: leave out --docs")
        if docs is not None:
            from data.packing import packed_document_offsets

            documents = DocumentsBenchConfig(
                config, packed_document_offsets(docs, seq_len, sequences) if sequences > 0 else [],
                **({"layouts": layout_list} if layout_list else {}), plan_only=plan_only, replay=replay,
                quantiles=_number_list(time_quantiles, float, "--time-quantiles"))
    except (ValueError, OSError) as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    if docs is not None:
        plans, timed = run_documents_bench(documents)
        print_documents(documents, plans, timed)
        if json_path:
            write_documents_json(str(json_path), documents, plans, timed)
        return
    if window is not None:
        from bench.window import print_window_counts, window_counts, write_window_json

        counts = window_counts(config, window)
        print_window_counts(config, window, counts)
        if plan_only:
            if json_path:
                write_window_json(str(json_path), config, window, counts)
            return
    rows = run_attention_bench(config)
    print_table(config, rows)
    if json_path:
        write_json(str(json_path), config, rows)


def _name_list(text: str) -> list[str]:
    """'burst, ring' -> ['burst', 'ring']."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _train_command(config: Path | None = None, **flags: Any) -> None:
    """Train a LLaMA-style model with BurstAttention sequence parallelism.

    Exits 0 when done (or at --stop-after), 2 on bad input, 1 when the run cannot go on (a full disk too), and
    128 + the signal's number when a signal stopped it after saving: 130 after Ctrl-C, 143 after SIGTERM.
    """
    from runtime.given import refuse_ignored
    from trainer.config import (  # here: `burst --help` does not import torch
        given_in_file,
        ignored_settings,
        load_config,
        load_run_config,
        val_sequences_replaced,
    )
    from trainer.launch import launch
    from trainer.signals import TrainingInterrupted, TrainingStopped

    if flags.pop("val_sequences") is not None:
        raise _fail(val_sequences_replaced("--val-sequences"), 2)
    overrides = {name: value for name, value in flags.items() if value is not None}
    resume = overrides.get("resume", False)
    try:
        if resume and (overrides.get("out") is None or config is not None):
            raise ValueError("--resume continues the run in --out with its own config.toml: pass --out RUN_DIR "
                             "and no --config")
        settings = load_run_config(overrides["out"], overrides) if resume else load_config(config, overrides)
        # a setting given that this run would never read: a flag, or a --config file's key
        given = {name: f"{name} in {config}" for name in given_in_file(config)}
        given |= {name: flag(name) for name in overrides}
        refuse_ignored(given, ignored_settings(settings, set(given)))
        launch(settings)
    except (ValueError, TrainingStopped, WriteFailed) as err:
        raise _fail(err, 2 if isinstance(err, ValueError) else 1) from None
    except OSError as err:  # met before any work: a read-only or forbidden --out, say
        raise _fail(os_error_message(err), 2) from None
    except TrainingInterrupted as err:  # saved, and said so: exit as a shell reports a signal (130, 143)
        raise typer.Exit(err.exit_code) from None
    except KeyboardInterrupt:  # Ctrl-C during start-up, before the loop handles signals: nothing was trained
        typer.secho("interrupted during start-up, before the first step: nothing was trained or saved; run the "
                    "same command again", fg=typer.colors.RED, err=True)
        raise typer.Exit(130) from None


# `burst train`'s options are TrainConfig's fields, each declared once there with its type, default and help.
_train_command.__signature__ = inspect.Signature([
    inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Path | None,
                      default=typer.Option(None, "--config", help="TOML file of settings; flags override it.")),
    *_options(),
    # replaced by --val-tokens: refused, naming it
    inspect.Parameter("val_sequences", inspect.Parameter.KEYWORD_ONLY, annotation=int | None,
                      default=typer.Option(None, "--val-sequences", hidden=True)),
])
app.command("train")(_train_command)


def _plan_command(config: Path | None = None, gpu: str | None = None, gpus_per_node: int | None = None,
                  nodes: int = 1, search: bool = False, json_path: Path | None = None, vocab_size: int | None = None,
                  doc_len: int | None = None, force: bool = False, calibrate: bool = False,
                  generate: int | None = None, **flags: Any) -> None:
    """What a training run needs per rank (memory by part, fits or not) and how fast it goes (step time by part,
    tokens/s per GPU, MFU), before it starts: for this machine, or --gpu NAME. Takes `burst train`'s settings.
    With --search: the cp x dp x recomputation settings of the GPUs that fit, fastest first."""
    from trainer.config import load_config
    from trainer.plan import (
        PlanRequest,
        calibrate_here,
        check_json_path,
        format_longest,
        format_plan,
        format_search,
        plan,
        to_json,
        write_json,
    )
    from trainer.plan import longest as longest_settings
    from trainer.plan import search as search_settings

    flags.pop("val_sequences", None)
    seq_len = flags.pop("seq_len", None)
    with _exits():
        if seq_len is not None and seq_len != "max":
            if not seq_len.isdigit():
                raise ValueError(f"--seq-len {seq_len!r} must be a number of tokens, or max (the longest that fits)")
            flags["seq_len"] = int(seq_len)
        overrides = {name: value for name, value in flags.items() if value is not None}
        request = PlanRequest(load_config(config, overrides), gpu, gpus_per_node, nodes, vocab_size, doc_len, generate)
        if json_path is not None:
            check_json_path(json_path, force)
        if calibrate:
            calibrate_here(request)
        if seq_len == "max":
            if search:
                raise ValueError("--seq-len max finds the longest sequence over every setting already; drop --search")
            found_longest = longest_settings(request)
            if found_longest is None:
                raise ValueError("not even 1,024 tokens fit on this hardware in any setting; plan fewer parameters "
                                 "(--lora-rank), more GPUs or a larger GPU")
            shape, result, hardware = found_longest
            typer.echo(format_longest(request.config, shape, result, hardware))
            if json_path is not None:
                write_json(json_path, to_json(request.config, shape, result, hardware))
            return
        shape, result, hardware = plan(request)
        found = longest = None
        if search:
            found, longest, hardware = search_settings(request)
            typer.echo(format_search(request.config, found, longest, hardware))
            if found:
                shape, result = found[0].shape, found[0].estimate
        else:
            typer.echo(format_plan(request.config, shape, result, hardware, request.doc_len))
        if json_path is not None:
            write_json(json_path, to_json(request.config, shape, result, hardware, found, longest))


def _plan_seq_len(parameter: inspect.Parameter) -> inspect.Parameter:
    """`burst train`'s option, with --seq-len also taking max (the longest sequence that fits)."""
    if parameter.name != "seq_len":
        return parameter
    return parameter.replace(annotation=str | None, default=typer.Option(
        None, "--seq-len", help="Tokens per sequence (1,024), or max: the longest sequence any setting of the GPUs "
                                "fits (cp x dp, recomputation, offloaded activations, a tiled MLP), and its plan."))


_plan_command.__signature__ = inspect.Signature([
    *list(_train_command.__signature__.parameters.values())[:1],
    inspect.Parameter("gpu", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
                      default=typer.Option(None, "--gpu", help="Plan for a GPU of the table: h100, h200, a100, b200 "
                                                               "(default: this machine).")),
    inspect.Parameter("gpus_per_node", inspect.Parameter.KEYWORD_ONLY, annotation=int | None,
                      default=typer.Option(None, "--gpus-per-node", help="GPUs per node (the table's 8, or this "
                                                                         "machine's).")),
    inspect.Parameter("nodes", inspect.Parameter.KEYWORD_ONLY, annotation=int,
                      default=typer.Option(1, "--nodes", help="Nodes.")),
    inspect.Parameter("search", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--search", help="Rank the settings that fit by tokens/s per GPU.")),
    inspect.Parameter("json_path", inspect.Parameter.KEYWORD_ONLY, annotation=Path | None,
                      default=typer.Option(None, "--json", help="Also write the plan to this JSON file.")),
    inspect.Parameter("force", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--force", help="Replace the --json file if it exists.")),
    inspect.Parameter("calibrate", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--calibrate", help="First fit the estimate's constants to a few "
                                                                      "minutes of short steps on this machine (its "
                                                                      "device and precision), kept for every plan "
                                                                      "and memory check here from then on.")),
    inspect.Parameter("generate", inspect.Parameter.KEYWORD_ONLY, annotation=int | None,
                      default=typer.Option(None, "--generate", help="Plan `burst generate` of this many new tokens "
                                                                    "after a --seq-len prompt: the weights, one "
                                                                    "block's activations and the KV cache per rank.")),
    inspect.Parameter("vocab_size", inspect.Parameter.KEYWORD_ONLY, annotation=int | None,
                      default=typer.Option(None, "--vocab-size", help="The tokenizer's vocabulary, replacing the "
                                                                      "preset's.")),
    inspect.Parameter("doc_len", inspect.Parameter.KEYWORD_ONLY, annotation=int | None,
                      default=typer.Option(None, "--doc-len", help="With --doc-mask: the packed documents' length "
                                                                   "(default: the --data stores' length-weighted "
                                                                   "mean, or the embedded corpus's).")),
    *map(_plan_seq_len, list(_train_command.__signature__.parameters.values())[1:]),
])
app.command("plan")(_plan_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
