"""scripts/gpu_benchmark.py's --smoke mode: the benchmark's own code on the CPU at tiny sizes, its one table checked
row by row. The training runs are faked (a `burst train` process takes a minute on a loaded CPU): the fake writes
the metrics file the real one writes, so the table's training rows, FLOP count and MFU are checked too."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import gpu_benchmark  # noqa: E402


def fake_train(command, cwd, stdout, stderr, check, env):
    out = Path(command[command.index("--out") + 1])
    out.mkdir(parents=True)
    steps = int(command[command.index("--steps") + 1])
    lines = [{"event": "model_ready"}] + [{"step": s, "tokens_per_s": 1000.0 * s, "peak_mem_mib": 512.0}
                                          for s in range(1, steps + 1)]
    (out / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return subprocess.CompletedProcess(command, 0)


def test_smoke_mode_writes_one_table_with_every_part(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_benchmark.subprocess, "run", fake_train)
    assert gpu_benchmark.main(["--smoke", "--out", str(tmp_path / "run"), "--peak-tflops", "1e-3"]) == 0
    table = (tmp_path / "run" / "benchmark.md").read_text().splitlines()
    assert table[2] == "| " + " | ".join(gpu_benchmark.COLUMNS) + " |"
    rows = [line.strip("|").split(" | ") for line in table[4:]]
    runs = [(r[0].strip(), r[1], r[2]) for r in rows]
    assert runs == [("kernel", "SDPA fastest (cpu flash)", "128"), ("kernel", "cpu", "128"),
                    ("burst_attn", "world of one (cpu)", "128"),
                    ("kernel", "SDPA fastest (cpu flash)", "256"), ("kernel", "cpu", "256"),
                    ("burst_attn", "world of one (cpu)", "256"),
                    ("train", "tiny plain", "256"), ("train", "tiny doc-mask", "256")]
    for r in rows[:6]:
        assert float(r[3].replace(",", "")) > 0 and r[5].endswith("x")  # a time and a ratio to SDPA
    flops, _ = gpu_benchmark.planned(gpu_benchmark.SMOKE, 256, "doc-mask")
    saved = json.loads((tmp_path / "run" / "benchmark.json").read_text())["rows"]
    assert saved[-1]["tokens_per_s"] == 2000.0 and saved[-1]["peak_mib"] == 512.0  # the last step's
    assert saved[-1]["tflops"] == pytest.approx(2000.0 * flops / 1e12)
    assert saved[-1]["mfu"] == pytest.approx(saved[-1]["tflops"] / 1e-3)


def test_the_benchmark_and_burst_plan_give_one_run_one_mfu(tmp_path, monkeypatch):
    """Issue 41: the benchmark's MFU is the planner's FLOP count over the planner's peak, so a run going at the speed
    `burst plan` predicts shows the MFU `burst plan` printed for it."""
    from typer.testing import CliRunner

    import planner.hardware
    from cli import app
    from data import default_store

    monkeypatch.setattr(planner.hardware, "cpu_matmul_tflops", lambda cache=None, dtype=None: 0.25)
    document = tmp_path / "plan.json"
    planned = CliRunner().invoke(app, ["plan", "--model", "tiny", "--seq-len", "256", "--precision", "fp32",
                                       "--activation-checkpointing", "selective", "--data",
                                       str(default_store(progress=False)), "--json", str(document)])
    assert planned.exit_code == 0, planned.output
    plan = json.loads(document.read_text())
    printed = planned.output.split("MFU ")[1].split()[0]

    def at_the_planned_speed(command, cwd, stdout, stderr, check, env):
        done = fake_train(command, cwd, stdout, stderr, check, env)
        out = Path(command[command.index("--out") + 1])
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens_per_s": plan["tokens_per_s"],
                                                       "peak_mem_mib": 512.0}) + "\n")
        return done

    monkeypatch.setattr(gpu_benchmark.subprocess, "run", at_the_planned_speed)
    assert gpu_benchmark.main(["--smoke", "--out", str(tmp_path / "run")]) == 0
    plain = next(r for r in json.loads((tmp_path / "run" / "benchmark.json").read_text())["rows"]
                 if r["run"] == "tiny plain")
    assert plain["mfu"] == pytest.approx(plan["mfu"], rel=1e-9)
    row = next(line for line in (tmp_path / "run" / "benchmark.md").read_text().splitlines() if "tiny plain" in line)
    assert f" {printed} " in row  # the same figure printed


def test_the_flop_count_is_the_models_matrices_and_attentions_pairs():
    """The one FLOP count (planner/time.py's model_flops), against the parameters of transformers' LLaMA of the same
    shape: 6 per parameter of every matrix the tokens meet (the blocks' and the output head, not the embedding
    lookup or the norms) and, for causal attention over s tokens, 3 x 4 x h x d x L FLOPs per visible pair
    (s (s + 1) / 2 of them)."""
    import dataclasses

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from models import ModelConfig
    from models.footprint import footprint
    from planner import RunShape
    from planner.time import model_flops_per_token

    config = dataclasses.replace(ModelConfig.from_name("llama3.2-1b"), vocab_size=4096)
    hf = LlamaConfig(hidden_size=config.dim, intermediate_size=config.ffn_hidden_dim,
                     num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
                     num_key_value_heads=config.n_kv_heads, vocab_size=config.vocab_size, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf)
    matrices = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name)
    head = config.vocab_size * config.dim  # tied: the embedding's table, multiplied as the head
    s, heads, head_dim = 131072, config.n_heads, config.dim // config.n_heads
    expected = 6 * (matrices + head) + 3 * 4 * heads * head_dim * config.n_layers * (s * (s + 1) // 2) / s
    assert model_flops_per_token(RunShape(seq_len=s), footprint(config)) == pytest.approx(expected, rel=1e-12)


def test_an_existing_run_directory_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        gpu_benchmark.main(["--smoke", "--out", str(tmp_path)])
