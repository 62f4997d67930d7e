"""Peak memory of this process, in MiB, with one meaning for train and bench.

CUDA: the most memory PyTorch's allocator has held on the device. CPU: the process's peak resident
set size (Linux's VmHWM), which counts everything resident (libraries, data), not only tensors.
Both are "since the last `reset_peak_memory`", or since the process started when there was none.

Resident memory on the CPU counts what glibc's heap keeps of freed tensors too. A run that measures memory
as the planner models it (tensors resident, nothing kept) fixes glibc's mmap threshold in the processes it starts:
`measuring_environment()`. Ordinary runs leave glibc as it is: fixing the threshold maps and faults in every
tensor over 1 MiB afresh, which cost an evaluation 2.8x the system time (RULER at 4,096 tokens: 54 vs 15 CPU s of
sys, 79 vs 55 s wall) and the `tiny` training run 30%.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping

import torch

# glibc's malloc serves an allocation below its mmap threshold from its heap, and raises the threshold (up to 32 MiB)
# each time a larger block is freed; a training step's tensors of a few MiB then land in the heap, whose freed holes
# it keeps: SmolLM2-135M at 2,048 tokens with full recomputation peaked at 3,549 MiB resident against 2,776 MiB with
# the threshold fixed. Fixed at 1 MiB, every larger tensor has its own mapping, returned to the system when freed.
MMAP_THRESHOLD_BYTES = 2**20


def measuring_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (os.environ by default) with glibc's mmap threshold fixed at MMAP_THRESHOLD_BYTES
    (MALLOC_MMAP_THRESHOLD_, read by glibc when a process starts and inherited by the ranks it spawns): the
    environment of a process whose peak resident memory is measured against the planner's model."""
    return {**(os.environ if base is None else base), "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)}


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak measurement (on CPU, Linux's VmHWM via /proc/self/clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux: the peak since process start is reported instead


def peak_memory_mib(device: torch.device) -> float:
    """Peak since the last reset: allocated CUDA memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
