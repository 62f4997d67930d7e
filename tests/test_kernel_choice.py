"""Which kernel serves which inputs: the CUDA decision is a plain function, so it is checked here on CPU."""

import pytest
import torch
from torch.torch_version import TorchVersion

from burst.kernels import MathKernel, TorchCPUKernel, cuda_kernel_choice, select_kernel

HOPPER, TURING = (9, 0), (7, 5)
NEW, OLD = TorchVersion("2.8.3"), TorchVersion("2.6.3")


@pytest.mark.parametrize("dtype, head_dim, capability, flash_attn, torch_flash, expected", [
    (torch.bfloat16, 128, HOPPER, NEW, True, "flash-attn"),
    (torch.float16, 64, HOPPER, None, True, "torch-flash"),  # no flash-attn: PyTorch's copy of the kernel
    (torch.bfloat16, 128, HOPPER, None, False, "torch-efficient"),  # a PyTorch build without flash
    (torch.float32, 128, HOPPER, NEW, True, "torch-efficient"),  # FlashAttention takes fp16/bf16 only
    (torch.bfloat16, 100, HOPPER, NEW, True, "torch-efficient"),  # head dim not a multiple of 8
    (torch.bfloat16, 512, HOPPER, NEW, True, "torch-efficient"),  # head dim over 256
    (torch.bfloat16, 128, TURING, NEW, True, "torch-efficient"),  # pre-Ampere
])
def test_auto_prefers_flash_attn_then_torch_flash_then_efficient(dtype, head_dim, capability, flash_attn,
                                                                 torch_flash, expected):
    assert cuda_kernel_choice(dtype, head_dim, capability, flash_attn, torch_flash) == expected


def test_old_flash_attn_is_named_in_a_warning_or_an_error():
    with pytest.warns(UserWarning, match="flash-attn 2.6.3 is older than 2.7"):
        assert cuda_kernel_choice(torch.bfloat16, 128, HOPPER, OLD, True) == "torch-flash"
    with pytest.raises(ValueError, match=r"needs flash-attn >= 2.7 and 2.6.3 is installed"):
        cuda_kernel_choice(torch.bfloat16, 128, HOPPER, OLD, True, name="flash-attn")
    with pytest.raises(ValueError, match="is not installed"):
        cuda_kernel_choice(torch.bfloat16, 128, HOPPER, None, True, name="flash-attn")
    with pytest.raises(ValueError, match="fp16/bf16 inputs"):
        cuda_kernel_choice(torch.float32, 128, HOPPER, NEW, True, name="flash-attn")


def test_torch_by_name_never_takes_flash_attn():
    assert cuda_kernel_choice(torch.bfloat16, 128, HOPPER, NEW, True, name="torch") == "torch-flash"


def test_cpu_selection():
    cpu = torch.device("cpu")
    assert isinstance(select_kernel(cpu, torch.bfloat16), TorchCPUKernel)
    assert isinstance(select_kernel(cpu, torch.float32, "math"), MathKernel)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        select_kernel(cpu, torch.bfloat16, "flash-attn")
    with pytest.raises(ValueError, match="unknown attention kernel"):
        select_kernel(cpu, torch.bfloat16, "cuda-magic")
