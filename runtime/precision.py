"""`--precision auto`: bf16 where the hardware computes in bf16 natively, fp32 elsewhere.

bf16 autocast on a CPU without native bf16 instructions is emulated, and far slower than fp32
(PyTorch's CPU flash kernel: 12.0 s bf16 against 2.2 s fp32 for one 4,096-token forward and
backward on an AVX2-only EPYC core), so "auto" takes bf16 only on CUDA devices that support it
and on CPUs whose /proc/cpuinfo lists AVX512-BF16 or AMX-BF16.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

PRECISIONS = ("auto", "bf16", "fp32")
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class Precision:
    """The precision a run computes in ("bf16" or "fp32") and why it was chosen."""

    name: str
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.name == "bf16" else torch.float32


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The instruction-set flags of this CPU (Linux); an empty set where /proc/cpuinfo is missing."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def resolve_precision(requested: str, device: torch.device, flags: set[str] | None = None) -> Precision:
    """`requested` ("auto", "bf16" or "fp32") as the precision to run in on `device`.

    flags: the CPU's flags (default: read from /proc/cpuinfo), given by tests.
    """
    if requested not in PRECISIONS:
        raise ValueError(f"precision {requested!r} is not one of {', '.join(PRECISIONS)}")
    if requested != "auto":
        return Precision(requested, "as requested")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return Precision("bf16", "auto: this CUDA device computes in bf16 natively")
        return Precision("fp32", "auto: this CUDA device has no native bf16")
    native = sorted(set(NATIVE_BF16_CPU_FLAGS) & (cpu_flags() if flags is None else flags))
    if native:
        return Precision("bf16", f"auto: this CPU computes in bf16 natively ({', '.join(native)})")
    return Precision("fp32", "auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo), "
                             "where bf16 autocast runs many times slower than fp32")
