import json

import torch
from typer.testing import CliRunner

from burst.attention import input_signature
from cli import app


def test_bench_attention_writes_figures_for_each_mode(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "attention", "--nproc", "2", "--seq-len", "256", "--heads", "4",
                                      "--kv-heads", "2", "--head-dim", "16", "--iters", "1", "--doc-length", "32",
                                      "--dtype", "bf16", "--json", str(out)])  # not auto: bytes must not vary by CPU
    assert result.exit_code == 0, result.output
    runs = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"single process", "single process docs", "burst x2", "ring x2", "burst docs x2",
                         "ring docs x2"}
    assert runs["single process"]["sent_forward_mib"] == 0
    mib = 2**20
    kv_bytes = 128 * 2 * 16 * 2  # local k: 128 tokens x 2 heads x 16 dims x 2 bytes (bf16)
    agreement = len(input_signature(*[torch.empty(1, 128, 2, 16)] * 3, True, "auto", "auto", None)) * 8
    assert runs["burst x2"]["sent_forward_mib"] * mib == 2 * kv_bytes + agreement  # k and v, one hop
    assert runs["ring x2"]["sent_backward_mib"] * mib == 2 * kv_bytes + 2 * 2 * kv_bytes  # k, v + float32 dk, dv
    assert runs["ring docs x2"]["sent_backward_mib"] == runs["ring x2"]["sent_backward_mib"]  # the ring still turns
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 and r["peak_memory_mib"] > 0 for r in runs.values())


def test_bench_attention_rejects_bad_shapes():
    result = CliRunner().invoke(app, ["bench", "attention", "--nproc", "2", "--seq-len", "250"])
    assert result.exit_code == 2
    assert "multiple of 2 x world size = 4" in result.output
