"""The GPU benchmark users run on their machine: one summary table, nothing downloaded, at most ~8 minutes on one
H100/H200 (docs/benchmarks-gpu.md).

    python scripts/gpu_benchmark.py                    # the GPU benchmark: runs/gpu-benchmark-DATE/
    python scripts/gpu_benchmark.py --smoke --out DIR  # the same code on the CPU at tiny sizes, in seconds

Parts, each a group of rows of the one table:
  kernel      every attention kernel this machine has (burst/kernels/), forward + backward of causal bf16
              attention, 32 query / 8 key-value heads, head dim 128, at 32K and 131K tokens, against the
              fastest of SDPA's fused backends on the same inputs;
  burst_attn  burst_attn at a world of one ("auto" kernel) against the same;
  train       `burst train --model llama3.2-1b` at 32K and 131K tokens: plain, --doc-mask on the default corpus,
              and --compile; tokens/s of the last step, model TFLOP/s and MFU by the planner's FLOP count and GPU
              table (planner/), as `burst plan` gives them for the same run, peak memory; with several GPUs also
              cp 2 and cp 4 at 131K.
Writes DIR/benchmark.md (the table) and DIR/benchmark.json, and prints the table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import burst  # noqa: E402
from burst.kernels import candidates, detect_machine, select_kernel  # noqa: E402
from planner import mfu  # noqa: E402
from planner.hardware import table_gpu  # noqa: E402

COLUMNS = ("part", "run", "tokens", "ms fwd+bwd", "TFLOP/s", "x SDPA fastest", "tokens/s", "MFU", "peak MiB", "note")
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}


@dataclass(frozen=True)
class BenchmarkConfig:
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    kernel_seq_lens: tuple[int, ...] = (32768, 131072)
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    iters: int = 2
    model: str = "llama3.2-1b"
    train_seq_lens: tuple[int, ...] = (32768, 131072)
    train_steps: int = 3
    train_variants: tuple[str, ...] = ("plain", "doc-mask", "compile")
    precision: str = "bf16"
    peak_tflops: float | None = None


SMOKE = BenchmarkConfig(device="cpu", dtype=torch.float32, kernel_seq_lens=(128, 256), heads=4, kv_heads=2,
                        head_dim=16, iters=1, model="tiny", train_seq_lens=(256,), train_steps=2,
                        train_variants=("plain", "doc-mask"), precision="fp32")


def attention_flops(seq_len: int, heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention over one sequence, counted as FlashAttention does:
    forward 4 s^2 h d / 2, backward 2.5 x forward."""
    return 3.5 * 4 * seq_len * seq_len * heads * head_dim / 2


def train_config(config: BenchmarkConfig, seq_len: int, variant: str, cp: int):
    """The TrainConfig `burst train` gets from a training row's command (`train_rows`), on the default corpus."""
    from data import default_store
    from trainer.config import TrainConfig

    return TrainConfig(model=config.model, seq_len=seq_len, batch_size=1, precision=config.precision,
                       activation_checkpointing="selective", cp=cp, doc_mask=True if variant == "doc-mask" else None,
                       compile=variant == "compile", data=[str(default_store(progress=False))])


def planned(config: BenchmarkConfig, seq_len: int, variant: str, cp: int = 1) -> tuple[float, float | None]:
    """(model FLOPs per token, the dense peak in TFLOP/s) of one training row, as `burst plan` counts them for the
    same run: the planner's one FLOP count, and its GPU table's peak for this GPU (None: a GPU not in the table) or
    this CPU's measured rate; --peak-tflops replaces the peak."""
    from trainer.plan import PlanRequest, plan

    _, estimate, _ = plan(PlanRequest(train_config(config, seq_len, variant, cp)))
    peak = estimate.peak_tflops
    if config.device == "cuda" and table_gpu(torch.cuda.get_device_name()) is None:
        peak = None
    return estimate.model_flops / estimate.tokens_per_step, config.peak_tflops or peak


def timed(run, device: torch.device, iters: int) -> float:
    """Mean seconds of run() over `iters` calls after one warm-up call."""
    run()
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    synchronize()
    return (time.perf_counter() - start) / iters


def row(part: str, run: str, tokens: int, **values) -> dict:
    return {"part": part, "run": run, "tokens": tokens, **values}


def attention_rows(config: BenchmarkConfig, seq_len: int) -> list[dict]:
    """Every kernel, SDPA's fastest fused backend and burst_attn at one sequence length."""
    device = torch.device(config.device)
    g = torch.Generator(device=device).manual_seed(0)
    make = lambda heads: torch.randn(1, seq_len, heads, config.head_dim, generator=g, device=device,  # noqa: E731
                                     dtype=config.dtype)
    q, k, v, dout = make(config.heads), make(config.kv_heads), make(config.kv_heads), make(config.heads)
    flops, scale = attention_flops(seq_len, config.heads, config.head_dim), config.head_dim ** -0.5

    def sdpa(backend):
        leaves = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).backward(dout.transpose(1, 2))

    sdpa_times = {}
    backends = SDPA_BACKENDS if device.type == "cuda" else {"cpu flash": SDPBackend.FLASH_ATTENTION}
    for name, backend in backends.items():
        try:
            sdpa_times[name] = timed(lambda b=backend: sdpa(b), device, config.iters)
        except RuntimeError as error:  # a backend that does not take these inputs here
            sdpa_times[name] = None
            print(f"SDPA {name}: not run ({str(error).splitlines()[0]})", file=sys.stderr)
    fastest = min((t, n) for n, t in sdpa_times.items() if t is not None)
    rows = [row("kernel", f"SDPA fastest ({fastest[1]})", seq_len, ms=fastest[0] * 1e3,
                tflops=flops / fastest[0] / 1e12, vs_sdpa=1.0)]

    def measured(part: str, run: str, seconds: float, note: str = "") -> dict:
        return row(part, run, seq_len, ms=seconds * 1e3, tflops=flops / seconds / 1e12, vs_sdpa=fastest[0] / seconds,
                   note=note)

    groups = config.heads // config.kv_heads
    for name in candidates(detect_machine(device), config.dtype, config.head_dim):
        try:
            kernel = select_kernel(device, config.dtype, name, head_dim=config.head_dim, groups=groups)
        except ValueError as error:  # it failed its self-check: the run would not use it
            rows.append(row("kernel", name, seq_len, note=f"refused: {error}"))
            continue

        def fwd_bwd(kernel=kernel):
            out, lse = kernel.forward(q, k, v, True, scale)
            kernel.backward(dout, q, k, v, out, lse, True, scale)

        rows.append(measured("kernel", name, timed(fwd_bwd, device, config.iters)))

    def burst_fwd_bwd():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        burst.burst_attn(*leaves).backward(dout)

    chosen = select_kernel(device, config.dtype, head_dim=config.head_dim, groups=groups).name
    rows.append(measured("burst_attn", f"world of one ({chosen})", timed(burst_fwd_bwd, device, config.iters)))
    return rows


def train_rows(config: BenchmarkConfig, out: Path, seq_len: int, variant: str, cp: int = 1) -> dict:
    """One `burst train` run in its own process: its last step's tokens/s, model TFLOP/s, MFU, peak memory."""
    run = f"{config.model} {variant}" + (f" cp {cp}" if cp > 1 else "")
    run_dir = out / f"train-{seq_len}-{variant}-cp{cp}"
    flags = {"plain": [], "doc-mask": ["--doc-mask"], "compile": ["--compile"]}[variant]
    command = [sys.executable, "-m", "cli", "train", "--model", config.model, "--seq-len", str(seq_len),
               "--batch-size", "1", "--precision", config.precision, "--steps", str(config.train_steps),
               "--log-every", "1", "--activation-checkpointing", "selective", "--out", str(run_dir), *flags]
    if cp > 1:
        command += ["--cp", str(cp)]
    log = out / f"{run_dir.name}.log"
    with log.open("w") as handle:
        done = subprocess.run(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"step"' in line] if (run_dir / "metrics.jsonl").exists() else []
    steps = [s for s in steps if "tokens_per_s" in s]
    if done.returncode != 0 or not steps:
        return row("train", run, seq_len, note=f"failed (exit {done.returncode}); see {log}")
    last = steps[-1]
    flops_per_token, peak = planned(config, seq_len, variant, cp)
    per_gpu = last["tokens_per_s"] / cp  # the run's tokens/s are its ranks' together
    return row("train", run, seq_len, tokens_per_s=last["tokens_per_s"], tflops=per_gpu * flops_per_token / 1e12,
               mfu=None if peak is None else mfu(per_gpu, flops_per_token, peak), peak_mib=last["peak_mem_mib"],
               note=f"step {last['step']} of {config.train_steps}" + (", TFLOP/s per GPU" if cp > 1 else ""))


def environment(config: BenchmarkConfig) -> str:
    gpu = torch.cuda.get_device_name() if config.device == "cuda" else "none (CPU)"
    driver = ""
    if config.device == "cuda":
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, check=False).stdout.strip().splitlines()[0]
        except (OSError, IndexError):
            driver = "unknown"
    return (f"{datetime.date.today().isoformat()}; GPU {gpu}" + (f", driver {driver}" if driver else "")
            + f"; torch {torch.__version__}, CUDA {torch.version.cuda}")


def _cell(value, column: str) -> str:
    if value is None:
        return "-"
    if column == "MFU":
        return f"{value:.1%}"
    if column == "x SDPA fastest":
        return f"{value:.2f}x"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def markdown(rows: list[dict], header: str) -> str:
    keys = ("part", "run", "tokens", "ms", "tflops", "vs_sdpa", "tokens_per_s", "mfu", "peak_mib", "note")
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(key), column) for key, column in zip(keys, COLUMNS, strict=True))
                     + " |")
    return "\n".join(lines) + "\n"


def run_benchmark(config: BenchmarkConfig, out: Path) -> list[dict]:
    rows = []
    for seq_len in config.kernel_seq_lens:
        rows += attention_rows(config, seq_len)
        if config.device == "cuda":
            torch.cuda.empty_cache()
    for seq_len in config.train_seq_lens:
        for variant in config.train_variants:
            rows.append(train_rows(config, out, seq_len, variant))
    gpus = torch.cuda.device_count() if config.device == "cuda" else 0
    for cp in (2, 4):
        if gpus >= cp:
            rows.append(train_rows(config, out, config.train_seq_lens[-1], "plain", cp))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="Run directory (default: runs/gpu-benchmark-DATE); must not exist.")
    parser.add_argument("--smoke", action="store_true", help="The same code on the CPU at tiny sizes, in seconds.")
    parser.add_argument("--peak-tflops", type=float, help="The GPU's dense bf16 peak for MFU (default: the planner's "
                                                          "GPU table's, as `burst plan` takes it).")
    args = parser.parse_args(argv)
    config = SMOKE if args.smoke else BenchmarkConfig()
    if config.device == "cuda" and not torch.cuda.is_available():
        parser.error("no GPU is visible; --smoke runs the same code on the CPU")
    if args.peak_tflops:
        config = dataclasses.replace(config, peak_tflops=args.peak_tflops)
    out = args.out or REPO / "runs" / f"gpu-benchmark-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    if out.exists():
        parser.error(f"{out} exists; give a new --out")
    out.mkdir(parents=True)
    rows = run_benchmark(config, out)
    header = (f"GPU benchmark, {environment(config)}. Attention: causal, {config.heads}/{config.kv_heads} heads, "
              f"dim {config.head_dim}, {str(config.dtype).removeprefix('torch.')}; training: {config.model}, "
              f"batch 1, {config.precision}, selective checkpointing" + (" (--smoke)" if args.smoke else ""))
    table = markdown(rows, header)
    (out / "benchmark.md").write_text(table)
    (out / "benchmark.json").write_text(json.dumps({"environment": environment(config), "columns": COLUMNS,
                                                    "rows": rows}, indent=1))
    print(table)
    return 0 if all("failed" not in r.get("note", "") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
