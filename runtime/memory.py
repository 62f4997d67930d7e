"""Peak memory of this process, in MiB, with one meaning for train and bench.

CUDA: the most memory PyTorch's allocator has held on the device. CPU: the process's peak resident
set size (Linux's VmHWM), which counts everything resident (libraries, data), not only tensors.
Both are "since the last `reset_peak_memory`", or since the process started when there was none.
"""

from __future__ import annotations

import resource

import torch


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
