"""--attention-kernel: checked where it enters (train's config, eval and bench attention's flag), and carried
to the kernel the ring selects."""

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

import burst
from burst.kernels import KERNEL_ENV, MathKernel, TorchCPUKernel, select_kernel
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


def test_the_environment_names_the_kernel_auto_means(monkeypatch):
    monkeypatch.setattr(choice_module, "_CHOSEN", {})
    cpu = torch.device("cpu")
    monkeypatch.setenv(KERNEL_ENV, "math")
    assert isinstance(select_kernel(cpu, torch.float32), MathKernel)
    assert isinstance(select_kernel(cpu, torch.float32, "cpu"), TorchCPUKernel)  # a name given wins
    monkeypatch.setenv(KERNEL_ENV, "cudnn")
    with pytest.raises(ValueError, match="'cudnn' cannot run here: it needs CUDA tensors, got cpu"):
        burst.burst_attn(*(torch.randn(1, 8, 2, 8) for _ in range(3)))
    monkeypatch.setenv(KERNEL_ENV, "nonsense")
    with pytest.raises(ValueError, match=r"unknown \$BURST_ATTENTION_KERNEL 'nonsense'"):
        select_kernel(cpu, torch.float32)
