"""The `burst` command line: a thin Typer layer over plain functions in burst/, models/, data/.

Each command parses flags, builds a config and calls one function; no logic lives here.
"""

from __future__ import annotations

import enum
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False,
                  help="Long-context LLaMA training with exact BurstAttention sequence parallelism.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks.")
app.add_typer(bench_app, name="bench")


class TargetFormat(str, enum.Enum):
    burst = "burst"
    hf = "hf"


@app.command("convert-checkpoint")
def convert_checkpoint_command(
    src: Path = typer.Argument(..., help="Checkpoint directory to convert (format detected)."),
    dst: Path = typer.Argument(..., help="Directory to write; created only once complete."),
    to: TargetFormat = typer.Option(..., "--to", help="Format to write: burst (native) or hf (Hugging Face)."),
    force: bool = typer.Option(False, "--force", help="Replace DST if it exists."),
) -> None:
    """Convert a model checkpoint between the Hugging Face LLaMA and native formats."""
    from models.convert import convert_checkpoint  # here, so `burst --help` does not import torch

    try:
        convert_checkpoint(src, dst, to=to.value, force=force)
    except ValueError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {dst} ({to.value})")


@app.command("prepare")
def prepare_command(
    inputs: list[Path] = typer.Argument(..., help="Text/source files, .jsonl(.gz), .parquet, or directories."),
    out: Path = typer.Option(..., "--out", help="Token store directory to write; created only once complete."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="Existing SentencePiece .model to use."),
    vocab_size: int | None = typer.Option(None, "--vocab-size", help="Train a tokenizer of this size (32000)."),
    text_field: str = typer.Option("text", "--text-field", help="Field holding the text in .jsonl/.parquet."),
    val_fraction: float = typer.Option(0.01, "--val-fraction", help="Fraction of documents for validation."),
    workers: int | None = typer.Option(None, "--workers", help="Encoding threads (default: all cores)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the tokenizer sample and the validation split."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
) -> None:
    """Tokenize a corpus into a token store for training."""
    from data.prepare import prepare  # here, so `burst --help` does not import torch

    try:
        prepare(inputs, out, tokenizer=tokenizer, vocab_size=vocab_size, text_field=text_field,
                val_fraction=val_fraction, workers=workers, seed=seed, force=force)
    except (ValueError, OSError, ImportError) as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


@bench_app.command("attention")
def bench_attention_command(
    nproc: int = typer.Option(2, "--nproc", help="Local ranks the sequence is split across."),
    seq_len: int = typer.Option(8192, "--seq-len", help="Global sequence length (a multiple of 2 x nproc)."),
    heads: int = typer.Option(8, "--heads", help="Query heads."),
    kv_heads: int | None = typer.Option(None, "--kv-heads", help="Key/value heads (default: --heads)."),
    head_dim: int = typer.Option(64, "--head-dim"),
    batch: int = typer.Option(1, "--batch"),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32."),
    causal: bool = typer.Option(True, "--causal/--non-causal"),
    iters: int = typer.Option(2, "--iters", help="Timed iterations after one warm-up."),
    modes: str = typer.Option("burst,ring", "--modes", help="Backward modes to run: burst, ring, auto."),
    doc_length: int | None = typer.Option(None, "--doc-length",
                                          help="Also run document-masked, packing documents of this many tokens."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
) -> None:
    """Time burst_attn forward and backward on local ranks against a single process."""
    from burst.bench import AttentionBenchConfig, print_table, run_attention_bench, write_json

    try:
        config = AttentionBenchConfig(nproc=nproc, seq_len=seq_len, heads=heads, kv_heads=kv_heads,
                                      head_dim=head_dim, batch=batch, dtype=dtype, causal=causal, iters=iters,
                                      modes=[m.strip() for m in modes.split(",") if m.strip()], doc_length=doc_length)
    except ValueError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    rows = run_attention_bench(config)
    print_table(config, rows)
    if json_path:
        write_json(str(json_path), config, rows)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
