"""Local attention kernels: the per-rank block computation behind one small interface.

contract.py   the interface (shapes, `KernelContract`, `AttentionKernel`)
math.py       the reference kernel
cpu.py        PyTorch's fused CPU kernel
cuda.py       PyTorch's CUDA kernels: FlashAttention-2, memory-efficient, cuDNN
flash_attn.py flash-attn 2, FlashAttention-3 and -4, imported only where used
selfcheck.py  each kernel against the math kernel before first use
choice.py     `select_kernel`: the name given, or the fastest that passes its self-check
See docs/kernels.md.
"""

from burst.kernels.choice import KERNEL_NAMES, candidates, check_kernel_name, detect_machine, select_kernel
from burst.kernels.contract import (
    FLASH_ATTN_CONTRACT,
    FLOAT_DTYPES,
    HALF_DTYPES,
    AttentionKernel,
    Grads,
    KernelContract,
    default_scale,
)
from burst.kernels.cpu import TorchCPUKernel
from burst.kernels.cuda import TorchCUDAEfficientKernel, TorchCUDAFlashKernel, TorchCUDNNKernel
from burst.kernels.flash_attn import (
    FLASH_ATTN_MIN_VERSION,
    FlashAttn3Kernel,
    FlashAttn4Kernel,
    FlashAttnKernel,
    installed_flash_attn_version,
)
from burst.kernels.math import MathKernel
from burst.kernels.selfcheck import self_check

__all__ = [
    "FLASH_ATTN_CONTRACT", "FLASH_ATTN_MIN_VERSION", "FLOAT_DTYPES", "HALF_DTYPES", "KERNEL_NAMES",
    "AttentionKernel", "FlashAttn3Kernel", "FlashAttn4Kernel", "FlashAttnKernel", "Grads", "KernelContract",
    "MathKernel", "TorchCPUKernel", "TorchCUDAEfficientKernel", "TorchCUDAFlashKernel", "TorchCUDNNKernel",
    "candidates", "check_kernel_name", "default_scale", "detect_machine", "installed_flash_attn_version",
    "select_kernel", "self_check",
]
