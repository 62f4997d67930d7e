"""runtime/memory.py's measuring_environment: a process started with it gives freed tensors back to the system, so
its peak resident memory counts tensors (what the planner models); glibc's default, which ordinary runs keep for
speed, holds them in its heap."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from runtime.memory import measuring_environment

# Raise glibc's dynamic threshold past 4 MiB (free one such block), then hold 40 blocks of 4 MiB, each followed by a
# small tensor that stays (so the heap cannot shrink from its top), free the large ones and print how many MiB of
# resident memory that gave back.
PROBE = """
import torch
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
del_me = torch.ones(2**20); del del_me
large, small = [], []
for _ in range(40):
    large.append(torch.ones(2**20))
    small.append(torch.ones(2**14))
held = rss()
del large
print(held - rss())
"""


def returned_mib(env: dict[str, str]) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return float(done.stdout)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_measuring_environment_gives_freed_tensors_back():
    import os

    assert returned_mib(measuring_environment()) > 140  # 160 MiB freed
    default = {key: value for key, value in os.environ.items() if key != "MALLOC_MMAP_THRESHOLD_"}
    assert returned_mib(default) < 20  # why the measuring runs need it: the heap keeps them
