"""Peak memory of this process, in MiB, with one meaning for train and bench.

CUDA: the most memory PyTorch's allocator has held on the device. CPU: the process's peak resident
set size (Linux's VmHWM), which counts everything resident (libraries, data), not only tensors.
Both are "since the last `reset_peak_memory`", or since the process started when there was none.

`return_freed_memory` makes a CPU process's resident memory follow its tensors (glibc's heap otherwise keeps
what they freed): training ranks call it, so that their peak is what the planner models and what its CPU
calibration measured (the holes glibc keeps are unpredictable: tiny at 4,096 tokens with LoRA peaked at 1,849 MiB
left to glibc, above full fine-tuning's 1,579, against 1,022 and 761 MiB with the threshold fixed). Evaluation and
generation leave glibc as it is: fixing the threshold maps and faults in every tensor over 1 MiB afresh, which cost
RULER at 4,096 tokens 3.6x the system time (54 vs 15 CPU s, 79 vs 55 s wall). Generation goes further
(`heap_for_large_tensors`): glibc's default still maps every tensor over 32 MiB afresh (a batch's activations and
cache are larger), so each large op pays for faulting in zeroed pages.
"""

from __future__ import annotations

import ctypes
import resource
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# glibc's malloc serves an allocation below its mmap threshold from its heap, and raises the threshold (up to 32 MiB)
# each time a larger block is freed; a training step's tensors of a few MiB then land in the heap, whose freed holes
# it keeps: SmolLM2-135M at 2,048 tokens with full recomputation peaked at 3,549 MiB resident against 2,776 MiB with
# the threshold fixed. Fixed at 1 MiB, every larger tensor has its own mapping, returned to the system when freed.
MMAP_THRESHOLD_BYTES = 2**20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # mallopt's parameter numbers (malloc.h)
# What `heap_for_large_tensors` puts back: the fixed threshold where `return_freed_memory` set one, else the state
# glibc's dynamic threshold reaches once a tensor over 32 MiB was freed (its ceiling, trimming at twice that).
DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD, DYNAMIC_MMAP_THRESHOLD_MAX = 65536, 128 * 2**10, 32 * 2**20
fixed_threshold: int | None = None


def mallopt(*settings: tuple[int, int]) -> bool:
    """Set glibc malloc's (parameter, value) pairs in order; False without glibc (musl, macOS: left as it is)."""
    try:
        libc = ctypes.CDLL(None)
        for parameter, value in settings:
            libc.mallopt(parameter, value)
    except (OSError, AttributeError):
        return False
    return True


def return_freed_memory() -> None:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES for this process (a no-op without glibc)."""
    global fixed_threshold
    if mallopt((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)):
        fixed_threshold = MMAP_THRESHOLD_BYTES


@contextmanager
def heap_for_large_tensors() -> Iterator[None]:
    """Inside: every allocation comes from glibc's heap and freed memory stays there, so a tensor the size of one
    just freed reuses its pages instead of mapping and faulting in new ones (SmolLM2's generation at 8 x 2,048
    tokens in float32: the same values, 14% less CPU time for the prefill and per decoded token). After: freed
    memory goes back to the system and the threshold is what it was (fixed, or glibc's dynamic ceiling)."""
    changed = mallopt((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))
    try:
        yield
    finally:
        if changed:
            threshold, trim = (fixed_threshold, DEFAULT_TRIM_THRESHOLD) if fixed_threshold else \
                (DYNAMIC_MMAP_THRESHOLD_MAX, 2 * DYNAMIC_MMAP_THRESHOLD_MAX)
            mallopt((M_MMAP_MAX, DEFAULT_MMAP_MAX), (M_MMAP_THRESHOLD, threshold), (M_TRIM_THRESHOLD, trim))
            ctypes.CDLL(None).malloc_trim(0)


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
