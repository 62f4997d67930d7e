"""Peak memory of this process, in MiB, with one meaning for train and bench.

CUDA: the most memory PyTorch's allocator has held on the device. CPU: the process's peak resident
set size (Linux's VmHWM), which counts everything resident (libraries, data), not only tensors.
Both are "since the last `reset_peak_memory`", or since the process started when there was none.

`return_freed_memory` makes a CPU process's resident memory follow its tensors (glibc's heap otherwise keeps
what they freed): training ranks call it, so that their peak is what the planner models and what its CPU
calibration measured (the holes glibc keeps are unpredictable: tiny at 4,096 tokens with LoRA peaked at 1,849 MiB
left to glibc, above full fine-tuning's 1,579, against 1,022 and 761 MiB with the threshold fixed). Evaluation and
generation leave glibc as it is: fixing the threshold maps and faults in every tensor over 1 MiB afresh, which cost
RULER at 4,096 tokens 3.6x the system time (54 vs 15 CPU s, 79 vs 55 s wall).
"""

from __future__ import annotations

import ctypes
import resource

import torch

# glibc's malloc serves an allocation below its mmap threshold from its heap, and raises the threshold (up to 32 MiB)
# each time a larger block is freed; a training step's tensors of a few MiB then land in the heap, whose freed holes
# it keeps: SmolLM2-135M at 2,048 tokens with full recomputation peaked at 3,549 MiB resident against 2,776 MiB with
# the threshold fixed. Fixed at 1 MiB, every larger tensor has its own mapping, returned to the system when freed.
MMAP_THRESHOLD_BYTES = 2**20
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def return_freed_memory() -> None:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES for this process (a no-op without glibc)."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass  # not glibc (musl, macOS): its allocator is left as it is


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
