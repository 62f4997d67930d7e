"""--device auto|cpu|cuda and BURST_DEVICE (runtime/device.py): how they resolve, on machines with and without GPUs
(simulated: torch.cuda is monkeypatched, and CUDA is never touched), and how train, eval and bench use them."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import tomllib
import torch
from typer.testing import CliRunner

import trainer.launch
from bench.attention import AttentionBenchConfig
from cli import app
from data import prepare
from evaluation import EvalConfig
from runtime.device import resolve_device
from runtime.process import worker_device
from trainer.config import TrainConfig, load_config, load_run_config
from trainer.launch import launch


def gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """This process sees `count` CUDA GPUs (0: none), and fails the test if it touches one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    def touched(*_args, **_kwargs):
        raise AssertionError("CUDA was touched")

    monkeypatch.setattr(torch.cuda, "set_device", touched)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", touched)


@pytest.mark.parametrize("requested, environment, visible, ranks, kind, reason", [
    (None, None, 0, 1, "cpu", "auto: no CUDA device"),
    (None, None, 0, 4, "cpu", "auto: no CUDA device"),  # gloo ranks: as many as the cores allow
    (None, None, 2, 2, "cuda", "auto: CUDA is available (2 GPUs)"),
    ("auto", None, 1, 1, "cuda", "auto: CUDA is available (1 GPU)"),
    ("cpu", None, 8, 16, "cpu", "--device cpu"),  # CPU ranks beside GPUs: any number
    ("cuda", None, 2, 1, "cuda", "--device cuda"),
    (None, "cpu", 1, 2, "cpu", "BURST_DEVICE=cpu"),
    (None, "cuda", 1, 1, "cuda", "BURST_DEVICE=cuda"),
    ("cuda", "cpu", 1, 1, "cuda", "--device cuda"),  # the flag (or config file) before the environment
    ("cpu", "cuda", 0, 2, "cpu", "--device cpu"),
    (None, "auto", 0, 1, "cpu", "auto: no CUDA device"),
])
def test_the_device_resolves_flag_then_environment_then_auto(monkeypatch, requested, environment, visible, ranks,
                                                               kind, reason):
    gpus(monkeypatch, visible)
    if environment is None:
        monkeypatch.delenv("BURST_DEVICE", raising=False)
    else:
        monkeypatch.setenv("BURST_DEVICE", environment)
    device = resolve_device(requested, local_ranks=ranks)
    assert (device.kind, device.reason) == (kind, reason)
    assert device.backend == ("nccl" if kind == "cuda" else "gloo")


@pytest.mark.parametrize("requested, environment, visible, ranks, refusal", [
    ("cuda", None, 0, 1, "--device cuda: this machine has no CUDA device"),
    (None, "cuda", 0, 1, "BURST_DEVICE=cuda: this machine has no CUDA device"),
    (None, None, 1, 2, "--cp x --dp = 2 ranks on this machine need 2 GPUs (one each), and it has 1; run them on the "
                       "CPU with --device cpu"),
    ("cuda", None, 2, 3, "use at most 2 ranks here, or start them on several machines with torchrun"),
    ("gpu", None, 1, 1, "--device 'gpu' is not one of auto, cpu, cuda"),
    (None, "gpu", 1, 1, "BURST_DEVICE='gpu' is not one of auto, cpu, cuda"),
])
def test_what_the_machine_cannot_do_is_refused_in_one_line(monkeypatch, requested, environment, visible, ranks,
                                                           refusal):
    gpus(monkeypatch, visible)
    if environment is None:
        monkeypatch.delenv("BURST_DEVICE", raising=False)
    else:
        monkeypatch.setenv("BURST_DEVICE", environment)
    with pytest.raises(ValueError, match=re.escape(refusal)) as refused:
        resolve_device(requested, local_ranks=ranks)
    assert "\n" not in str(refused.value)


def test_a_bad_device_in_flags_or_a_config_file_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="--device 'gpu' is not one of auto, cpu, cuda"):
        TrainConfig(device="gpu")
    settings = tmp_path / "run.toml"
    settings.write_text('device = "tpu"\n')
    with pytest.raises(ValueError, match="--device 'tpu' is not one of auto, cpu, cuda"):
        load_config(settings)
    settings.write_text('device = "cpu"\n')
    assert load_config(settings).device == "cpu"
    assert load_config(settings, {"device": "auto"}).device == "auto"  # the flag over the file


def test_a_cpu_worker_beside_gpus_never_touches_cuda(monkeypatch):
    gpus(monkeypatch, 1)
    assert worker_device("cpu") == torch.device("cpu")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["def", "return", "self", "rank", "shard", "(", ")", ":", "=", "0", "1"]
    for i in range(8):
        (root / f"doc{i}.py").write_text("\n".join(" ".join(rng.choice(words) for _ in range(8)) for _ in range(60)))
    out = tmp_path_factory.mktemp("store")
    prepare([root], out, vocab_size=300, val_fraction=0.1, progress=False)
    return out


def test_cp2_on_a_one_gpu_machine_is_refused_before_any_process_starts_unless_on_the_cpu(monkeypatch, store,
                                                                                       tmp_path):
    gpus(monkeypatch, 1)
    started = []
    monkeypatch.setattr(trainer.launch, "run_local", lambda fn, nproc, args, **_: started.append((nproc, args[0])))
    config = TrainConfig(model="debug", data=str(store), seq_len=128, steps=2, cp=2)
    monkeypatch.delenv("BURST_DEVICE")
    with pytest.raises(ValueError, match="2 ranks on this machine need 2 GPUs .* --device cpu"):
        launch(TrainConfig(**{**config.__dict__, "out": str(tmp_path / "refused")}))
    assert not started and not (tmp_path / "refused" / "config.toml").exists()
    monkeypatch.setenv("BURST_DEVICE", "cpu")
    launch(TrainConfig(**{**config.__dict__, "out": str(tmp_path / "on-cpu")}))
    [(nproc, worker_config)] = started
    assert nproc == 2 and resolve_device(worker_config.device, nproc).kind == "cpu"  # as each worker resolves it


def test_the_device_is_printed_recorded_and_a_resume_elsewhere_says_so(store, tmp_path):
    out = tmp_path / "run"
    common = ["train", "--model", "debug", "--data", str(store), "--seq-len", "64", "--steps", "2", "--out", str(out)]
    first = CliRunner().invoke(app, [*common, "--device", "cpu", "--stop-after", "1"])
    assert first.exit_code == 0, first.output
    assert "cpu (--device cpu)" in first.output  # the settings table, with the reason
    recorded = (out / "config.toml").read_text()
    assert tomllib.loads(recorded)["device"] == "cpu" and "# device cpu: --device cpu" in recorded
    # As if the run had trained on a GPU machine: its config.toml records cuda; this machine resumes on the CPU.
    (out / "config.toml").write_text(recorded.replace('device = "cpu"', 'device = "cuda"'))
    assert load_run_config(out, {}).device is None  # recorded, not requested: resolved again here
    resumed = CliRunner().invoke(app, ["train", "--resume", "--out", str(out)])
    assert resumed.exit_code == 0, resumed.output
    assert ("device: the run ran on cuda and continues on cpu (BURST_DEVICE=cpu); pass --device cuda to keep it "
            "there") in " ".join(resumed.output.split())
    assert tomllib.loads((out / "config.toml").read_text())["device"] == "cpu"


def test_eval_and_bench_take_the_device_and_refuse_what_the_machine_cannot(monkeypatch, tmp_path):
    gpus(monkeypatch, 1)
    monkeypatch.delenv("BURST_DEVICE")
    with pytest.raises(ValueError, match="--cp = 2 ranks on this machine need 2 GPUs .* --device cpu"):
        EvalConfig(checkpoint=tmp_path, seq_len=64, cp=2)
    evaluation = EvalConfig(checkpoint=tmp_path, seq_len=64, cp=2, device="cpu")
    assert (evaluation.device, evaluation.device_reason) == ("cpu", "--device cpu")
    with pytest.raises(ValueError, match="--nproc = 2 ranks on this machine need 2 GPUs .* --device cpu"):
        AttentionBenchConfig(seq_len=64, dtype="fp32")
    monkeypatch.setenv("BURST_DEVICE", "cpu")
    bench = AttentionBenchConfig(seq_len=64, dtype="fp32")
    assert (bench.device, bench.device_reason) == ("cpu", "BURST_DEVICE=cpu")
    refused = CliRunner().invoke(app, ["eval", "--checkpoint", str(tmp_path), "--device", "npu"])
    assert refused.exit_code == 2 and "--device 'npu' is not one of auto, cpu, cuda" in refused.output
