"""`burst plan` and the estimate it shares with the preflight of `burst train` and `burst eval`."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli import app
from models import ModelConfig, Transformer, save_model
from planner import RunShape, calibration, estimate, memory_estimate
from planner import fit as planner_fit
from planner.fit import check_fits
from planner.hardware import Hardware, gpu, memory_only
from trainer import preflight
from trainer.config import TrainConfig
from trainer.plan import PlanRequest, plan, search

TABLE = Path(__file__).resolve().parent.parent / "benchmarks" / "plan_calibration.json"
MIB = 2**20


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


# The H200 measurements of issue 36: llama3.2-1b and tiny, vocabulary 4,096, bf16, one GPU.
H200 = [("llama3.2-1b", 131072, "selective", 56057, 11.8), ("llama3.2-1b", 32768, "selective", 22622, 1.26),
        ("tiny", 32768, "none", 8099, None)]


@pytest.mark.parametrize(("model", "seq_len", "mode", "mib", "seconds"), H200)
def test_the_h200_figures_are_predicted_within_10_percent_memory_and_20_percent_time(model, seq_len, mode, mib,
                                                                                    seconds):
    config = RunShape(seq_len=seq_len, precision="bf16", activation_checkpointing=mode)
    result = estimate(config, dataclasses.replace(ModelConfig.from_name(model), vocab_size=4096), gpu("h200"))
    # measured as torch.cuda.max_memory_allocated: the tensors alone
    assert abs(result.allocated_bytes / MIB / mib - 1) <= 0.10, result.memory_bytes
    if seconds is not None:
        assert abs(result.step_time_s / seconds - 1) <= 0.20, result.step_time_parts
    assert result.fits and result.peak_memory_bytes > result.allocated_bytes  # + CUDA context and allocator


def test_the_plan_json_has_what_schedulers_read(tmp_path):
    out = tmp_path / "plan.json"
    result = invoke("plan", "--gpu", "h200", "--model", "llama3.2-1b", "--vocab-size", 4096, "--seq-len", 32768,
                    "--activation-checkpointing", "selective", "--json", out)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    for key in ("peak_memory_bytes", "memory_bytes", "step_time_s", "step_time_parts", "tokens_per_s", "mfu",
                "fits"):
        assert key in document
    assert document["peak_memory_bytes"] == sum(document["memory_bytes"].values())
    assert document["fits"] is True and 0 < document["mfu"] < 1
    assert document["tokens_per_s"] == pytest.approx(32768 / document["step_time_s"])
    assert "activations" in result.output and "tokens/s per GPU" in result.output


def test_the_8b_search_at_128k_on_8_h100s_returns_settings_that_fit(tmp_path):
    # Its speed (seconds) is a benchmark's figure, not a timed assertion on a shared machine.
    out = tmp_path / "search.json"
    result = invoke("plan", "--gpu", "h100", "--gpus-per-node", 8, "--model", "llama3.1-8b", "--seq-len", 131072,
                    "--search", "--json", out)
    assert result.exit_code == 0, result.output
    found = json.loads(out.read_text())["search"]
    assert found and all(row["fits"] and row["peak_memory_bytes"] <= gpu("h100").memory_bytes for row in found)
    assert all(row["cp"] * row["dp"] == 8 for row in found)
    speeds = [row["tokens_per_s"] for row in found]
    assert speeds == sorted(speeds, reverse=True)
    assert "cp  dp recompute" in result.output
    # no recomputation keeps every block's activations: 16K tokens a rank of the 8B model cannot keep them
    assert not any(row["activation_checkpointing"] == "none" for row in found)


def test_nothing_fits_says_the_longest_sequence_that_does():
    request = PlanRequest(TrainConfig(model="llama3.1-8b", seq_len=2**24), gpu="a100", gpus_per_node=8)
    found, longest, _ = search(request)
    assert found == [] and longest is not None and longest.seq_len < 2**24
    assert estimate(longest, ModelConfig.from_name("llama3.1-8b"), gpu("a100")).fits
    twice = dataclasses.replace(longest, seq_len=2 * longest.seq_len)
    assert not estimate(twice, ModelConfig.from_name("llama3.1-8b"), gpu("a100")).fits


def test_the_preflight_and_the_plan_are_the_same_estimate(monkeypatch):
    """burst train refuses exactly what burst plan says does not fit: both call memory_estimate."""
    tiny = ModelConfig.from_name("tiny")
    hardware = Hardware("this CPU", "cpu", 8 * 2**30, 0.1, 0.1, 1.0, 1.0, 1.0, 1, 1)
    monkeypatch.setattr(planner_fit, "available_memory_bytes", lambda: hardware.memory_bytes)
    for seq_len in (4096, 65536, 262144):
        config = preflight.run_shape(TrainConfig(model="tiny", seq_len=seq_len, cp=2, precision="fp32"))
        planned = estimate(config, tiny, hardware)
        assert planned.capacity_bytes == hardware.memory_bytes // 2  # two local ranks share the machine
        if planned.fits:
            check_fits(config, tiny, 2)
        else:
            with pytest.raises(ValueError, match=f"would need about {2 * planned.peak_memory_bytes / 2**30:,.1f} GiB"):
                check_fits(config, tiny, 2)


def test_a_run_that_cannot_fit_is_refused_before_any_process_starts_naming_settings_that_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(planner_fit, "available_memory_bytes", lambda: 24 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    started = []
    monkeypatch.setattr("trainer.launch.run_local", lambda *a, **k: started.append(a), raising=False)
    out = tmp_path / "run"
    result = invoke("train", "--model", "tiny", "--seq-len", 65536, "--cp", 2, "--precision", "fp32", "--out", out)
    assert result.exit_code == 2, result.output
    assert "would need about" in result.output and "use --cp " in result.output
    assert not started and not (out / "metrics.jsonl").exists()
    suggested = result.output.split("use ")[1].split(" (about")[0].split()
    config = RunShape(seq_len=65536, cp=int(suggested[1]), dp=int(suggested[3]),
                      activation_checkpointing=suggested[5], precision="fp32")
    assert sum(memory_estimate(config, ModelConfig.from_name("tiny"), memory_only("cpu", 24 * 2**30),
                               local_ranks=2)[0].values()) <= 12 * 2**30


def test_eval_is_refused_up_front_when_its_sequence_cannot_fit(tmp_path, monkeypatch):
    """Defect 5 of issue 35: burst eval --seq-len 100000 was killed for memory; now the forward-only estimate
    (linear in the sequence: no dense mask) refuses it before reading any data, naming --cp that would fit."""
    debug = ModelConfig.from_name("debug")
    model = tmp_path / "model"
    save_model(Transformer(debug), debug, model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    forward = RunShape(seq_len=2**20, precision="fp32", forward_only=True)
    parts, _ = memory_estimate(forward, debug, memory_only("cpu", 2**40))
    assert "gradients" not in parts and "optimizer state" not in parts
    needed = sum(parts.values())
    monkeypatch.setattr(planner_fit, "available_memory_bytes", lambda: int(needed * 0.9))
    result = invoke("eval", "--checkpoint", model, "--seq-len", 2**20, "--precision", "fp32",
                    "--data", tmp_path / "no-store")  # the memory check comes before the data is read
    assert result.exit_code == 2, result.output
    # on one CPU more ranks share the same memory: a shorter sequence is what fits
    assert "1 local rank on this machine would need about" in result.output
    assert "lower --seq-len (to 524,288 as set)" in result.output and "Traceback" not in result.output
    # on a GPU each rank has its own memory: more ranks fit (a GPU of 90% of what one rank would need)
    on_gpu = sum(memory_estimate(forward, debug, memory_only("cuda", 2**40))[0].values())
    device = type("Properties", (), {"name": "NVIDIA H200", "total_memory": int(on_gpu * 0.9)})
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda index: device)
    with pytest.raises(ValueError, match=r"one rank's GPU would need about .* use --cp 2 \(about"):
        check_fits(forward, debug, 1, "cuda")


def test_the_estimate_is_linear_in_the_sequence_for_forward_only():
    debug = ModelConfig.from_name("debug")
    sizes = [sum(memory_estimate(RunShape(seq_len=n, precision="fp32", forward_only=True), debug,
                                 memory_only("cpu", 2**40))[0].values()) for n in (2**18, 2**19, 2**20)]
    assert sizes[2] - sizes[1] == pytest.approx(2 * (sizes[1] - sizes[0]), rel=1e-3)


def test_document_masks_and_prefix_sharing_cut_attention_as_the_plan_runs_them():
    tiny = ModelConfig.from_name("tiny")
    h100 = gpu("h100")
    whole = RunShape(seq_len=65536, cp=4, precision="bf16")
    masked = dataclasses.replace(whole, doc_len=4096, layout="balanced")
    full = estimate(whole, tiny, h100).step_time_parts["attention"]
    documents = estimate(masked, tiny, h100).step_time_parts["attention"]
    assert documents == pytest.approx(full * 4096 / 65536, rel=0.15)  # 16 causal documents: 1/16 the pairs
    shared = estimate(dataclasses.replace(masked, prefix_sharing=True), tiny, h100)
    assert shared.step_time_parts["attention"] > documents  # answers also see their prompt whole


def test_a_mix_of_document_lengths_counts_attention_by_its_length_weighted_mean():
    from planner.attention import busiest_rank_pairs, document_boundaries, effective_doc_len
    from planner.time import shape_plan

    assert effective_doc_len([100] * 10, 4096) == 100
    assert effective_doc_len([10, 90], 4096) == 82  # (10^2 + 90^2) / 100: the long one holds most pairs
    assert effective_doc_len([300], 100) == 100  # cut into three sequence-long pieces
    with pytest.raises(ValueError, match="no documents"):
        effective_doc_len([], 100)
    # a pattern repeats across the sequence: a preference pair's prompt and two answers
    assert document_boundaries(20, [8, 2, 2]) == [0, 8, 10, 12, 20]
    assert document_boundaries(20, 6) == [0, 6, 12, 18, 20]
    assert document_boundaries(20, 20) is None
    # the pairs the plan counts for documents of the weighted length come near the real mix's (causal: l(l+1)/2
    # each; the sequence's last document is cut short), where the plain mean's count half of them
    lengths = [64, 448, 64, 448]
    config = RunShape(seq_len=1024, layout="balanced")
    real = sum(n * (n + 1) // 2 for n in lengths)
    weighted = busiest_rank_pairs(shape_plan(dataclasses.replace(config, doc_len=effective_doc_len(lengths, 1024))))
    mean = busiest_rank_pairs(shape_plan(dataclasses.replace(config, doc_len=sum(lengths) // len(lengths))))
    assert weighted == pytest.approx(real, rel=0.10) and mean < 0.7 * real


def test_the_plan_takes_the_document_length_from_the_stores_it_would_train_on(tmp_path, monkeypatch):
    from tests.test_data_loader import make_store
    from trainer.plan import documents_length

    make_store(tmp_path / "short", [30] * 40)
    make_store(tmp_path / "long", [900, 100])
    config = TrainConfig(model="debug", seq_len=1024, doc_mask=True, data=[f"a={tmp_path / 'short'}:0.5",
                                                                         f"b={tmp_path / 'long'}:0.5"])
    lengths = {"short": 32, "long": round((902**2 + 102**2) / 1004)}  # each document framed by BOS and EOS
    assert documents_length(PlanRequest(config)) == round(0.5 * lengths["short"] + 0.5 * lengths["long"])
    assert documents_length(PlanRequest(config, doc_len=500)) == 500  # --doc-len wins
    assert documents_length(PlanRequest(dataclasses.replace(config, doc_mask=False))) is None
    result = invoke("plan", "--model", "debug", "--seq-len", 1024, "--data", tmp_path / "long", "--doc-mask",
                    "--precision", "fp32", "--json", tmp_path / "plan.json")
    assert result.exit_code == 0, result.output
    assert f"documents of {lengths['long']:,} tokens" in result.output
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["doc_len"] == lengths["long"]
    # a preset takes the store's vocabulary, as `burst train` gives it (make_store's tokenizer has 300,000)
    assert written["vocab_size"] == 300_000 and "model: 300,000-token vocabulary\n" in result.output
    preset = invoke("plan", "--model", "debug", "--seq-len", 1024, "--precision", "fp32")
    assert "4,096-token vocabulary (the preset's: pass --data or --vocab-size" in preset.output


def test_the_gpu_table_names_its_sources_and_refuses_unknown_gpus():
    for name in ("h100", "h200", "a100", "b200"):
        assert gpu(name).source and gpu(name).memory_bytes > 70 * 2**30
    with pytest.raises(ValueError, match="known: h100, h200, a100, b200"):
        gpu("v100")
    with pytest.raises(ValueError, match="raise --gpus-per-node or --nodes"):
        plan(PlanRequest(TrainConfig(model="tiny", cp=4, dp=4, seq_len=8192), gpu="h100", gpus_per_node=8))


def test_the_calibration_constants_are_the_fit_of_the_stored_table_and_reproduce_its_measurements():
    """The CPU constants in planner/calibration.py are what benchmarks/plan_calibration.py fits on the stored
    measurements' calibration half (no run repeated here). As measured on a 2-core machine (docs/plan.md; peaks
    measured again with training's mmap threshold fixed, runtime/memory.py, step times from a quiet machine): in fp32,
    step time within 25% on every row (the issue's target), peak memory within 10% on every row of both precisions.
    bf16 has its own constants and time bounds below."""
    from benchmarks.plan_calibration import fit, report

    table = json.loads(TABLE.read_text())
    fp32 = [row for row in table["rows"] if row.get("precision", "fp32") == "fp32"]
    assert len(fp32) >= 34 and max(row["seq_len"] for row in fp32) >= 131072
    assert {row["documents"] for row in fp32} == {"one", "packed", "pairs"}
    for precision in ("fp32", "bf16"):
        for name, value in fit(table, precision).items():
            assert getattr(calibration.CPU.constants(precision), name) == pytest.approx(value, rel=1e-3, abs=1e-12), (
                precision, name)
    lines = report(table)
    assert all(row.get("peak_threshold_fixed") for row in table["rows"])  # every peak measured as training runs now
    fp32 = [line for line in lines if line["precision"] == "fp32"]
    assert all(abs(line["time_error"]) <= 0.25 for line in fp32), [line["time_error"] for line in fp32]
    # peak memory within 10% on every row, fitted or held out, in both precisions (measured: -3.5% to +6.1%)
    assert all(abs(line["memory_error"]) <= 0.10 for line in lines), [line["memory_error"] for line in lines]
    # bf16 (its own constants, from a grid half the size): held-out time within 25%; every row's time within 30%
    bf16 = [line for line in lines if line["precision"] == "bf16"]
    assert len(bf16) >= 16
    assert all(abs(line["time_error"]) <= 0.30 for line in bf16), [line["time_error"] for line in bf16]
    assert all(abs(line["time_error"]) <= 0.25 for line in bf16 if line["held_out"])


def test_the_memory_rows_lora_tiling_and_offload_are_estimated_within_10_percent():
    """Issue 44: the calibration's memory rows (tiny at 4,096 tokens, full recomputation, 2 steps: LoRA r16 on every
    target, the tiled MLP and loss, offloaded activations, each beside the same shape without them), none of them
    fitted on, are estimated within 10% with the code's constants, and so are the changes they make (measured:
    +1.3% to +2.9%)."""
    from benchmarks.plan_calibration import memory_report

    lines = memory_report(json.loads(TABLE.read_text()))
    assert len(lines) == 4 and {} in [line["memory"] for line in lines]
    assert all(abs(line["memory_error"]) <= 0.10 for line in lines), [line["memory_error"] for line in lines]
    plain = next(line for line in lines if not line["memory"])
    for line in lines:
        measured, estimated = line["peak_mib"] - plain["peak_mib"], line["est_mib"] - plain["est_mib"]
        assert abs(estimated - measured) <= 0.10 * plain["peak_mib"], (line["memory"], measured, estimated)


def test_a_cpu_plan_in_bf16_takes_the_bf16_constants_and_says_so_where_the_cpu_has_no_native_bf16(monkeypatch):
    """bf16 on a CPU has its own constants (autocast keeps most saved tensors in float32: tiny at 4,096 tokens held
    1,768 MiB in bf16 and 2,133 in fp32 with preference pairs: not the half a bf16 copy of every saved tensor
    would keep), fitted on the
    bf16 grid of a CPU with native bf16; where the CPU has none, the plan says its step time is not that CPU's."""
    import trainer.plan as plan_module

    cpu = Hardware("this CPU", "cpu", 2**40, 0.4, 0.4, 5.0, 1.0, 10.0, 1, 1, "test", 2)
    tiny = ModelConfig.from_name("tiny")
    bf16_shape, fp32_shape = RunShape(seq_len=4096, precision="bf16"), RunShape(seq_len=4096, precision="fp32")
    bf16, fp32 = estimate(bf16_shape, tiny, cpu), estimate(fp32_shape, tiny, cpu)
    assert bf16.memory_bytes["process"] == calibration.CPU.bf16.process_bytes
    assert 0.7 < bf16.peak_memory_bytes / fp32.peak_memory_bytes < 1.0  # not half: float32 is kept
    monkeypatch.setattr(plan_module, "native_cpu_bf16", lambda: False)
    assert "no native bf16" in plan_module.format_plan(TrainConfig(model="tiny"), bf16_shape, bf16, cpu)
    assert "no native bf16" not in plan_module.format_plan(TrainConfig(model="tiny"), fp32_shape, fp32, cpu)
    monkeypatch.setattr(plan_module, "native_cpu_bf16", lambda: True)
    assert "no native bf16" not in plan_module.format_plan(TrainConfig(model="tiny"), bf16_shape, bf16, cpu)


# Issue 45's `burst plan` defects, each refused or fixed where it entered.

def test_the_json_file_is_not_replaced_without_force(tmp_path):
    """Defect 1: --json replaced any file, the store's metadata or the config file it read too."""
    out = tmp_path / "plan.json"
    out.write_text("keep me")
    args = ["plan", "--gpu", "h100", "--model", "tiny", "--seq-len", 4096, "--json", out]
    refused = invoke(*args)
    assert refused.exit_code == 2 and "already exists" in refused.output and "--force" in refused.output
    assert out.read_text() == "keep me"
    assert invoke(*args, "--force").exit_code == 0 and json.loads(out.read_text())["fits"] is True
    directory = invoke("plan", "--gpu", "h100", "--json", tmp_path)
    assert directory.exit_code == 2 and "is a directory" in directory.output


@pytest.mark.parametrize("doc_len", [0, -5])
def test_a_document_length_below_one_is_refused(doc_len):
    """Defect 2: --doc-len 0 never returned, its boundaries growing without bound."""
    result = invoke("plan", "--gpu", "h100", "--model", "tiny", "--seq-len", 4096, "--doc-mask", "--doc-len", doc_len)
    assert result.exit_code == 2 and f"--doc-len {doc_len} must be at least 1" in result.output


def test_doc_len_needs_doc_mask_and_one_longer_than_the_sequence_counts_one_document(tmp_path):
    """Defect 10: --doc-len without --doc-mask was ignored in silence, and one longer than the sequence was reported
    as the length attention was counted for."""
    alone = invoke("plan", "--gpu", "h100", "--model", "tiny", "--seq-len", 4096, "--doc-len", 512)
    assert alone.exit_code == 2 and "add --doc-mask, or drop --doc-len" in alone.output
    out = tmp_path / "plan.json"
    longer = invoke("plan", "--gpu", "h100", "--model", "tiny", "--seq-len", 4096, "--doc-mask", "--doc-len", 8192,
                    "--json", out)
    assert longer.exit_code == 0, longer.output
    assert "documents of 8,192" not in longer.output and json.loads(out.read_text())["doc_len"] is None
    assert "--doc-len 8,192 is not shorter than --seq-len 4,096: one document a sequence" in longer.output


@pytest.mark.parametrize("flag, value", [("--gpus-per-node", 0), ("--nodes", 0), ("--nodes", -2),
                                         ("--vocab-size", 0)])
def test_hardware_flags_below_one_are_refused(flag, value):
    """Defect 13: 0 was taken as "not given", a negative planned nonsense."""
    result = invoke("plan", "--gpu", "h100", "--model", "tiny", "--seq-len", 4096, flag, value)
    assert result.exit_code == 2 and f"{flag} {value} must be at least 1" in result.output


def test_the_search_names_the_processors_it_lays_out_and_the_longest_fitting_length_in_its_json(tmp_path):
    """Defect 11: on a CPU the header named 1 x this CPU while laying out cp x dp processes; a search where nothing
    fits wrote no longest-fitting length in its JSON."""
    cpu = invoke("plan", "--model", "debug", "--seq-len", 4096, "--cp", 2, "--precision", "fp32", "--search")
    assert cpu.exit_code == 0, cpu.output
    assert "on 2 processes on this CPU" in cpu.output.splitlines()[0]
    out = tmp_path / "search.json"
    none = invoke("plan", "--gpu", "a100", "--gpus-per-node", 8, "--model", "llama3.1-8b", "--seq-len", 2**24,
                  "--search", "--json", out)
    assert none.exit_code == 0, none.output
    document = json.loads(out.read_text())
    assert document["search"] == [] and document["longest_seq_len"] == search(PlanRequest(
        TrainConfig(model="llama3.1-8b", seq_len=2**24), gpu="a100", gpus_per_node=8))[1].seq_len
    assert f"{document['longest_seq_len']:,}" in none.output


def test_fp32_on_a_gpu_is_counted_at_its_fp32_rate():
    """Defect 17: --gpu h100 --precision fp32 counted fp32 matmuls at the bf16 tensor-core rate (989 TFLOP/s, where
    fp32 without TF32 runs at the datasheet's 67)."""
    tiny, h100 = ModelConfig.from_name("tiny"), gpu("h100")
    fp32 = estimate(RunShape(seq_len=4096, precision="fp32"), tiny, h100)
    bf16 = estimate(RunShape(seq_len=4096, precision="bf16"), tiny, h100)
    assert fp32.peak_tflops == 67.0 and bf16.peak_tflops == 989.0
    assert fp32.step_time_parts["matmuls"] == pytest.approx(bf16.step_time_parts["matmuls"] * 989 / 67)


def test_the_plan_takes_device_and_burst_device_as_train_does(monkeypatch):
    """Defect 9: on a machine with a GPU, --device cpu (or BURST_DEVICE=cpu) still planned the GPU's ranks."""
    import torch

    monkeypatch.delenv("BURST_DEVICE", raising=False)  # the suite's conftest sets it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    properties = type("Properties", (), {"name": "NVIDIA H100 80GB HBM3", "total_memory": 80 * 2**30})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    args = ("plan", "--model", "debug", "--seq-len", 1024, "--precision", "fp32")
    assert "on NVIDIA H100 80GB HBM3" in invoke(*args).output.splitlines()[0]
    assert "on this CPU" in invoke(*args, "--device", "cpu").output.splitlines()[0]
    monkeypatch.setenv("BURST_DEVICE", "cpu")
    assert "on this CPU" in invoke(*args).output.splitlines()[0]
    both = invoke("plan", "--gpu", "h100", "--device", "cpu")
    assert both.exit_code == 2 and "drop one" in both.output


def test_the_plan_resolves_and_refuses_document_masks_as_train_does(tmp_path):
    """Defect 5: the plan neither took --doc-mask from an instruction store (on by default there, as in train) nor
    refused what train refuses (--no-doc-mask on it, --objective nll on a preference store)."""
    from tests.test_conversation_packing import make_chat_store

    make_chat_store(tmp_path / "chat", [60] * 30)
    args = ("plan", "--model", "debug", "--seq-len", 1024, "--precision", "fp32", "--data", tmp_path / "chat")
    implied = invoke(*args)
    assert implied.exit_code == 0 and "documents: attention counted for documents of" in implied.output
    refused = invoke(*args, "--no-doc-mask")
    assert refused.exit_code == 2 and "--no-doc-mask is refused" in refused.output
    wrong = invoke(*args, "--objective", "simpo")
    assert wrong.exit_code == 2 and "trains on one preference store" in wrong.output


def test_eval_counts_its_reference_model_and_suggests_only_eval_settings(tmp_path, monkeypatch):
    """Defects 8 and 14: eval's memory check left out --reference's model (held beside the policy), and its refusal
    suggested training's settings (--batch-size, --dp) that eval does not take."""
    from evaluation.run import EvalConfig, check_memory

    debug = ModelConfig.from_name("debug")
    model = tmp_path / "model"
    save_model(Transformer(debug), debug, model)
    one = sum(memory_estimate(RunShape(seq_len=1024, precision="fp32", forward_only=True), debug,
                              memory_only("cpu", 2**40))[0].values())
    two = sum(memory_estimate(RunShape(seq_len=1024, precision="fp32", forward_only=True, models=2), debug,
                              memory_only("cpu", 2**40))[0].values())
    from models.footprint import footprint
    from planner.hardware import memory_only as machine
    from planner.memory import memory_parts

    weights = [memory_parts(RunShape(seq_len=1024, precision="fp32", forward_only=True, models=n), footprint(debug),
                            machine("cpu", 2**40))["weights"] for n in (1, 2)]
    assert weights == [4 * n * sum(p.numel() for p in Transformer(debug).parameters()) for n in (1, 2)]
    monkeypatch.setattr(planner_fit, "available_memory_bytes", lambda: (one + two) // 2)
    settings = dict(checkpoint=model, seq_len=1024, passkey_trials=0, precision="fp32", device="cpu")
    check_memory(EvalConfig(**settings))  # the policy alone fits
    with pytest.raises(ValueError, match="would need about") as refused:
        check_memory(EvalConfig(**settings, reference=model))
    assert "--batch-size" not in str(refused.value) and "--dp" not in str(refused.value)


def test_init_from_plans_the_runs_model(tmp_path):
    """Defect 4: `burst plan --init-from RUN` planned the tiny preset; it now resolves the model as `burst train`
    does (trainer/preflight.py's resolve_model): the run's own, here debug's weights."""
    run = tmp_path / "run"
    trained = invoke("train", "--model", "debug", "--seq-len", 256, "--steps", 1, "--precision", "fp32",
                     "--val-tokens", 0, "--out", run)  # the embedded corpus: a 4,096-token vocabulary
    assert trained.exit_code == 0, trained.output
    out = tmp_path / "plan.json"
    planned = invoke("plan", "--init-from", run, "--seq-len", 256, "--precision", "fp32", "--json", out)
    assert planned.exit_code == 0, planned.output
    debug = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=4096)
    parameters = sum(p.numel() for p in Transformer(debug).parameters())
    assert json.loads(out.read_text())["memory_bytes"]["weights"] == 4 * parameters
    assert planned.output.startswith(f"plan: --init-from {run},")


def test_calibrate_fits_this_machines_constants_keeps_them_and_the_plan_says_whose_it_used(tmp_path, monkeypatch):
    """Issue 45: a plan made with another machine's constants says so; `burst plan --calibrate` fits this machine's
    from short runs (here faked: steps whose memory and time a known set of constants gives, so the fit must find
    them), keeps them per machine, and every plan after uses them and says so in its JSON."""
    import planner.hardware
    import trainer.calibrate
    from planner.calibrate import predict

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(planner.hardware, "machine_id", lambda device: "AMD EPYC 7B13, 2 threads, AVX512")
    monkeypatch.setattr(trainer.calibrate, "machine_id", lambda device: "AMD EPYC 7B13, 2 threads, AVX512")
    for module in (planner.hardware, trainer.calibrate):
        monkeypatch.setattr(module, "cpu_matmul_tflops", lambda cache=None, dtype=None: 0.25)
    args = ("plan", "--model", "debug", "--seq-len", 4096, "--precision", "fp32", "--device", "cpu")
    before = tmp_path / "before.json"
    shipped = invoke(*args, "--json", before)
    assert shipped.exit_code == 0, shipped.output
    assert "constants were fitted on Intel(R) Xeon(R) Processor, 2 threads, AVX512, not on AMD EPYC" in shipped.output
    assert json.loads(before.read_text())["hardware"]["calibration"]["this_machine"] is False

    truth = dataclasses.replace(calibration.CPU, fp32=dataclasses.replace(
        calibration.CPU.fp32, process_bytes=500 * MIB, block_bytes_per_value=5.0, step_overhead_s=0.05,
        elementwise_s_per_value=1.0e-9, attention_score_s=4.0e-10, ring_step_s=0.004))
    table = {"device": "cpu", "cores": 2, "cpu_matmul_tflops": 0.25, "cpu_bf16_matmul_tflops": 0.25}

    def measured(flags):  # what this machine "measures": the estimate under the true constants
        value = lambda flag: flags[flags.index(flag) + 1]  # noqa: E731
        row = {"model": value("--model"), "seq_len": int(value("--seq-len")), "cp": int(value("--cp")), "dp": 1,
               "mode": value("--activation-checkpointing"), "precision": "fp32", "documents": "one",
               "doc_pattern": None}
        peak_mib, step_s = predict(row, table, truth)
        return {"peak_mib": peak_mib, "step_s": step_s}

    monkeypatch.setattr(trainer.calibrate, "measure_run", measured)
    after = tmp_path / "after.json"
    calibrated = invoke(*args, "--calibrate", "--json", after)
    assert calibrated.exit_code == 0, calibrated.output
    assert "constants were fitted on" not in calibrated.output
    record = json.loads(after.read_text())["hardware"]["calibration"]
    assert record["this_machine"] is True and record["source"].startswith("burst plan --calibrate")
    fitted = record["constants"]["fp32"]
    for name in ("process_bytes", "block_bytes_per_value", "step_overhead_s", "elementwise_s_per_value"):
        assert fitted[name] == pytest.approx(getattr(truth.fp32, name), rel=0.02), name
    # the time fit is linear around a step whose FSDP and ring traffic may or may not hide (max terms): the
    # hand-off it finds can differ, the steps it predicts may not
    found = calibration.cached("AMD EPYC 7B13, 2 threads, AVX512")
    for model, seq_len, cp, mode in trainer.calibrate.CPU_GRID:
        row = {"model": model, "seq_len": seq_len, "cp": cp, "dp": 1, "mode": mode, "precision": "fp32",
               "documents": "one", "doc_pattern": None}
        assert predict(row, table, found)[1] == pytest.approx(predict(row, table, truth)[1], rel=0.05), row
        assert predict(row, table, found)[0] == pytest.approx(predict(row, table, truth)[0], rel=0.02), row
    # kept: a later plan (and the fit check) on this machine uses it without calibrating again
    again = tmp_path / "again.json"
    assert invoke(*args, "--json", again).exit_code == 0
    assert json.loads(again.read_text())["step_time_s"] == pytest.approx(json.loads(after.read_text())["step_time_s"])
    assert json.loads(again.read_text())["step_time_s"] != pytest.approx(json.loads(before.read_text())["step_time_s"])
    assert calibration.cached("AMD EPYC 7B13, 2 threads, AVX512").fp32.process_bytes == fitted["process_bytes"]


def test_the_calibrations_markdown_table_is_printed_from_the_stored_table_without_measuring(monkeypatch, capsys):
    """`plan_calibration.py --markdown` (docs/plan.md's table) ran the whole 30-minute grid again before printing,
    and would have replaced the stored measurements with those of whatever else the machine was doing."""
    import benchmarks.plan_calibration as grid

    def measure(*args, **kwargs):
        raise AssertionError("--markdown measured")

    monkeypatch.setattr(grid, "run_one", measure)
    monkeypatch.setattr(grid, "cpu_matmul_tflops", measure)
    monkeypatch.setattr(sys, "argv", ["plan_calibration.py", "--markdown"])
    before = TABLE.read_bytes()
    grid.main()
    grid, memory = capsys.readouterr().out.strip().split("\n\n")
    assert grid.startswith("| dtype | model |") and len(grid.splitlines()) == 2 + len(json.loads(before)["rows"])
    assert memory.startswith("| flags") and len(memory.splitlines()) == 2 + len(json.loads(before)["memory_rows"])
    assert TABLE.read_bytes() == before
