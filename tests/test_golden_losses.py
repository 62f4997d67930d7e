"""Golden losses: short `burst train` runs whose losses must not move while the code is restructured.

The losses were recorded from main before the restructuring of issue 41 (documents, planner, config); a change
that means to keep behaviour must keep them bit-identical on one machine. The tolerance (relative 1e-6) only
leaves room for another CPU's SIMD kernels summing in another order. After a change that is meant to move a
loss, record them again and say why in the commit:

    PYTHONPATH=. python -m tests.test_golden_losses --record
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

import pytest

from data import prepare
from tests.fixtures import burst_train_together, metrics

GOLDEN = Path(__file__).with_name("golden_losses.json")
RELATIVE = 1e-6
WORDS = ["def", "return", "self", "import", "tensor", "rank", "shard", "ring", "(", ")", ":", "=", "+", "0", "1"]

# name -> the flags that differ; short documents (about 20 to 300 tokens) in sequences of 256, so --doc-mask
# cuts every sequence into several documents and the balanced layout has choices to make.
RUNS = {
    "debug-cp1": ["--model", "debug"],
    "debug-cp1-doc-mask": ["--model", "debug", "--doc-mask"],
    "debug-cp2": ["--model", "debug", "--cp", 2],
    "debug-cp2-doc-mask": ["--model", "debug", "--cp", 2, "--doc-mask"],  # balanced layout (auto)
    "debug-cp2-doc-mask-zigzag": ["--model", "debug", "--cp", 2, "--doc-mask", "--cp-layout", "zigzag"],
    "tiny-cp1-doc-mask": ["--model", "tiny", "--doc-mask"],
    "tiny-cp2-doc-mask": ["--model", "tiny", "--cp", 2, "--doc-mask"],
}
COMMON = ["--seq-len", 256, "--steps", 3, "--precision", "fp32", "--device", "cpu", "--val-tokens", 0, "--seed", 3]


def make_store(root: Path) -> Path:
    """A small store of short code-like documents with a 320-token vocabulary, the same on every machine."""
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(60):
        lines = (" " * rng.choice([0, 4]) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
                 for _ in range(rng.randint(2, 40)))
        (corpus / f"doc{i:02d}.py").write_text("\n".join(lines) + "\n")
    prepare([corpus], root / "store", vocab_size=320, val_fraction=0.05, workers=1, progress=False)
    return root / "store"


def run_all(root: Path, timeout: float = 400) -> dict[str, list[float]]:
    """Each run's losses. The runs start at once, each held to one core of this machine (its ranks share it):
    every rank then computes with one thread, as it would on any machine, and none spins waiting for a
    thread that another run holds."""
    store = make_store(root)
    cores = sorted(os.sched_getaffinity(0))
    runs = burst_train_together(*([*flags, *COMMON, "--data", store, "--out", root / name]
                                  for name, flags in RUNS.items()),
                                timeout=timeout, cores=[{cores[i % len(cores)]} for i in range(len(RUNS))])
    for name, done in zip(RUNS, runs, strict=True):
        assert done.returncode == 0, f"{name}: {done.stdout[-1500:]}{done.stderr[-1500:]}"
    return {name: [row["loss"] for row in metrics(root / name)] for name in RUNS}


@pytest.fixture(scope="module")
def losses(tmp_path_factory) -> dict[str, list[float]]:
    return run_all(tmp_path_factory.mktemp("golden"))


@pytest.mark.parametrize("name", list(RUNS))
def test_losses_are_the_recorded_ones(losses, name):
    golden = [float.fromhex(x) for x in json.loads(GOLDEN.read_text())[name]]
    got = losses[name]
    assert len(got) == len(golden) and all(abs(g - e) <= RELATIVE * abs(e) for g, e in zip(got, golden, strict=True)), \
        f"{name}: losses {[x.hex() for x in got]}, recorded {[x.hex() for x in golden]}"


def test_the_runs_differ_where_their_settings_do():
    """A guard that cannot fail is none: the document mask and the model change the recorded losses."""
    golden = json.loads(GOLDEN.read_text())
    assert golden["debug-cp1"] != golden["debug-cp1-doc-mask"]
    assert golden["debug-cp2"] != golden["debug-cp2-doc-mask"] != golden["tiny-cp2-doc-mask"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.test_golden_losses --record")
    with tempfile.TemporaryDirectory() as directory:
        recorded = run_all(Path(directory))
    GOLDEN.write_text(json.dumps({name: [x.hex() for x in values] for name, values in recorded.items()}, indent=1)
                      + "\n")
    for name, values in recorded.items():
        print(name, *(x.hex() for x in values))
