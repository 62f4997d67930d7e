"""--attention-kernel: checked where it enters (train's config, eval and bench attention's flag), and carried
to the kernel the ring selects."""

import dataclasses
import os

import pytest
import torch
from typer.testing import CliRunner

import burst
from burst.kernels import MathKernel, TorchCPUKernel, select_kernel
from burst.kernels import choice as choice_module
from cli import app
from models import ModelConfig, Transformer
from trainer.config import TrainConfig
from trainer.parallelize import parallelize


def test_an_unknown_kernel_is_refused_by_the_config_in_one_line():
    with pytest.raises(ValueError, match=r"^unknown --attention-kernel 'fa9'; choose one of auto, math, cpu, flash, "
                                         r"efficient, cudnn, fa3, fa4, flash-attn, torch$"):
        TrainConfig(attention_kernel="fa9")


def test_the_configured_kernel_reaches_every_block():
    model = Transformer(dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=64))
    parallelize(model, None, TrainConfig(attention_kernel="math", doc_mask=True))
    kernels = {block.attention.core_attention.kernel for block in model.layers}
    assert kernels == {"math"}


@pytest.mark.parametrize("command", [["eval", "--checkpoint", "nowhere"], ["bench", "attention"]])
def test_eval_and_bench_refuse_an_unknown_kernel_before_any_work(command):
    result = CliRunner().invoke(app, [*command, "--attention-kernel", "magic"])
    assert result.exit_code == 2, result.output
    assert "unknown --attention-kernel 'magic'; choose one of auto, math" in result.output
    assert "Traceback" not in result.output


def test_eval_and_bench_carry_the_kernel_in_their_config_as_train_does(monkeypatch):
    """No environment variable read inside the operator: the name travels in each command's config, to every rank."""
    import evaluation
    from bench.attention import AttentionBenchConfig
    from evaluation.distributed import use_burst_attention

    seen = {}
    monkeypatch.setattr(evaluation, "evaluate", lambda config: seen.setdefault("eval", config))
    monkeypatch.delenv("BURST_ATTENTION_KERNEL", raising=False)
    result = CliRunner().invoke(app, ["eval", "--checkpoint", "nowhere", "--attention-kernel", "math"])
    assert result.exit_code == 0, result.output
    assert seen["eval"].attention_kernel == "math" and "BURST_ATTENTION_KERNEL" not in os.environ
    model = Transformer(dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=64))
    use_burst_attention(model, None, seen["eval"].attention_kernel)  # one process: the model's own attention
    assert {block.attention.core_attention.kernel for block in model.layers} == {"math"}
    assert AttentionBenchConfig(nproc=1, seq_len=64, device="cpu", kernel="math").kernel == "math"
    with pytest.raises(ValueError, match="unknown --attention-kernel 'magic'"):
        AttentionBenchConfig(nproc=1, seq_len=64, device="cpu", kernel="magic")


def test_a_named_kernel_reaches_the_operator(monkeypatch):
    monkeypatch.setattr(choice_module, "_CHOSEN", {})
    cpu = torch.device("cpu")
    assert isinstance(select_kernel(cpu, torch.float32, "math"), MathKernel)
    assert isinstance(select_kernel(cpu, torch.float32, "cpu"), TorchCPUKernel)
    with pytest.raises(ValueError, match="'cudnn' cannot run here: it needs CUDA tensors, got cpu"):
        burst.burst_attn(*(torch.randn(1, 8, 2, 8) for _ in range(3)), kernel="cudnn")
