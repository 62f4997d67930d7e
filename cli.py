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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
