"""Which kernel serves which inputs, and the self-check that stands between a kernel and the ring.

The CUDA decision is a plain function of a `Machine` (device type, capability, installed kernels),
so the choice table is checked here on CPU; the self-check runs fake kernels on CPU tensors.
"""

import logging

import pytest
import torch
from typer.testing import CliRunner

from burst.kernels import MathKernel, TorchCPUKernel, candidates, select_kernel, self_check
from burst.kernels import choice as choice_module
from burst.kernels.choice import Machine, choose_kernel
from burst.kernels.selfcheck import band_self_check
from cli import app

EVERYTHING = frozenset({"fa4", "fa3", "cudnn", "flash-attn", "flash", "efficient"})
PYTORCH_ONLY = frozenset({"cudnn", "flash", "efficient"})
H200, A100, TURING = (9, 0), (8, 0), (7, 5)


@pytest.mark.parametrize("capability, installed, dtype, head_dim, expected", [
    (H200, EVERYTHING, torch.bfloat16, 128, ["fa4", "fa3", "cudnn", "flash-attn", "flash", "efficient"]),
    (H200, PYTORCH_ONLY, torch.bfloat16, 128, ["cudnn", "flash", "efficient"]),  # the H200 burst ran on
    (H200, PYTORCH_ONLY, torch.bfloat16, 256, ["flash", "efficient"]),  # cuDNN: head dim <= 128 assumed
    (H200, EVERYTHING, torch.float32, 128, ["efficient"]),  # the fused fast kernels take fp16/bf16 only
    (H200, EVERYTHING, torch.bfloat16, 100, ["efficient"]),  # head dim not a multiple of 8
    (A100, EVERYTHING, torch.float16, 64, ["flash-attn", "flash", "cudnn", "efficient"]),  # no FA3/FA4 on sm80
    (TURING, EVERYTHING, torch.bfloat16, 64, ["efficient"]),  # pre-Ampere
    (H200, frozenset({"efficient"}), torch.bfloat16, 64, ["efficient"]),  # a PyTorch without flash or cuDNN
])
def test_auto_tries_the_fastest_kernel_that_takes_the_inputs_first(capability, installed, dtype, head_dim,
                                                                   expected):
    assert candidates(Machine("cuda", capability, installed), dtype, head_dim) == expected


def test_torch_means_pytorch_kernels_only():
    assert candidates(Machine("cuda", H200, EVERYTHING), torch.bfloat16, 128, "torch") == \
        ["cudnn", "flash", "efficient"]
    assert candidates(Machine("cpu", None, frozenset({"cpu"})), torch.bfloat16, 128, "torch") == ["cpu"]


def test_a_forced_kernel_that_cannot_run_is_refused_in_one_line_naming_the_available_ones():
    hopper = Machine("cuda", H200, PYTORCH_ONLY)
    with pytest.raises(ValueError, match=r"'fa3' cannot run here: it is not installed here .*available for "
                                         r"torch.bfloat16 head_dim 128 on cuda: auto, math, cudnn, flash, efficient$"):
        candidates(hopper, torch.bfloat16, 128, "fa3")
    with pytest.raises(ValueError, match=r"'cudnn' cannot run here: dtype torch.float32"):
        candidates(hopper, torch.float32, 128, "cudnn")
    with pytest.raises(ValueError, match=r"'fa4' cannot run here: .*capability \(9, 0\) or newer, this one is "
                                         r"\(8, 0\)"):
        candidates(Machine("cuda", A100, EVERYTHING), torch.bfloat16, 128, "fa4")
    with pytest.raises(ValueError, match="'cudnn' cannot run here: it needs CUDA tensors, got cpu; available for "
                                         r"torch.bfloat16 head_dim 64 on cpu: auto, math, cpu"):
        candidates(Machine("cpu", None, frozenset({"cpu"})), torch.bfloat16, 64, "cudnn")
    assert candidates(hopper, torch.bfloat16, 128, "flash") == ["flash"]


def test_bench_refuses_a_kernel_that_cannot_run_here_in_one_line():
    """`burst bench attention --attention-kernel flash` on a CPU printed a 159-line traceback from its ranks."""
    result = CliRunner().invoke(app, ["bench", "attention", "--attention-kernel", "flash", "--device", "cpu",
                                      "--dtype", "bf16", "--seq-len", "64"])
    assert result.exit_code == 2, result.output
    assert result.output == ("error: attention kernel 'flash' cannot run here: it needs CUDA tensors, got cpu; "
                             "available for torch.bfloat16 head_dim 64 on cpu: auto, math, cpu\n")


def test_cpu_selection():
    cpu = torch.device("cpu")
    assert isinstance(select_kernel(cpu, torch.bfloat16), TorchCPUKernel)
    assert isinstance(select_kernel(cpu, torch.float32, "cpu", head_dim=16, groups=2), TorchCPUKernel)
    assert isinstance(select_kernel(cpu, torch.float32, "math"), MathKernel)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        select_kernel(cpu, torch.bfloat16, "flash-attn")
    with pytest.raises(ValueError, match="unknown attention kernel 'cuda-magic'; choose one of auto, math, cpu"):
        select_kernel(cpu, torch.bfloat16, "cuda-magic")


class WrongScaleKernel(TorchCPUKernel):
    """A kernel with a plausible bug: it ignores the softmax scale (uses 1/sqrt(d) always)."""

    def forward(self, q, k, v, causal, scale):
        return super().forward(q, k, v, causal, q.shape[-1] ** -0.5 * 1.5)


class WrongGradientKernel(TorchCPUKernel):
    """Right forward, but a backward whose dk is 10% off (as a kernel reading the wrong lse would be)."""

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = super().backward(dout, q, k, v, out, lse, causal, scale)
        return dq, dk * 1.1, dv


class BottomRightKernel(MathKernel):
    """Causal aligned bottom-right, as FlashAttention's own kernels are: right on squares only."""

    @staticmethod
    def _probabilities_and_lse(q, k, causal, scale):
        scores, _ = MathKernel._probabilities_and_lse(q, k, False, scale)
        if causal:
            q_len, kv_len = scores.shape[-2:]
            mask = torch.ones(q_len, kv_len, dtype=torch.bool).triu(1 + kv_len - q_len)
            scores = scores.masked_fill(mask, float("-inf"))
        return scores, torch.logsumexp(scores, dim=-1)


class ScaleIgnoringKernel(TorchCPUKernel):
    """Always the default scale 1/sqrt(head_dim), whatever it is given."""

    def forward(self, q, k, v, causal, scale):
        return super().forward(q, k, v, causal, q.shape[-1] ** -0.5)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        return super().backward(dout, q, k, v, out, lse, causal, q.shape[-1] ** -0.5)


class LseRecomputingKernel(TorchCPUKernel):
    """A backward that recomputes the block's own log-sum-exp instead of taking the merged one it is given."""

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        _, own_lse = self.forward(q, k, v, causal, scale)
        return super().backward(dout, q, k, v, out, own_lse, causal, scale)


class RaisingKernel(TorchCPUKernel):
    def forward(self, q, k, v, causal, scale):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nsecond line")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 4])
def test_self_check_accepts_a_correct_kernel(dtype, groups):
    assert self_check(TorchCPUKernel(), torch.device("cpu"), dtype, 32, groups) is None


@pytest.mark.parametrize("kernel, reason", [
    (WrongScaleKernel(), r"^forward out differs from the math kernel by [\d.e-]+ \(allowed [\d.e-]+\) on a causal "
                         r"square block$"),
    (WrongGradientKernel(), r"^backward dk differs from the math kernel by .* on a causal square block$"),
    (RaisingKernel(), r"^it raised RuntimeError: FlashAttention only supports Ampere GPUs or newer.$"),
    (BottomRightKernel(), r"^forward out differs from the math kernel by .* on a causal block of fewer queries than "
                          r"keys$"),
    (ScaleIgnoringKernel(), r"^forward out differs from the math kernel by .* on a causal square block$"),
    (LseRecomputingKernel(), r"^backward dq differs from the math kernel by .* on a causal square block$"),
], ids=["wrong-scale", "wrong-gradient", "raising", "bottom-right", "scale-ignoring", "lse-recomputing"])
def test_self_check_refuses_a_wrong_kernel_in_one_line(kernel, reason):
    problem = self_check(kernel, torch.device("cpu"), torch.bfloat16, 32, 2)
    assert problem is not None and "\n" not in problem
    assert __import__("re").match(reason, problem), problem


class BandScaleIgnoringKernel(TorchCPUKernel):
    """A band path (sliding-window edges) that always uses the default scale."""

    def forward_band(self, q, k, v, band, scale):
        return super().forward_band(q, k, v, band, q.shape[-1] ** -0.5)

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        return super().backward_band(dout, q, k, v, out, lse, band, q.shape[-1] ** -0.5)


class BandLseRecomputingKernel(TorchCPUKernel):
    """A band path whose backward recomputes the block's own log-sum-exp instead of taking the merged one."""

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        _, own_lse = self.forward_band(q, k, v, band, scale)
        return super().backward_band(dout, q, k, v, out, own_lse, band, scale)


def test_the_band_self_check_accepts_the_cpu_band_path():
    assert band_self_check(TorchCPUKernel(), torch.device("cpu"), torch.bfloat16, 32, 2) is None


@pytest.mark.parametrize("kernel, reason", [
    (BandScaleIgnoringKernel(), r"^band forward out differs from the math kernel by .* on band \(-79, 0\)$"),
    (BandLseRecomputingKernel(), r"^band backward dq differs from the math kernel by .* on band \(-79, 0\)$"),
], ids=["scale-ignoring", "lse-recomputing"])
def test_the_band_self_check_refuses_a_wrong_band_path_in_one_line(kernel, reason):
    problem = band_self_check(kernel, torch.device("cpu"), torch.bfloat16, 32, 2)
    assert problem is not None and __import__("re").match(reason, problem), problem


def test_self_check_leaves_the_random_state_alone():
    before = torch.get_rng_state()
    self_check(TorchCPUKernel(), torch.device("cpu"), torch.float32, 16)
    assert torch.equal(before, torch.get_rng_state())


@pytest.fixture
def fake_cuda_kernels(monkeypatch):
    """The CUDA kernel names served by CPU kernels: cudnn wrong, flash right, efficient right."""
    monkeypatch.setitem(choice_module.KERNEL_CLASSES, "cudnn", WrongGradientKernel)
    monkeypatch.setitem(choice_module.KERNEL_CLASSES, "flash", TorchCPUKernel)
    monkeypatch.setitem(choice_module.KERNEL_CLASSES, "efficient", MathKernel)
    return Machine("cuda", H200, PYTORCH_ONLY)


def test_auto_skips_a_kernel_that_fails_its_self_check_and_says_why_once(fake_cuda_kernels, caplog):
    with caplog.at_level(logging.WARNING, logger="burst.kernels"):
        kernel = choose_kernel(fake_cuda_kernels, torch.device("cpu"), torch.bfloat16, 64, 4)
    assert type(kernel) is TorchCPUKernel  # "flash", the next in the order
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert lines[0].startswith("burst: attention kernel 'cudnn' not used for bfloat16 head_dim 64 GQA group 4: "
                               "backward dk differs from the math kernel")


def test_a_forced_kernel_that_fails_its_self_check_is_refused(fake_cuda_kernels):
    with pytest.raises(ValueError, match=r"'cudnn' disagrees with the math kernel for torch.bfloat16 head_dim 64 "
                                         r"GQA group 1: backward dk differs .*; use --attention-kernel auto"):
        choose_kernel(fake_cuda_kernels, torch.device("cpu"), torch.bfloat16, 64, 1, "cudnn")


def test_the_choice_is_made_once_per_inputs(monkeypatch):
    made = []
    monkeypatch.setattr(choice_module, "choose_kernel", lambda *args: made.append(args) or TorchCPUKernel())
    monkeypatch.setattr(choice_module, "_CHOSEN", {})
    cpu = torch.device("cpu")
    for _ in range(3):
        select_kernel(cpu, torch.bfloat16, head_dim=64, groups=4)
    select_kernel(cpu, torch.bfloat16, head_dim=64, groups=1)
    assert len(made) == 2
