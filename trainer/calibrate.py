"""`burst plan --calibrate`: fit the planner's constants to a few minutes of short steps on this machine.

A user's machine is never the one the shipped constants were fitted on (planner/calibration.py): on a 2-core AMD
EPYC without AMX, tiny at 4K tokens was planned at 12.4 s a step and ran at 7.7 s. Calibration trains a small grid
of short runs here (`burst train`, a process each, on the device and in the precision a run would take), measures
each one's peak memory and fastest step, fits the constants as benchmarks/plan_calibration.py fits the shipped ones
(planner/calibrate.py), and keeps the record for this machine (~/.cache/burst/calibration.json). `burst plan`,
`burst train`'s preflight and `burst eval`'s memory check use it from then on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from planner import calibration
from planner.calibrate import fit_rows
from planner.calibration import Calibration, Constants
from planner.hardware import cpu_matmul_tflops, machine_id

REPO = Path(__file__).resolve().parent.parent
# (model, seq_len, cp, recomputation): pairs that differ only in length (their slope is what a long run is made
# of), every recomputation mode, two presets (their layer counts tell a block's kept bytes from its working set),
# and two ranks for the ring's hand-off; seconds a run on a CPU, of a GPU's
CPU_GRID = [("debug", 1024, 1, "none"), ("debug", 4096, 1, "none"), ("debug", 2048, 1, "selective"),
            ("debug", 8192, 1, "selective"), ("debug", 2048, 1, "full"), ("debug", 8192, 1, "full"),
            ("debug", 2048, 2, "none"), ("debug", 8192, 2, "none"), ("tiny", 1024, 1, "none"),
            ("tiny", 2048, 1, "none")]
GPU_GRID = [("tiny", 8192, 1, "none"), ("tiny", 32768, 1, "none"), ("tiny", 8192, 1, "selective"),
            ("tiny", 32768, 1, "selective"), ("tiny", 8192, 1, "full"), ("tiny", 32768, 1, "full"),
            ("debug", 8192, 1, "none"), ("debug", 32768, 1, "none")]


def measure_run(flags: list[str], steps: int = 4) -> dict:
    """Train `steps` steps of `burst train FLAGS` in its own process on the embedded corpus: the largest rank's peak
    memory (MiB) and the fastest step's seconds after the first (which warms the kernels up: other work slows
    steps down at random, never speeds them up)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        command = [sys.executable, "-m", "cli", "train", *flags, "--steps", str(steps), "--val-tokens", "0",
                   "--out", str(out)]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ValueError(f"calibration run `burst train {' '.join(flags)}` failed: {last}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_done = [row for row in rows if "step" in row and "peak_mem_mib" in row]
    return {"peak_mib": max(row["peak_mem_mib"] for row in steps_done),
            "step_s": min(row["step_time_s"] for row in steps_done[1:])}


def calibrate(device: str, precision: str, say=print) -> Calibration:
    """Fit this machine's constants in `precision` (bf16 or fp32) on `device` (cpu or cuda) and keep them; returns
    the record. The other precision's constants stay those of the record this machine had (or the shipped ones)."""
    grid = GPU_GRID if device == "cuda" else CPU_GRID
    table = {"device": device, "cores": os.cpu_count() or 1}
    if device == "cuda":
        table["gpu"] = machine_id("cuda")
    else:
        import torch

        table["cpu_matmul_tflops"] = cpu_matmul_tflops()
        table["cpu_bf16_matmul_tflops"] = cpu_matmul_tflops(dtype=torch.bfloat16)
        from runtime.launch import available_cores

        table["cores"] = available_cores()
    rows = []
    for index, (model, seq_len, cp, mode) in enumerate(grid, 1):
        say(f"calibration run {index} of {len(grid)}: {model}, --seq-len {seq_len:,}, --cp {cp}, "
            f"--activation-checkpointing {mode}")
        flags = ["--model", model, "--seq-len", str(seq_len), "--cp", str(cp), "--activation-checkpointing", mode,
                 "--precision", precision, "--device", device]
        rows.append({"model": model, "seq_len": seq_len, "cp": cp, "dp": 1, "mode": mode, "precision": precision,
                     "documents": "one", "doc_pattern": None, **measure_run(flags)})
    machine = machine_id(device)
    start = calibration.cached(machine) or calibration.default(device)
    fitted = Constants(**{**vars(start.constants(precision)), **fit_rows(rows, table, precision, start)})
    sides = {"fp32": start.fp32, "bf16": start.bf16, "bf16" if precision == "bf16" else "fp32": fitted}
    record = Calibration(machine, device, sides["fp32"], sides["bf16"],
                         f"burst plan --calibrate: {len(rows)} short {precision} runs on this machine")
    say(f"calibrated {machine} ({precision}); kept in {calibration.save(record)}")
    return record
