"""Calibrate `burst plan`'s estimate on this machine and report its error on configurations it was not fitted on.

    python benchmarks/plan_calibration.py            # run the grid (a few minutes on 2 cores), write the table
    python benchmarks/plan_calibration.py --report   # fit and report from the stored table, running nothing
    python benchmarks/plan_calibration.py --peaks    # measure the peaks again, keep the step times (under load)

Each configuration of GRID trains 3-4 steps of `burst train` (fp32) on the embedded corpus, or SimPO on preference
pairs cut from it, and records the largest rank's peak RSS and the fastest step's time after the first. The
constants of planner/calibration.py that cannot be derived are fitted on the even rows (least squares,
linear in them, each row weighted by 1 / its measurement) and the estimate is compared with the odd rows, which
the fit never saw. The table is stored in benchmarks/plan_calibration.json; tests/test_plan.py checks that the
constants in the code are its fit and what they reproduce (docs/plan.md has the table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models import ModelConfig  # noqa: E402
from planner import RunShape  # noqa: E402
from planner.calibrate import PINNED, SAME_IN_BF16, fit_rows, predict  # noqa: E402
from planner.hardware import cpu_matmul_tflops, gpu  # noqa: E402
from runtime.launch import available_cores  # noqa: E402
from trainer.plan import store_doc_len  # noqa: E402

TABLE = ROOT / "benchmarks" / "plan_calibration.json"
MIB = 2**20

# (model, seq_len, cp, dp, recomputation, documents): presets debug and tiny (the largest whose steps 2 shared cores
# finish in seconds), 1K to 128K tokens, cp 1-4, dp 1-2, every recomputation mode; documents "one" (one stream),
# "packed" (the corpus's documents under --doc-mask) or (prompt, answer): SimPO on preference pairs with the prompt
# shared (one pair a sequence of prompt + 2 answers). Even rows fit the constants, odd rows check them; both halves
# span the range.
GRID = [
    ("debug", 1024, 1, 1, "none", "one"), ("debug", 4096, 1, 1, "none", "one"),
    ("debug", 2048, 1, 1, "none", "one"), ("debug", 4096, 1, 1, "selective", "one"),
    ("debug", 8192, 1, 1, "full", "one"), ("debug", 8192, 1, 1, "none", "one"),
    ("debug", 4096, 2, 1, "none", "one"), ("debug", 8192, 2, 1, "selective", "one"),
    ("debug", 2048, 1, 2, "none", "one"), ("debug", 8192, 2, 1, "none", "packed"),
    ("debug", 4096, 2, 1, "full", "one"), ("debug", 4096, 1, 1, "none", "packed"),
    ("tiny", 1024, 1, 1, "none", "one"), ("debug", 4096, 4, 1, "none", "one"),
    ("debug", 8192, 4, 1, "selective", "packed"), ("tiny", 1024, 1, 1, "full", "one"),
    ("debug", 32768, 1, 1, "selective", "one"), ("debug", 32768, 2, 1, "none", "one"),
    ("debug", 131072, 4, 1, "selective", "packed"), ("debug", 131072, 2, 1, "none", "packed"),
    ("tiny", 4096, 1, 1, "selective", "one"), ("tiny", 4096, 2, 1, "none", "one"),
    ("tiny", 2048, 1, 2, "full", "one"), ("tiny", 8192, 2, 1, "selective", "packed"),
    ("debug", 8192, 2, 1, "none", (7168, 512)), ("tiny", 4096, 1, 1, "none", (3072, 512)),
    ("tiny", 2048, 1, 1, "selective", "one"), ("tiny", 4096, 1, 1, "full", (2048, 1024)),
    # tiny on one process from 2K to 8K tokens in each mode: the slopes that fix a block's bytes
    ("tiny", 8192, 1, 1, "full", "one"), ("tiny", 2048, 1, 1, "full", "one"),
    ("tiny", 2048, 1, 1, "none", "one"), ("tiny", 8192, 1, 1, "none", "one"),
    ("tiny", 4096, 1, 1, "full", "one"), ("tiny", 8192, 1, 1, "selective", "one"),
]
# The same in bf16 (autocast), where the CPU computes it natively (--precision auto picks it there): its own
# constants, fitted and checked the same way.
BF16_GRID = [
    ("debug", 2048, 1, 1, "none", "one"), ("debug", 8192, 1, 1, "none", "one"),
    ("debug", 8192, 1, 1, "full", "one"), ("debug", 4096, 1, 1, "selective", "one"),
    ("debug", 8192, 2, 1, "none", "packed"), ("debug", 4096, 2, 1, "none", "one"),
    ("debug", 32768, 2, 1, "selective", "one"), ("debug", 8192, 4, 1, "none", "packed"),
    ("tiny", 2048, 1, 1, "none", "one"), ("tiny", 4096, 1, 1, "none", "one"),
    ("tiny", 4096, 1, 1, "selective", "one"), ("tiny", 2048, 1, 1, "full", "one"),
    ("tiny", 8192, 1, 1, "full", "one"), ("tiny", 4096, 2, 1, "selective", "one"),
    ("tiny", 2048, 1, 2, "none", "one"), ("tiny", 4096, 1, 1, "none", (3072, 512)),
]

# Memory only, never fitted (the settings that hold less per token, issue 44): LoRA (every target, the frozen weights
# without gradients or optimizer state), the tiled MLP and loss, and offloaded activations, which on a CPU change
# nothing (the host is the device); each beside the same shape without it, measured with them (tiny at 4K tokens, full
# recomputation, 2 steps: the second holds the optimizer's moments). `--memory-rows` measures them alone.
LORA = {"lora_rank": 16, "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"]}
MEMORY_GRID = [
    ("tiny", 4096, 1, 1, "full", {}), ("tiny", 4096, 1, 1, "full", LORA),
    ("tiny", 4096, 1, 1, "full", {"mlp_tile": 1024, "loss_tile": 256}),
    ("tiny", 4096, 1, 1, "full", {"offload_activations": True}),
]


def memory_flags(settings: dict) -> list[str]:
    """`burst train`'s flags for a memory row's settings."""
    flags = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, ",".join(value) if isinstance(value, list) else str(value)]
    return flags


def run_one(model: str, seq_len: int, cp: int, dp: int, mode: str, documents, workdir: Path,
            precision: str = "fp32", flags: tuple[str, ...] = (), steps: int | None = None) -> dict:
    """Train a few steps (3 from 32K tokens on, else 4); the largest rank's peak memory (MiB) and the step seconds."""
    steps = steps or (3 if seq_len >= 32768 else 4)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        data = ["--val-tokens", "0"]
        if documents == "packed":
            data += ["--doc-mask"]
        elif documents != "one":
            from benchmarks.preference_prefix import make_pairs

            prompt, answer = documents
            store = make_pairs(Path(tmp), prompt, answer, steps * dp)
            data = ["--data", str(store), "--objective", "simpo", "--doc-mask", "--prefix-sharing"]
        command = [sys.executable, "-m", "cli", "train", "--model", model, "--seq-len", str(seq_len), "--cp", str(cp),
                   "--dp", str(dp), "--activation-checkpointing", mode, "--steps", str(steps), "--precision", precision,
                   "--out", str(out), *data, *flags]
        subprocess.run(command, cwd=workdir, check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(workdir)})
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "step" in row and "peak_mem_mib" in row]
    # the fastest step after the first (which warms the kernels up): 2 cores shared with other work slow steps
    # down at random, never speed them up
    return {"peak_mib": max(row["peak_mem_mib"] for row in steps), "step_s": min(r["step_time_s"] for r in steps[1:]),
            "steps_s": [row["step_time_s"] for row in steps], "peaks_mib": [row["peak_mem_mib"] for row in steps]}


def document_pattern(seq_len: int, documents) -> list[int] | None:
    """The document lengths the estimate's plan repeats across a sequence: for the corpus packed under --doc-mask,
    its length-weighted mean (trainer/plan.py's store_doc_len, as `burst plan` takes it from a store);
    for preference pairs, (prompt, answer, answer)."""
    if documents == "one":
        return None
    if documents != "packed":
        prompt, answer = documents
        return [prompt, answer, answer]
    from data import default_store

    return [store_doc_len(default_store(progress=False), seq_len)]


def fitted_rows(table: dict, precision: str) -> list[dict]:
    """The rows the constants of `precision` are fitted on: the even ones of its grid (the odd ones check them)."""
    return [row for row in table["rows"] if row.get("precision", "fp32") == precision][::2]


def fit(table: dict, precision: str = "fp32") -> dict:
    """The constants of `precision` fitted on the even rows of its grid (planner/calibrate.py's fit_rows); bf16 takes
    gloo's hand-off from the fp32 fit (its grid is half the size)."""
    pins = {**PINNED, **({} if precision == "fp32" else {name: fit(table)[name] for name in SAME_IN_BF16})}
    return fit_rows(fitted_rows(table, precision), table, precision, pins=pins)


def report(table: dict) -> list[dict]:
    """Estimated against measured for every row, with the code's constants; `held_out`: not in the fit."""
    fitted = {id(row) for precision in ("fp32", "bf16") for row in fitted_rows(table, precision)}
    lines = []
    for row in table["rows"]:
        memory, seconds = predict(row, table)
        lines.append({**row, "precision": row.get("precision", "fp32"), "held_out": id(row) not in fitted,
                      "est_mib": memory, "est_s": seconds, "memory_error": memory / row["peak_mib"] - 1,
                      "time_error": seconds / row["step_s"] - 1})
    return lines


def run_grid(grid: list[tuple], precision: str) -> list[dict]:
    rows = []
    for model, seq_len, cp, dp, mode, documents in grid:
        result = run_one(model, seq_len, cp, dp, mode, documents, ROOT, precision)
        rows.append({"model": model, "seq_len": seq_len, "cp": cp, "dp": dp, "mode": mode, "precision": precision,
                     "documents": documents if isinstance(documents, str) else "pairs",
                     "doc_pattern": document_pattern(seq_len, documents), **result})
        print(rows[-1], flush=True)
    return rows


def run_memory_grid() -> list[dict]:
    rows = []
    for model, seq_len, cp, dp, mode, settings in MEMORY_GRID:
        result = run_one(model, seq_len, cp, dp, mode, "one", ROOT, "fp32", tuple(memory_flags(settings)), steps=2)
        rows.append({"model": model, "seq_len": seq_len, "cp": cp, "dp": dp, "mode": mode, "precision": "fp32",
                     "documents": "one", "doc_pattern": None, "memory": settings, "peak_mib": result["peak_mib"],
                     "peaks_mib": result["peaks_mib"]})
        print(rows[-1], flush=True)
    return rows


def memory_report(table: dict) -> list[dict]:
    """The memory rows' estimated peak against the measured one, with the code's constants (none fitted on them)."""
    lines = []
    for row in table.get("memory_rows", []):
        memory, _ = predict(row, table)
        lines.append({**row, "est_mib": memory, "memory_error": memory / row["peak_mib"] - 1})
    return lines


def markdown(lines: list[dict]) -> str:
    """The report as a Markdown table (docs/plan.md)."""
    out = ["| dtype | model | seq | cp | dp | recompute | documents | MiB measured | MiB estimated | error | step s | "
           "estimated s | error | held out |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for line in lines:
        out.append(f"| {line['precision']} | {line['model']} | {line['seq_len']} | {line['cp']} | {line['dp']} | "
                   f"{line['mode']} | "
                   f"{line['documents']} | {line['peak_mib']:.0f} | {line['est_mib']:.0f} | "
                   f"{line['memory_error']:+.1%} | {line['step_s']:.2f} | {line['est_s']:.2f} | "
                   f"{line['time_error']:+.1%} | {'yes' if line['held_out'] else 'no'} |")
    return "\n".join(out)


def memory_markdown(lines: list[dict]) -> str:
    """The memory rows' report as docs/plan.md's table: each row's peak, and the change its flags make against the
    row without flags, measured and estimated."""
    plain = next(line for line in lines if not line["memory"])
    out = ["| flags (tiny, 4,096 tokens, full recomputation) | MiB measured | MiB estimated | error | "
           "change measured | change estimated |", "|---|---|---|---|---|---|"]
    for line in lines:
        changes = ("-", "-") if line is plain else (f"{line['peak_mib'] - plain['peak_mib']:+,.0f}",
                                                    f"{line['est_mib'] - plain['est_mib']:+,.0f}")
        out.append(f"| {' '.join(memory_flags(line['memory'])) or '(none)'} | {line['peak_mib']:,.0f} | "
                   f"{line['est_mib']:,.0f} | {line['memory_error']:+.1%} | {changes[0]} | {changes[1]} |")
    return "\n".join(out)


def gpu_fixtures() -> list[dict]:
    """Issue 36's H200 measurements against `burst plan --gpu h200`."""
    from planner import estimate

    hardware, cases = gpu("h200"), []
    for name, seq_len, mode, mib, seconds in [("llama3.2-1b", 131072, "selective", 56057, 11.8),
                                             ("llama3.2-1b", 32768, "selective", 22622, 1.26),
                                             ("tiny", 32768, "none", 8099, None)]:
        model = dataclasses.replace(ModelConfig.from_name(name), vocab_size=4096)
        shape = RunShape(seq_len=seq_len, precision="bf16", activation_checkpointing=mode)
        result = estimate(shape, model, hardware)
        cases.append({"model": name, "seq_len": seq_len, "mode": mode, "peak_mib": mib, "step_s": seconds,
                      "est_mib": result.allocated_bytes / MIB, "est_s": result.step_time_s})
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--report", action="store_true", help="fit and report from the stored table only")
    parser.add_argument("--markdown", action="store_true", help="print the report as docs/plan.md's table, from the "
                        "stored table only (as --report: it runs nothing)")
    parser.add_argument("--memory-rows", action="store_true", help="measure the memory rows only, into the table")
    parser.add_argument("--peaks", action="store_true", help="measure every row's peak again (the memory rows too), "
                        "keeping the table's step times: peaks do not move with other work on the machine, times do; "
                        "a stopped run resumes at the first row it had not measured")
    args = parser.parse_args()
    if args.peaks:
        table = json.loads(TABLE.read_text())
        grids = {"fp32": GRID, "bf16": BF16_GRID}
        for row in table["rows"]:
            if row.get("peak_threshold_fixed"):  # measured by an earlier --peaks run that was stopped: resume
                continue
            documents = next(grid_row[5] for grid_row in grids[row.get("precision", "fp32")]
                             if grid_row[:5] == (row["model"], row["seq_len"], row["cp"], row["dp"], row["mode"])
                             and (grid_row[5] if isinstance(grid_row[5], str) else "pairs") == row["documents"])
            result = run_one(row["model"], row["seq_len"], row["cp"], row["dp"], row["mode"], documents, ROOT,
                             row.get("precision", "fp32"))
            row.update(peak_mib=result["peak_mib"], peaks_mib=result["peaks_mib"], peak_threshold_fixed=True)
            print(row, flush=True)
            TABLE.write_text(json.dumps(table, indent=1) + "\n")  # row by row: a long run stopped keeps its rows
        TABLE.write_text(json.dumps({**table, "memory_rows": run_memory_grid()}, indent=1) + "\n")
    elif args.memory_rows:
        table = json.loads(TABLE.read_text())
        TABLE.write_text(json.dumps({**table, "memory_rows": run_memory_grid()}, indent=1) + "\n")
    elif not (args.report or args.markdown):  # --markdown formats the stored table: it must not measure it again
        with tempfile.TemporaryDirectory() as tmp:  # measured now, on the quiet machine: not a cached rate
            tflops = {dtype: cpu_matmul_tflops(Path(tmp) / "rate.json", dtype) for dtype in (torch.float32,
                                                                                             torch.bfloat16)}
        rows = run_grid(GRID, "fp32") + run_grid(BF16_GRID, "bf16")
        TABLE.write_text(json.dumps({"cpu_matmul_tflops": tflops[torch.float32],
                                     "cpu_bf16_matmul_tflops": tflops[torch.bfloat16], "cores": available_cores(),
                                     "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": rows,
                                     "memory_rows": run_memory_grid()}, indent=1) + "\n")
    table = json.loads(TABLE.read_text())
    if args.markdown:
        print(markdown(report(table)))
        if table.get("memory_rows"):
            print("\n" + memory_markdown(memory_report(table)))
        return
    print("fitted on the even rows, fp32:", fit(table))
    if any(row.get("precision") == "bf16" for row in table["rows"]):
        print("fitted on the even rows, bf16:", fit(table, "bf16"))
    print(f"{'dtype':<5} {'model':<6} {'seq':>6} cp dp {'mode':<9} {'docs':<6} {'MiB':>7} {'est':>7} {'err':>6}  "
          f"{'s':>6} {'est':>6} {'err':>6}  held out")
    for line in report(table):
        print(f"{line['precision']:<5} {line['model']:<6} {line['seq_len']:>6} {line['cp']:>2} {line['dp']:>2} "
              f"{line['mode']:<9} "
              f"{line['documents']:<6} {line['peak_mib']:7.0f} {line['est_mib']:7.0f} "
              f"{line['memory_error']:+6.1%}  {line['step_s']:6.2f} {line['est_s']:6.2f} {line['time_error']:+6.1%}  "
              f"{'yes' if line['held_out'] else 'no'}")
    for line in memory_report(table):
        print(f"fp32  {line['model']:<6} {line['seq_len']:>6} {line['cp']:>2} {line['dp']:>2} {line['mode']:<9} "
              f"{' '.join(memory_flags(line['memory'])) or '-':<40} {line['peak_mib']:7.0f} {line['est_mib']:7.0f} "
              f"{line['memory_error']:+6.1%}  (memory row, not fitted)")
    for case in gpu_fixtures():
        print(case)


if __name__ == "__main__":
    main()
