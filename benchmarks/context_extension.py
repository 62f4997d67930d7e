"""Continued pre-training to a longer context, end to end on a CPU: what the long-context recipes do at scale.

    python benchmarks/context_extension.py --out runs/extension

1. A small LLaMA (dim 256, 4 layers, 4 heads of 64, 2 kv heads; ~5M parameters) is pre-trained at 1,024
   tokens with RoPE theta 10,000 on the standard library's code (stage 1).
2. A second stage starts from its weights and optimizer state (--init-from, --init-optimizer) at 8,192 tokens,
   with a larger RoPE base (--rope-theta, the NTK-aware value for 8x: 10,000 x 8^(64/62) ~ 86,000, rounded up
   to 100,000), document masking, and a long/short mix by token share: 60% from documents of at least 4,096
   tokens, 40% from all documents (ProLong's recipe, scaled down).
3. A control continues stage 1 with the same data, tokens, optimizer and schedule at 1,024 tokens and the
   original RoPE, so what the extension itself changes can be told from what more training changes.
4. `burst eval` scores the three on held-out documents of at least 8,192 tokens (loss by depth into a document,
   `--positions document`), and a plot shows their curves.

The stores are made from the standard-library corpus with its own tokenizer (the default corpus's), with a
10% validation split so that enough held-out documents reach 8,192 tokens. Every step is a `burst` command,
printed before it runs; figures go to OUT/extension.json and OUT/extension.png.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ORIGINAL, EXTENDED = 1024, 8192


def burst(*args: object, shown: str | None = None) -> None:
    """Run one `burst` command (this checkout's), printing it (or `shown`) first; stop on failure."""
    command = [sys.executable, "-m", "cli", *map(str, args)]
    print("$ burst " + (shown or shlex.join(map(str, args))), flush=True)
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True)
    print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)


def make_store(out: Path) -> Path:
    """The standard library's code, tokenized with the default corpus's tokenizer, 10% held out."""
    from data.corpus import default_store, stdlib_sources

    store = out / "store"
    if not (store / "metadata.json").is_file():
        listing = out / "stdlib-sources.txt"
        listing.write_text("".join(f"{p}\n" for p in stdlib_sources()))
        options = ["--tokenizer", default_store(), "--val-fraction", 0.1, "--out", store]
        burst("prepare", *stdlib_sources(), *options,
              shown=f"prepare $(cat {listing}) " + shlex.join(map(str, options)))
    return store


def make_model(out: Path, vocab_size: int) -> Path:
    """A fresh native checkpoint of the small model, max_seq_len the original context."""
    from models import ModelConfig, init_model, save_model

    path = out / "model-init"
    if not path.is_dir():
        config = ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, multiple_of=256,
                             rope_theta=10_000.0, max_seq_len=ORIGINAL)
        save_model(init_model(config, seed=0), config, path)
    return path


def evaluate(run: Path, store: Path, out: Path, documents: int) -> dict:
    """Loss by depth into held-out documents of at least EXTENDED tokens, in buckets of ORIGINAL positions."""
    result = out / f"{run.name}-eval.json"
    if not result.is_file():
        burst("eval", "--checkpoint", run, "--data", store, "--seq-len", EXTENDED, "--positions", "document",
              "--buckets", EXTENDED // ORIGINAL, "--batches", documents, "--passkey-trials", 0, "--precision", "fp32",
              "--json", result)
    return json.loads(result.read_text())


def summarize(stage1: dict, control: dict, stage2: dict, out: Path) -> dict:
    """The figures the recipe is judged by, written to OUT/extension.json and plotted to OUT/extension.png:
    for each model, loss by depth, over the first ORIGINAL positions and over the second half."""
    runs = {"stage1": stage1, "control": control, "stage2": stage2}
    half = EXTENDED // ORIGINAL // 2  # buckets of ORIGINAL positions: the second half is 4,096-8,191

    def figures_of(result: dict) -> dict:
        losses = [bucket["mean_loss"] for bucket in result["loss_by_position"]]
        return {"loss_by_bucket": losses, "loss_0_1k": losses[0],
                "loss_4k_8k": sum(losses[half:]) / (len(losses) - half)}

    figures = {name: figures_of(result) for name, result in runs.items()}
    figures["buckets"] = [[b["start"], b["end"]] for b in stage1["loss_by_position"]]
    figures["documents"], figures["tokens"] = stage1["sequences"], stage1["tokens"]
    figures["stage2_vs_stage1_0_1k"] = figures["stage2"]["loss_0_1k"] / figures["stage1"]["loss_0_1k"] - 1
    (out / "extension.json").write_text(json.dumps(figures, indent=2) + "\n")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=120)
    axes = figure.add_subplot()
    centres = [(start + end) / 2 for start, end in figures["buckets"]]
    labels = {"stage1": f"stage 1: {ORIGINAL:,} tokens, theta 10,000",
              "control": f"stage 1 + the same tokens at {ORIGINAL:,}, theta 10,000 (control)",
              "stage2": f"stage 1 + extension: {EXTENDED:,} tokens, theta 100,000, long/short mix"}
    for name, label in labels.items():
        axes.plot(centres, figures[name]["loss_by_bucket"], marker="o", label=label)
    axes.axvline(ORIGINAL, color="grey", linestyle=":", label="stage 1's context")
    axes.set_xlabel("depth into a held-out document (tokens), bucket centre")
    axes.set_ylabel("mean cross-entropy (nats)")
    axes.set_title(f"loss by position, {figures['documents']} held-out documents of >= {EXTENDED:,} tokens",
                   fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "extension.png")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/extension"))
    parser.add_argument("--stage1-steps", type=int, default=300, help="steps of --stage1-batch x 1,024 tokens")
    parser.add_argument("--stage1-batch", type=int, default=4)
    parser.add_argument("--stage2-steps", type=int, default=60, help="steps of 1 x 8,192 tokens")
    parser.add_argument("--cp", type=int, default=2, help="ranks sharing each 8,192-token sequence in stage 2")
    parser.add_argument("--documents", type=int, default=16, help="held-out documents to score")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    store = make_store(out)
    from data import TokenStore

    model = make_model(out, TokenStore(store).vocab_size)
    stage1, stage2, control = out / "stage1", out / "stage2", out / "control"
    if not (stage1 / "checkpoints").is_dir():
        burst("train", "--model", model, "--data", store, "--seq-len", ORIGINAL, "--batch-size", args.stage1_batch,
              "--steps", args.stage1_steps, "--lr", 3e-3, "--warmup", args.stage1_steps // 20, "--doc-mask",
              "--precision", "fp32",
              "--out", stage1)
    if not (control / "checkpoints").is_dir():  # the same tokens and schedule at the original length and RoPE
        burst("train", "--init-from", stage1, "--init-optimizer", "--data", f"long={store}:0.6:min_doc=4096",
              "--data", f"short={store}:0.4", "--seq-len", ORIGINAL, "--batch-size", EXTENDED // ORIGINAL,
              "--steps", args.stage2_steps, "--lr", 1e-3, "--warmup", args.stage2_steps // 10, "--doc-mask",
              "--precision", "fp32", "--out", control)
    if not (stage2 / "checkpoints").is_dir():
        burst("train", "--init-from", stage1, "--init-optimizer", "--data", f"long={store}:0.6:min_doc=4096",
              "--data", f"short={store}:0.4", "--seq-len", EXTENDED, "--cp", args.cp, "--steps", args.stage2_steps,
              "--lr", 1e-3, "--warmup", args.stage2_steps // 10, "--rope-theta", 100_000, "--doc-mask",
              "--precision", "fp32",
              "--out", stage2)
    figures = summarize(*(evaluate(run, store, out, args.documents) for run in (stage1, control, stage2)), out)
    for name in ("stage1", "control", "stage2"):
        print(f"{name:8s} positions 0-1,023: loss {figures[name]['loss_0_1k']:.4f}; positions 4,096-8,191: "
              f"{figures[name]['loss_4k_8k']:.4f}")
    print(f"plot {out / 'extension.png'}")


if __name__ == "__main__":
    main()
