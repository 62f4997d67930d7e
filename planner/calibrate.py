"""Fitting the planner's constants to measured steps: what `burst plan --calibrate` does on this machine and
benchmarks/plan_calibration.py does on its grid (docs/plan.md).

A row is one measured run: its model preset, --seq-len, --cp, --dp, recomputation mode, precision, documents ("one",
"packed" with `doc_pattern` the lengths the plan repeats, or "pairs"), the largest rank's peak memory (`peak_mib`)
and the fastest step after the first (`step_s`). The machine's rates (`table`: its matmul TFLOP/s in fp32 and bf16,
its cores, the device and, on CUDA, the GPU's name) come beside the rows. The constants are linear in what each part
of the estimate counts, so a least-squares fit, every coefficient non-negative, finds them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.config import ModelConfig
from models.footprint import footprint
from planner import calibration
from planner.calibration import Calibration
from planner.hardware import Hardware, table_gpu
from planner.memory import allocated_bytes, memory_parts
from planner.shape import RunShape
from planner.time import step_seconds, time_parts

MIB = 2**20


def shape_of(row: dict) -> tuple[RunShape, ModelConfig]:
    """A row's shape; `memory` (the memory rows): its LoRA, tiling and offloading, as RunShape names them."""
    documents = row["documents"] != "one"
    shape = RunShape(seq_len=row["seq_len"], cp=row["cp"], dp=row["dp"], activation_checkpointing=row["mode"],
                     precision=row.get("precision", "fp32"), doc_len=row["doc_pattern"] if documents else None,
                     prefix_sharing=row["documents"] == "pairs", layout="balanced" if documents else "zigzag",
                     **row.get("memory", {}))
    return shape, ModelConfig.from_name(row["model"])


def cpu_hardware(table: dict, precision: str = "fp32", record: Calibration = calibration.CPU) -> Hardware:
    """The machine the rows were measured on: a GPU of the table (`table["gpu"]`, on CUDA), else the CPU at its
    measured rates; its constants `record`'s."""
    if table.get("device", "cpu") == "cuda":
        known = table_gpu(table["gpu"]) or table_gpu("h100")
        return dataclasses.replace(known, memory_bytes=2**50, gpus_per_node=8, calibration=record)
    tflops = table["cpu_bf16_matmul_tflops" if precision == "bf16" else "cpu_matmul_tflops"]
    return Hardware("this CPU", "cpu", 2**40, tflops, tflops, 5.0, 1.0, 10.0, 1, 1, "calibration", table["cores"],
                    calibration=record)


def with_constants(record: Calibration, precision: str, **values) -> Calibration:
    """`record` with some of its `precision` constants replaced."""
    side = "bf16" if precision == "bf16" else "fp32"
    return dataclasses.replace(record, **{side: dataclasses.replace(record.constants(precision), **values)})


def row_times(row: dict, table: dict, record: Calibration = calibration.CPU) -> dict[str, float]:
    shape, model = shape_of(row)
    return time_parts(shape, footprint(model), cpu_hardware(table, shape.precision, record))


def predict(row: dict, table: dict, record: Calibration = calibration.CPU) -> tuple[float, float]:
    """(peak MiB, step seconds) the estimate gives for a stored row, with `record`'s constants (the code's)."""
    shape, model = shape_of(row)
    parts = memory_parts(shape, footprint(model), cpu_hardware(table, shape.precision, record))
    return sum(parts.values()) / MIB, step_seconds(row_times(row, table, record))


# The time constants, each with the step part it alone scales (at 1, the others off): a step's time is linear in
# them, and in the inverse rates. The rates are not fitted: matmuls and attention's products run at the matmul rate
# measured on this CPU (on two presets the fit cannot tell them from the memory-bound work that grows with them,
# and a fitted rate would not carry to larger models, where the matmuls dominate); the rest is fitted.
TIME_TERMS = [("step_overhead_s", "overhead"), ("matmul_efficiency", "matmuls"),
              ("attention_fraction", "attention"), ("attention_score_s", "attention"),
              ("elementwise_s_per_value", "elementwise"), ("ring_step_s", "ring hand-offs")]
INVERSE_RATES = ("matmul_efficiency", "attention_fraction")
PINNED = {"matmul_efficiency": 1.0, "attention_fraction": 1.0}
# On a GPU the memory-bound work, the softmax and the hand-offs run inside the kernels' rates: two step times fix the
# matmul efficiency and the fixed overhead (as issue 36's H200 did)
CUDA_PINNED = {"attention_fraction": 1.0, "elementwise_s_per_value": 0.0, "attention_score_s": 0.0,
               "ring_step_s": 0.0}
# gloo's hand-offs do not change with the kernels' dtype: bf16 takes fp32's (its grid is half the size)
SAME_IN_BF16 = ("ring_step_s",)
# The memory constants the fit finds beside the process's bytes; the allocator's share is fixed (below), and what
# lies outside the blocks (outer_bytes_per_dim) is left at 0: a block's width is 13 dims on both presets, so the
# fit cannot tell it from a block's gradients in flight.
MEMORY_TERMS = ("block_bytes_per_value", "backward_bytes_per_value", "full_recompute_bytes_per_value",
                "selective_values_per_dim")


def time_bases(row: dict, table: dict, start: Calibration = calibration.CPU) -> tuple[list[float], float]:
    """One column a TIME_TERMS constant, and the seconds of the step's parts no constant scales (optimizer,
    exposed communication)."""
    precision = row.get("precision", "fp32")
    off = {name: float("inf") if name in INVERSE_RATES else 0.0 for name, _ in TIME_TERMS}
    columns = []
    for name, part in TIME_TERMS:
        columns.append(row_times(row, table, with_constants(start, precision, **{**off, name: 1.0}))[part])
    fixed = step_seconds(row_times(row, table, with_constants(start, precision, **off)))
    return columns, fixed


def memory_bases(row: dict, table: dict, at: dict,
                 start: Calibration = calibration.CPU) -> tuple[list[float], float]:
    """The tensors' MiB as linear in MEMORY_TERMS around the constants `at` (the peak is early or late in backward,
    whichever is larger: linear on each side): one column a constant, and the MiB at none of them."""
    shape, model = shape_of(row)

    def tensors(**values) -> float:
        record = with_constants(start, shape.precision, **{**at, **values})
        return allocated_bytes(memory_parts(shape, footprint(model), cpu_hardware(table, shape.precision,
                                                                                   record))) / MIB

    here = tensors()
    columns = [tensors(**{name: at[name] + 1.0}) - here for name in MEMORY_TERMS]
    return columns, here - sum(c * at[name] for c, name in zip(columns, MEMORY_TERMS, strict=True))


def fit_rows(rows: list[dict], table: dict, precision: str = "fp32", start: Calibration = calibration.CPU,
             pins: dict | None = None) -> dict:
    """Least-squares constants of `precision` from `rows`, each row weighted by 1 / its measurement: relative errors
    are what the targets judge (else the largest rows decide the fit and a fixed term swamps the small ones). start:
    the record the memory fit linearises around first (and whose allocator share it keeps); pins: constants held
    (default PINNED on a CPU; on CUDA the CPU-only terms at 0 and the matmul efficiency fitted)."""
    cuda = table.get("device", "cpu") == "cuda"
    pins = pins if pins is not None else CUDA_PINNED if cuda else PINNED
    # Memory: peak RSS = the process + (1 + malloc's share) x the tensors. The share is not separable from the
    # process's on these shapes: 10%, as glibc's arenas hold. Linear in the constants on each side of the early /
    # late peak: fitted around the code's constants, then around the fit's, until the sides stop changing.
    allocator = start.constants(precision).allocator_overhead
    scale, measured = 1 + allocator, np.array([row["peak_mib"] for row in rows])
    at = {name: getattr(start.constants(precision), name) for name in MEMORY_TERMS}
    # Beside each row, each pair of rows that differ only in --seq-len gives its slope, free of the process's
    # bytes and of what malloc holds at start-up: what carries the estimate to long sequences
    key = lambda row: tuple(row[k] for k in ("model", "cp", "dp", "mode", "documents"))  # noqa: E731
    pairs = [(i, j) for i in range(len(rows)) for j in range(len(rows))
             if key(rows[i]) == key(rows[j]) and rows[i]["seq_len"] > rows[j]["seq_len"]]
    for _ in range(4):
        bases = [memory_bases(row, table, at, start) for row in rows]
        x = np.array([[1.0, *(scale * c for c in columns)] for columns, _ in bases])
        rest = measured - scale * np.array([fixed for _, fixed in bases])
        grown = np.array([measured[i] - measured[j] for i, j in pairs]).reshape(-1, 1)
        slopes = np.array([x[i] - x[j] for i, j in pairs]).reshape(-1, x.shape[1])
        x_all = np.concatenate([x / measured[:, None], slopes / grown])
        y_all = np.concatenate([rest / measured, np.array([rest[i] - rest[j] for i, j in pairs]) / grown[:, 0]])
        process, *values = non_negative_fit(x_all, list(y_all))
        at = {name: float(value) for name, value in zip(MEMORY_TERMS, values, strict=True)}
    found = {"process_bytes": round(process) * MIB, "allocator_overhead": allocator,
             **{name: round(value, 3) for name, value in at.items()}}
    # Time: the constants beside the pinned rates, fitted (the steps of one run agree within ~10% on a quiet machine)
    measured = np.array([row["step_s"] for row in rows])
    bases = [time_bases(row, table, start) for row in rows]
    free = [i for i, (name, _) in enumerate(TIME_TERMS) if name not in pins]
    pinned = np.array([sum(columns[i] * (1 / pins[name] if name in INVERSE_RATES else pins[name])
                           for i, (name, _) in enumerate(TIME_TERMS) if name in pins) for columns, _ in bases])
    time = np.array([[columns[i] for i in free] for columns, _ in bases])
    fixed = np.array([f for _, f in bases]) + pinned
    solution = non_negative_fit(time / measured[:, None], list((measured - fixed) / measured))
    found.update(pins)
    for i, value in zip(free, solution, strict=True):
        name = TIME_TERMS[i][0]
        found[name] = float(f"{1 / value if name in INVERSE_RATES and value else value:.3g}")
    return found


def non_negative_fit(x: np.ndarray, y: list[float]) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best of the unconstrained fits over each subset of the
    columns whose coefficients all come out non-negative (a few columns: every subset is cheap)."""
    best, best_error = np.zeros(x.shape[1]), float("inf")
    for mask in range(1, 2 ** x.shape[1]):
        columns = [i for i in range(x.shape[1]) if mask >> i & 1]
        solution = np.linalg.lstsq(x[:, columns], y, rcond=None)[0]
        if (solution < 0).any():
            continue
        full = np.zeros(x.shape[1])
        full[columns] = solution
        error = float(np.sum((x @ full - y) ** 2))
        if error < best_error:
            best, best_error = full, error
    return best


