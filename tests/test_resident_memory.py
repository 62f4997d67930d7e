"""runtime/memory.py's return_freed_memory: a process that calls it (every CPU training rank) gives freed tensors back
to the system, so that its peak resident memory counts tensors, as the planner models them; glibc's default, which
evaluation keeps for speed, holds them in its heap. And which processes call it."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

# Raise glibc's dynamic threshold past 4 MiB (free one such block), then hold 40 blocks of 4 MiB, each followed by a
# small tensor that stays (so the heap cannot shrink from its top), free the large ones and print how many MiB of
# resident memory that gave back.
PROBE = """
import sys
import torch
from runtime.memory import return_freed_memory
if sys.argv[1] == 'fixed':
    return_freed_memory()
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


def returned_mib(allocator: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, allocator], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    return float(done.stdout)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_return_freed_memory_gives_freed_tensors_back():
    assert returned_mib("fixed") > 140  # 160 MiB freed
    assert returned_mib("default") < 20  # why training ranks call it: glibc's heap keeps them


def test_training_ranks_return_freed_memory_and_evaluation_ranks_do_not(monkeypatch):
    import runtime.memory
    import runtime.process
    import trainer.distributed
    from trainer.config import TrainConfig

    calls = []
    monkeypatch.setattr(trainer.distributed, "return_freed_memory", lambda: calls.append("train"))
    monkeypatch.setattr(runtime.memory, "return_freed_memory", lambda: calls.append("runtime"))
    trainer.distributed.init_distributed(TrainConfig(device="cpu"))
    assert calls == ["train"]
    runtime.process.worker_device("cpu")  # evaluation's ranks: glibc left as it is
    assert calls == ["train"]


# Generate twice from a tiny model, a batch whose activations pass glibc's 32 MiB ceiling (2 x 2,048 tokens x 4,096
# features), inside heap_for_large_tensors (after return_freed_memory where asked) and after it; print the pages the
# second batch of each faulted in, whether both gave the same tokens, and the MiB the heap gave back on leaving.
# One thread: an OpenMP worker's first allocation of a size may open a glibc arena of its own (64 MiB faulted in
# at once, 16,384 pages), which thread gets to it first varies, and the count inside then flaked (about 1 run in 5
# on two cores, suite 2026-12-06); the main thread's heap is what the context manages.
HEAP_PROBE = """
import resource, sys
import torch
torch.set_num_threads(1)
from evaluation.generate import Stops, generate
from evaluation.sampling import Sampling
from models import ModelConfig, init_model
from runtime.memory import heap_for_large_tensors, return_freed_memory
if sys.argv[1] == 'fixed':
    return_freed_memory()
class Digits:
    def decode(self, ids):
        return " ".join(map(str, ids))
model = init_model(ModelConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden_dim=4096))
prompts = torch.randint(0, 512, (2, 2048), generator=torch.Generator().manual_seed(0)).tolist()
def faults_of_a_batch():
    for _ in range(3):  # the third: the heap may still grow once on the second (ASLR and fragmentation vary)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = generate(model, prompts, Digits(), Stops(), 2, Sampling())
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, [o.token_ids for o in out]
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
with heap_for_large_tensors():
    inside, tokens_inside = faults_of_a_batch()
    held = rss()
returned = held - rss()
after, tokens_after = faults_of_a_batch()
print(inside, after, tokens_inside == tokens_after, returned)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
@pytest.mark.parametrize("allocator", ["default", "fixed"])
def test_generation_reuses_freed_tensors_and_gives_them_back_after(allocator):
    done = subprocess.run([sys.executable, "-c", HEAP_PROBE, allocator], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    inside, after, same, returned = done.stdout.split()
    if allocator == "default":  # as generation's ranks run (after return_freed_memory, fewer: 1/4 to none)
        assert int(inside) < int(after) / 5  # the heap's pages reused instead of faulted in afresh
    assert same == "True"  # the allocator changes no value
    assert float(returned) > 64  # on leaving, the freed activations go back to the system
