"""The estimate's constants that cannot be derived from shapes, fitted to measurements this repo can repeat.

GPU (bf16 on CUDA, torch.cuda.max_memory_allocated and step times, one H200, issue 36): llama3.2-1b with a
4,096-token vocabulary, selective recomputation, 56,057 MiB at 131,072 tokens and 22,622 MiB at 32,768;
tiny without recomputation at 32,768 tokens, 8,099 MiB; steps of 11.8 s and 1.26 s with attention at
320 TFLOP/s. The two 1B points are linear in the tokens with a slope that is the selective layers' kept
bytes (fp32 block input + bf16 attention output) plus one recomputed block: what fixes block_bytes_per_value
on CUDA; tiny's point then checks it (8,099 measured). The terms only the CPU grid can separate (a block's
gradients in flight, memory-bound work, the softmax per score, ring hand-offs) are folded into these on CUDA.

CPU (fp32, peak resident set size of the largest rank): `python benchmarks/plan_calibration.py` runs the grid
(34 configurations: debug and tiny, 1K-128K tokens, cp 1-4, dp 1-2, every recomputation mode, packed documents and
preference pairs with the prompt shared; about 12 minutes on 2 idle cores), rewrites benchmarks/plan_calibration.json,
fits these constants on its even rows (each row, and the slope between rows that differ only in length) and reports
the odd ones (`--report`: from the stored table, running nothing); tests/test_plan.py checks that the constants here
are that fit. Peaks as measured again with training's mmap threshold fixed (`--peaks`, 2026-12-06): within 10% on
every row of both precisions and on the LoRA, tiling and offload rows.
The allocator's share is fixed at 10% and what lies outside the blocks at 0 (not separable on these
presets); the matmul and attention-product rates are the measured matmul rate (not fitted); docs/plan.md has the
table. bf16 on CPU: its own 16-row grid on this CPU's native bf16 (AMX), fitted the same way, with
gloo's hand-off taken from fp32.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Constants:
    """The constants of one device in one precision (the width its matmuls run in)."""

    # Bytes one token keeps per value of a block's `block_width` (models/footprint.py) when the block is not
    # recomputed: the saved inputs of its matmuls, norms, rotary embedding and SwiGLU, in their dtypes.
    block_bytes_per_value: float
    # Bytes one token holds per value of `block_width` in the block backward is in, beyond its saved tensors: the
    # gradients in flight through it (CPU; on CUDA folded into block_bytes_per_value by the two-point fit).
    backward_bytes_per_value: float
    # Bytes one token holds per value of `block_width` beyond that when the whole block is recomputed (full): on CPU
    # the fit finds almost nothing once freed tensors leave the process (runtime/memory.py); no CUDA measurement.
    full_recompute_bytes_per_value: float
    # Values of the compute dtype per dim each layer keeps beyond its input under selective recomputation: attention's
    # output on CUDA; on CPU the fit finds 0.6 (fp32) and 0 (bf16, where autocast keeps the block's input in fp32).
    selective_values_per_dim: float
    # Bytes per token per dim kept outside the blocks (embedding output, final norm, the loss's hidden rows).
    outer_bytes_per_dim: float
    # Fraction of the dense matmul peak the model's matmuls reach (on CPU, of the measured rate).
    matmul_efficiency: float
    # Attention's products (QK^T and PV) against the attention rate: on CUDA the measured kernel rate, on CPU the
    # measured matmul rate (PyTorch's flash kernel for CPU).
    attention_fraction: float
    # Seconds per value of a block's width per token per pass of its memory-bound work (norms, rotary, SwiGLU, adds),
    # on one rank with the machine to itself. On CUDA it is folded into matmul_efficiency (two step times fix both).
    elementwise_s_per_value: float
    # Seconds per attention score (query, key, head) per pass for the softmax's exp, max and sum, beside the FLOPs of
    # QK^T and PV (on CPU it is most of attention at head dims 16-64); on CUDA inside the measured attention rate.
    attention_score_s: float
    # Seconds of one ring step's hand-off (gloo's send/receive pair on CPU, where the ranks share the cores).
    ring_step_s: float
    # What the process holds beyond its tensors: the CUDA context (not in max_memory_allocated), or a CPU rank's
    # Python, torch and libraries (peak RSS before the first tensor, measured ~350 MiB).
    process_bytes: int
    # The caching allocator's reserve beyond what is allocated (CUDA), or malloc's on CPU.
    allocator_overhead: float
    # Seconds of fixed work per step outside the model (data, logging, Python): measured on each device.
    step_overhead_s: float


@dataclass(frozen=True)
class Calibration:
    """One machine's calibration record: the machine its constants were fitted on, and the constants by precision
    (a CPU's bf16 has its own: autocast on CPU changes what is kept and how fast each part runs)."""

    machine: str  # what the constants were fitted on, as `machine_id` names it (a GPU's name, a CPU's model)
    device: str  # cuda or cpu
    fp32: Constants
    bf16: Constants
    source: str  # how they were measured

    def constants(self, precision: str) -> Constants:
        return self.bf16 if precision == "bf16" else self.fp32


_CUDA = Constants(block_bytes_per_value=4.66, backward_bytes_per_value=0.0, full_recompute_bytes_per_value=0.0,
                  selective_values_per_dim=1.0, outer_bytes_per_dim=10.0, matmul_efficiency=0.5,
                  attention_fraction=1.0, elementwise_s_per_value=0.0, attention_score_s=0.0, ring_step_s=0.0,
                  process_bytes=600 * 2**20, allocator_overhead=0.06, step_overhead_s=0.05)
# One H200 (issue 36), bf16; fp32 on a GPU is counted with the same constants at the GPU's fp32 rate.
GPU = Calibration("NVIDIA H200", "cuda", _CUDA, _CUDA, "issue 36's H200 measurements (bf16, one GPU)")
# A 2-core Intel Xeon with AVX-512, avx512_bf16 and amx_bf16 (docs/plan.md): the fp32 grid and the bf16 grid.
CPU = Calibration(
    "Intel(R) Xeon(R) Processor, 2 threads, AVX512", "cpu",
    Constants(block_bytes_per_value=3.217, backward_bytes_per_value=0.0, full_recompute_bytes_per_value=0.123,
              selective_values_per_dim=0.641, outer_bytes_per_dim=0.0, matmul_efficiency=1.0, attention_fraction=1.0,
              elementwise_s_per_value=2.03e-09, attention_score_s=2.73e-10, ring_step_s=0.00767,
              process_bytes=354418688, allocator_overhead=0.10, step_overhead_s=0.029),
    Constants(block_bytes_per_value=2.095, backward_bytes_per_value=0.0, full_recompute_bytes_per_value=0.0,
              selective_values_per_dim=0.0, outer_bytes_per_dim=0.0, matmul_efficiency=1.0, attention_fraction=1.0,
              elementwise_s_per_value=8.94e-10, attention_score_s=5.95e-10, ring_step_s=0.00767,
              process_bytes=391118848, allocator_overhead=0.10, step_overhead_s=0.0717),
    "benchmarks/plan_calibration.py's grids (fp32: 34 rows, bf16: 16), fitted on the even rows (docs/plan.md)")


def default(device: str) -> Calibration:
    """The record shipped for `device`: the H200's for CUDA, the calibration CPU's for a CPU."""
    return GPU if device == "cuda" else CPU


def cache_path() -> Path:
    """Where `burst plan --calibrate` keeps each machine's record: ~/.cache/burst/calibration.json."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "burst" / "calibration.json"


def cached(machine: str) -> Calibration | None:
    """The record `burst plan --calibrate` fitted on `machine` (planner/hardware.py's machine_id), or None."""
    try:
        entry = json.loads(cache_path().read_text())[machine]
        return Calibration(entry["machine"], entry["device"], Constants(**entry["fp32"]), Constants(**entry["bf16"]),
                           entry["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(record: Calibration) -> Path:
    """Keep `record` as its machine's, beside other machines' records; returns the file."""
    path = cache_path()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**known, record.machine: asdict(record)}, indent=1) + "\n")
    return path
