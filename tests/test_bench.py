import json

import pytest
import torch
from typer.testing import CliRunner

from burst.attention import input_signature
from cli import app


def test_bench_attention_writes_figures_for_each_mode(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "attention", "--nproc", "2", "--seq-len", "256", "--heads", "4",
                                      "--kv-heads", "2", "--head-dim", "16", "--iters", "1", "--doc-length", "32",
                                      "--dtype", "bf16", "--json", str(out)],  # not auto: bytes must not vary by CPU
                                env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    legible_at_80_columns(result.output, "single process", "x-node MiB")
    runs = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"single process", "single process docs", "burst x2", "ring x2", "burst docs x2",
                         "ring docs x2"}
    assert runs["single process"]["sent_forward_mib"] == 0
    mib = 2**20
    kv_bytes = 128 * 2 * 16 * 2  # local k: 128 tokens x 2 heads x 16 dims x 2 bytes (bf16)
    agreement = len(input_signature(*[torch.empty(1, 128, 2, 16)] * 3, True, "auto", "auto", None)) * 8
    assert runs["burst x2"]["sent_forward_mib"] * mib == 2 * kv_bytes + agreement  # k and v, one hop
    # rank 0, which sends most: half its k and v (rank 1's queries see only its first chunk), and float32 dk, dv
    # of all of rank 1's block
    assert runs["ring x2"]["sent_backward_mib"] * mib == kv_bytes + 2 * 2 * kv_bytes
    # documents of 32 tokens inside the zigzag chunks of 64: no rank needs another's block, nothing travels
    assert runs["ring docs x2"]["sent_backward_mib"] == runs["burst docs x2"]["sent_backward_mib"] == 0
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 and r["peak_memory_mib"] > 0 for r in runs.values())


def test_bench_attention_rejects_bad_shapes():
    result = CliRunner().invoke(app, ["bench", "attention", "--nproc", "2", "--seq-len", "250"])
    assert result.exit_code == 2
    assert "multiple of 2 x world size = 4" in result.output


def legible_at_80_columns(output: str, *phrases: str) -> None:
    """The tables fit 80 columns with their labels whole (not folded into unreadable slivers)."""
    assert max(map(len, output.splitlines())) <= 80, output
    assert "…" not in output and all(phrase in output for phrase in phrases), output


def test_bench_attention_docs_counts_both_layouts_of_real_packed_sequences(store, tmp_path):
    out = tmp_path / "docs.json"
    result = CliRunner().invoke(app, ["bench", "attention", "--docs", str(store), "--seq-len", "4096", "--nproc", "4",
                                      "--sequences", "6", "--plan-only", "--heads", "4", "--head-dim", "16",
                                      "--dtype", "bf16", "--json", str(out)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    legible_at_80_columns(result.output, "slowest rank / mean rank", "masked share of computed tiles")
    figures = json.loads(out.read_text())
    assert figures["config"]["sequences"] == 6 and not figures["timed"]
    zigzag, balanced = figures["summary"]["zigzag"], figures["summary"]["balanced"]
    assert 1 <= balanced["imbalance"] <= zigzag["imbalance"] and balanced["imbalance_p90"] <= zigzag["imbalance_p90"]
    assert balanced["masked_share"] <= zigzag["masked_share"] + 0.02 and zigzag["chunks_per_rank"] == 2
    full = 3 * (2 * 1024 * 4 * 16 * 2 + 2 * 1024 * 4 * 16 * 2 + 2 * 1024 * 4 * 4 + 1024 * 4 * 16 * 4) / 2**20
    for layout in ("zigzag", "balanced"):  # bytes: every block a rank needs, no more; here some steps are idle
        rows = [r for r in figures["sequences"] if r["layout"] == layout]
        assert all(r["sent_mib_max"] <= full * (1 + 1e-9) for r in rows)
        assert all(r["sent_mib_mean"] <= full * (1 - r["idle_steps"]) * (1 + 1e-9) for r in rows)


@pytest.mark.parametrize("args, message", [
    (["--plan-only"], "pass --docs STORE"),
    (["--docs", "/nonexistent/store"], "/nonexistent/store"),
    (["--layouts", "zigzag,diagonal", "--doc-length", "32"], "unknown --layouts layout 'diagonal'"),
])
def test_bench_attention_refuses_bad_document_options(args, message):
    result = CliRunner().invoke(app, ["bench", "attention", "--nproc", "2", "--seq-len", "256", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_bench_attention_docs_replays_each_ranks_kernel_calls(store, tmp_path):
    out = tmp_path / "replay.json"
    result = CliRunner().invoke(app, ["bench", "attention", "--docs", str(store), "--seq-len", "1024", "--nproc", "4",
                                      "--sequences", "4", "--replay", "--heads", "2", "--head-dim", "16", "--iters",
                                      "1", "--dtype", "fp32", "--json", str(out)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    legible_at_80_columns(result.output, "slowest rank / mean rank", " balanced   ring ")
    timed = json.loads(out.read_text())["timed"]
    assert {(r["layout"], r["mode"]) for r in timed} == {(lay, mode) for lay in ("zigzag", "balanced")
                                                          for mode in ("burst", "ring")}
    assert len({r["sequence"] for r in timed}) in (1, 2)  # the p90-imbalanced and the most balanced sequence
    assert all(r["forward_cpu_s"] > 0 and r["backward_cpu_s"] > 0 and r["cpu_s_mean"] <= r["cpu_s"] for r in timed)
