"""benchmarks/smollm2_extension.py at its quick scale: every variant scored, both training stages run over two
invocations, everything cached.

At --cp 1: what this test checks is the benchmark's own work (its variants, stages, resume, cache, table and plot),
which --cp only passes on to `burst train` and `burst eval`; at cp 2 each of its 11 commands started three
processes instead of one (the suite's costliest test, 226 CPU s). What cp 2 adds is checked where it is the point:
eval's figures at cp 2 equal cp 1's (tests/test_eval.py), a cp 2 run stopped and resumed, also at another cp,
gives the uninterrupted losses (tests/test_checkpoint.py, tests/test_stages.py), and a scaled RoPE rotates a
shard by the whole sequence's positions (tests/test_rope.py).

Its first command (`burst prepare`) runs as the benchmark runs each, a process of its own; the others run in this
process, through the same command line (CliRunner): at cp 1 a `burst train` or `burst eval` is this process's
work, and each process started for one imported torch again (about 4 CPU s, 10 of them)."""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

import benchmarks.smollm2_extension
from benchmarks.smollm2_extension import QUICK, main
from cli import app

QUICK_CP1 = ["--scale", "quick", "--cp", "1"]


def test_the_extension_benchmark_scores_every_variant_resumes_its_stages_and_reruns_cached(smollm2_2_layers, tmp_path,
                                                                                         monkeypatch):
    commands, in_a_process = [], benchmarks.smollm2_extension.burst

    def burst(*args: object, shown: str | None = None) -> float:
        commands.append(str(args[0]))
        if len(commands) == 1:
            return in_a_process(*args, shown=shown)
        result = CliRunner().invoke(app, list(map(str, args)))
        assert result.exit_code == 0, result.output
        return 0.0

    monkeypatch.setattr(benchmarks.smollm2_extension, "burst", burst)
    out = tmp_path / "extension"
    partial = main([*QUICK_CP1, "--out", str(out), "--stop-after", "1"])  # the stages stop at step 1 of 2
    assert list(partial["variants"]) == ["original", "linear", "dynamic", "yarn", "theta"]
    assert (out / "runs" / "yarn+training" / "checkpoints" / "step-000001").is_dir()
    summary = main([*QUICK_CP1, "--out", str(out)])  # the stages continue (--resume) to their last step
    variants = summary["variants"]
    assert list(variants) == ["original", "linear", "dynamic", "yarn", "theta", "yarn+training", "theta+training"]
    for name, figures in variants.items():
        assert math.isfinite(figures["loss_within"]) and math.isfinite(figures["loss_beyond"])
        assert list(figures["passkey_by_length"]) == list(QUICK.passkey_lengths)
        trained = name.endswith("+training")
        assert figures["tokens"] == (QUICK.steps * QUICK.extended if trained else 0)
        assert (figures["train_seconds"] > 0) == trained
    configs = {name: json.loads((out / "models" / name / "config.json").read_text()) for name in ("yarn", "theta")}
    assert configs["yarn"]["rope_parameters"]["rope_type"] == "yarn"
    assert configs["theta"]["rope_parameters"]["rope_theta"] > 100_000
    trained = json.loads((out / "runs" / "yarn+training" / "checkpoints" / f"step-{QUICK.steps:06d}" /
                          "config.json").read_text())
    assert trained["rope_scaling"]["rope_type"] == "yarn"  # the stage trains the variant it started from
    table = (out / "smollm2-extension.md").read_text()
    assert "| yarn+training |" in table and "tokens trained" in table
    assert (out / "smollm2-extension.png").read_bytes()[:4] == b"\x89PNG"

    evaluations = {path: path.stat().st_mtime_ns for path in out.glob("*-eval.json")}
    assert len(evaluations) == 7
    assert commands == ["prepare", *["train"] * 2, *["eval"] * 5, *["train"] * 2, *["eval"] * 2]
    assert main([*QUICK_CP1, "--out", str(out)]) == summary  # nothing run again: every part is cached
    assert len(commands) == 12
    assert {path: path.stat().st_mtime_ns for path in out.glob("*-eval.json")} == evaluations
