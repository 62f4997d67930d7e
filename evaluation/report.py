"""What `burst eval` shows and writes: rich tables, a JSON file, and a PNG of loss by position beside it."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from rich.table import Table

from evaluation.qa import QABucket
from evaluation.result import EvalResult
from runtime.directories import write_atomically
from runtime.failure import writing

PLOT_HINT = "pip install 'burst-attention[plot]'"
POSITION_AXES = {"packed": "position in packed sequence", "document": "depth into document (tokens)"}  # by mode
CONVERSATION_AXIS = "depth into conversation (tokens)"  # an instruction store's packed positions


def position_axis(result: EvalResult) -> str:
    return CONVERSATION_AXIS if result.perplexity.answers_only else POSITION_AXES[result.perplexity.positions]


def _finite(x: float) -> float | None:
    """JSON has no NaN: an empty bucket's loss is written as null."""
    return None if math.isnan(x) else x


def to_json(result: EvalResult) -> dict[str, Any]:
    """The JSON document of `--json`: perplexity, loss_by_position (buckets) and what a position is, passkey."""
    ppl = result.perplexity
    passkey = None
    if result.passkey is not None:
        grid = result.passkey
        passkey = {
            "accuracy": grid.accuracy, "lengths": grid.lengths, "depths": grid.depths,
            # grid[i][j]: accuracy at lengths[i], depths[j]
            "grid": [[c.accuracy for c in row] for row in grid.rows()],
            "cells": [{"length": c.length, "depth": c.depth, "trials": c.trials, "retrieved": c.retrieved,
                       "accuracy": c.accuracy} for c in grid.cells],
        }
    qa = None
    if result.qa is not None:
        def bucket(b: QABucket) -> dict[str, Any]:
            return {"depth_start": b.depth_start, "depth_end": b.depth_end, "samples": b.samples,
                    "correct": b.correct, "accuracy": _finite(b.accuracy)}

        qa = {"accuracy": _finite(result.qa.accuracy), "samples": result.qa.samples, "correct": result.qa.correct,
              "by_depth": [bucket(b) for b in result.qa.by_depth],
              "answer_not_in_prompt": bucket(result.qa.not_in_prompt),
              "skipped_longer_than_seq_len": result.qa.skipped_long}
    return {
        "checkpoint": str(result.checkpoint), "format": result.format, "data": str(result.data),
        "scored": "answers" if ppl.answers_only else "all tokens",
        "cp": result.cp, "precision": result.precision, "positions": ppl.positions, "seq_len": ppl.seq_len,
        "sequences": ppl.sequences, "tokens": ppl.tokens, "perplexity": _finite(ppl.perplexity),
        "loss": _finite(ppl.loss),
        "loss_by_position": [{"start": b.start, "end": b.end, "mean_loss": _finite(b.mean_loss), "tokens": b.tokens}
                             for b in ppl.loss_by_position],
        "passkey": passkey, "qa": qa, "warnings": result.warnings, "seconds": result.seconds,
    }


def write_files(result: EvalResult, json_path: Path) -> Path | None:
    """Write the loss-by-position PNG beside `json_path` (same name, .png), then the JSON, each whole or not at
    all (runtime.directories.write_atomically); a failed write (disk full) raises WriteFailed naming the file.

    Returns the PNG's path, or None when matplotlib is missing: then the JSON's warnings say so.
    """
    plot = json_path.with_suffix(".png")
    with writing(json_path, kept="; the results are the tables printed above"):
        json_path.parent.mkdir(parents=True, exist_ok=True)
        if not plot_loss_by_position(result, plot):
            result.warnings.append(f"the plot {plot} was skipped: matplotlib is not installed ({PLOT_HINT})")
            plot = None
        write_atomically(json_path, json.dumps(to_json(result), indent=2) + "\n")
    return plot


def plot_loss_by_position(result: EvalResult, path: Path) -> bool:
    """Write a PNG of mean loss per position bucket; False (nothing written) when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, safe on a headless node
    except ImportError:
        return False
    buckets = [b for b in result.perplexity.loss_by_position if b.tokens]
    figure = Figure(figsize=(7, 4), dpi=120)
    axes = figure.add_subplot()
    axes.plot([(b.start + b.end) / 2 for b in buckets], [b.mean_loss for b in buckets], marker="o")
    axes.set_xlabel(f"{position_axis(result)}, bucket centre")
    axes.set_ylabel("mean cross-entropy (nats)")
    axes.set_title(f"{Path(result.checkpoint).name}: loss by position, seq_len {result.perplexity.seq_len:,}, "
                   f"perplexity {result.perplexity.perplexity:.3f}", fontsize=9)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, png.getvalue())
    return True


def tables(result: EvalResult) -> list[Table]:
    """A summary, loss by position, and (when run) the passkey grid: accuracy per length (rows) x depth."""
    ppl = result.perplexity
    summary = Table(title=f"burst eval {result.checkpoint}", show_header=False, title_justify="left")
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    summary.add_row("perplexity" + (" (answers)" if ppl.answers_only else ""), f"{ppl.perplexity:.4f}")
    summary.add_row("loss (nats/token)" + (" (answers)" if ppl.answers_only else ""), f"{ppl.loss:.4f}")
    summary.add_row("scored tokens", f"{ppl.tokens:,} in {ppl.sequences} x {ppl.seq_len:,}-token sequences"
                    + (" (the answers of packed conversations)" if ppl.answers_only else ""))
    summary.add_row("positions", ppl.positions)
    summary.add_row("data", str(result.data))
    summary.add_row("cp ranks / precision", f"{result.cp} / {result.precision}")
    if result.passkey is not None:
        summary.add_row("passkey accuracy", f"{result.passkey.accuracy:.3f}")
    if result.qa is not None:
        summary.add_row("question answering accuracy", f"{result.qa.accuracy:.3f} ({result.qa.correct} of "
                                                       f"{result.qa.samples})")
    summary.add_row("time", f"{result.seconds:.1f} s")

    title = f"loss by {position_axis(result)}"
    positions = Table(title=title, title_justify="left", min_width=len(title))  # the title on one line
    for name in ("positions", "mean loss", "tokens"):
        positions.add_column(name, justify="right")
    for b in ppl.loss_by_position:
        positions.add_row(f"{b.start:,}-{b.end - 1:,}", f"{b.mean_loss:.4f}", f"{b.tokens:,}")
    out = [summary, positions]

    if result.passkey is not None:
        grid = result.passkey
        passkey = Table(title=f"passkey retrieval accuracy ({grid.cells[0].trials} trials per cell)",
                        title_justify="left")
        passkey.add_column("length \\ depth", justify="right")
        for depth in grid.depths:
            passkey.add_column(f"{depth:g}", justify="right")
        for length, row in zip(grid.lengths, grid.rows(), strict=True):
            passkey.add_row(f"{length:,}", *(f"{c.accuracy:.2f}" for c in row))
        out.append(passkey)

    if result.qa is not None:
        qa = result.qa
        title = (f"question answering by depth of the answer in the prompt ({qa.samples} validation conversations"
                 + (f"; {qa.skipped_long} longer than --seq-len skipped" if qa.skipped_long else "") + ")")
        answers = Table(title=title, title_justify="left")
        for name in ("depth", "samples", "correct", "accuracy"):
            answers.add_column(name, justify="right")
        for b in [*qa.by_depth, qa.not_in_prompt]:
            depth = "not in prompt" if b.depth_start is None else f"{b.depth_start:.1f}-{b.depth_end:.1f}"
            answers.add_row(depth, f"{b.samples:,}", f"{b.correct:,}", f"{b.accuracy:.2f}" if b.samples else "-")
        out.append(answers)
    return out
