"""Which kernel serves the ring: `--attention-kernel NAME`, or "auto", the fastest that passes its self-check.

Names:
  auto        the fastest kernel installed that takes these inputs and agrees with the math kernel
  math        explicit scores, the reference
  cpu         PyTorch's fused flash-attention ops for CPU
  flash       PyTorch's FlashAttention-2 (CUDA)
  efficient   PyTorch's memory-efficient attention (CUDA; any float dtype and GPU)
  cudnn       cuDNN attention through PyTorch's ops (CUDA)
  fa3, fa4    FlashAttention-3 / -4 where installed (Hopper; FA4 also Blackwell)
  flash-attn  the flash-attn 2 package where installed
  torch       PyTorch's own kernels only, fastest first (cpu on CPU)

"auto" on CUDA tries, in this order, every kernel whose contract takes the inputs:
  capability >= 9.0: fa4, fa3, cudnn, flash-attn, flash, efficient (cuDNN 1.65-1.72x FA2 on H200)
  older GPUs:        flash-attn, flash, cudnn, efficient
Each candidate is built (a package kernel imports its package then: any failure of that import
refuses it) and checked once per (device, dtype, head dim, GQA group) against the math kernel
(selfcheck.py); one that fails is logged in one line and the next is tried. A kernel forced by
name is checked too, and refused in one line with the reason and, when it could not be loaded, how
to install it. `--attention-kernel NAME` (burst train, eval, bench attention) forces one, passed down
as `kernel` like every other setting; bench refuses one that cannot run here before it starts its
ranks (`check_kernel_serves`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from burst.kernels.contract import FLOAT_DTYPES, AttentionKernel
from burst.kernels.cpu import TorchCPUKernel
from burst.kernels.cuda import TorchCUDAEfficientKernel, TorchCUDAFlashKernel, TorchCUDNNKernel
from burst.kernels.flash_attn import (
    FLASH_ATTN_MIN_VERSION,
    INSTALL_HINTS,
    FlashAttn3Kernel,
    FlashAttn4Kernel,
    FlashAttnKernel,
    fa3_installed,
    fa4_installed,
    installed_flash_attn_version,
)
from burst.kernels.math import MathKernel
from burst.kernels.selfcheck import band_self_check, one_line, self_check, varlen_self_check

log = logging.getLogger("burst.kernels")

KERNEL_NAMES = ("auto", "math", "cpu", "flash", "efficient", "cudnn", "fa3", "fa4", "flash-attn", "torch")
KERNEL_CLASSES: dict[str, type] = {
    "math": MathKernel, "cpu": TorchCPUKernel, "flash": TorchCUDAFlashKernel, "efficient": TorchCUDAEfficientKernel,
    "cudnn": TorchCUDNNKernel, "fa3": FlashAttn3Kernel, "fa4": FlashAttn4Kernel, "flash-attn": FlashAttnKernel}
CUDA_ORDER_HOPPER = ("fa4", "fa3", "cudnn", "flash-attn", "flash", "efficient")
CUDA_ORDER_OLDER = ("flash-attn", "flash", "cudnn", "efficient")
PYTORCH_KERNELS = frozenset({"cpu", "flash", "efficient", "cudnn"})


@dataclass(frozen=True)
class Machine:
    """What the choice depends on: the device type, its CUDA capability (None off CUDA) and the
    kernels that are installed there (by name)."""

    device_type: str
    capability: tuple[int, int] | None
    installed: frozenset[str]


def installed_packages() -> frozenset[str]:
    """The kernel packages installed here ("flash-attn", "fa3", "fa4"), found without importing any (each
    is imported when its kernel is built, and a failing import refuses that kernel in one line)."""
    version = installed_flash_attn_version()
    return frozenset({"flash-attn"} if version is not None and version >= FLASH_ATTN_MIN_VERSION else set()) | \
        frozenset({"fa3"} if fa3_installed() else set()) | frozenset({"fa4"} if fa4_installed() else set())


def detect_machine(device: torch.device) -> Machine:
    """The Machine of `device`, without importing any optional package."""
    if device.type != "cuda":
        return Machine(device.type, None, frozenset({"cpu"} if device.type == "cpu" else ()))
    installed = {"efficient"}
    if torch.version.hip is None and torch.backends.cuda.is_flash_attention_available():
        installed.add("flash")
    if torch.backends.cudnn.is_available() and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        installed.add("cudnn")
    return Machine("cuda", torch.cuda.get_device_capability(device), frozenset(installed) | installed_packages())


def check_kernel_name(name: str, setting: str = "attention kernel") -> None:
    """Refuse an unknown kernel name in one line naming the known ones; `setting` is what the caller calls it."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown {setting} {name!r}; choose one of {', '.join(KERNEL_NAMES)}")


def check_kernel_serves(device: torch.device, dtype: torch.dtype, head_dim: int, name: str = "auto") -> None:
    """Refuse in one line (ValueError) a kernel forced by `name` that cannot serve these inputs on `device`: for a
    command to call before it starts its ranks, each of which would otherwise fail with its own traceback."""
    candidates(detect_machine(device), dtype, head_dim, name)


def why_not(name: str, machine: Machine, dtype: torch.dtype, head_dim: int) -> list[str]:
    """Why kernel `name` cannot serve these inputs on `machine` (before running it); [] if it can."""
    if name == "math":
        return []
    if name not in machine.installed:
        where = "CUDA tensors" if name != "cpu" else "CPU tensors"
        if machine.device_type == ("cuda" if name != "cpu" else "cpu"):
            return [f"it is not installed here ({_install_hint(name)})"]
        return [f"it needs {where}, got {machine.device_type}"]
    contract = KERNEL_CLASSES[name].contract
    found = contract.unsupported(dtype, head_dim)
    if contract.min_capability and machine.capability and machine.capability < contract.min_capability:
        found.append(f"it needs a GPU of capability {contract.min_capability} or newer, this one is "
                     f"{machine.capability}")
    return found


def _install_hint(name: str) -> str:
    return {**INSTALL_HINTS, "flash": "a PyTorch built with FlashAttention",
            "cudnn": "a PyTorch with cuDNN attention"}.get(name, name)


def candidates(machine: Machine, dtype: torch.dtype, head_dim: int, name: str = "auto") -> list[str]:
    """The kernels to try for `name`, fastest first, each of which takes these inputs by its contract.

    Raises ValueError, in one line naming the kernels that would serve, when a kernel forced by
    name cannot serve here.
    """
    check_kernel_name(name)
    if machine.device_type == "cuda":
        order = CUDA_ORDER_HOPPER if machine.capability and machine.capability >= (9, 0) else CUDA_ORDER_OLDER
    else:
        order = ("cpu",) if dtype in FLOAT_DTYPES else ()
    serving = [n for n in order if not why_not(n, machine, dtype, head_dim)]
    if name == "auto":
        return serving
    if name == "torch":
        return [n for n in serving if n in PYTORCH_KERNELS]
    if problems := why_not(name, machine, dtype, head_dim):
        available = ", ".join(["auto", "math", *serving])
        raise ValueError(f"attention kernel {name!r} cannot run here: {'; '.join(problems)}; "
                         f"available for {dtype} head_dim {head_dim} on {machine.device_type}: {available}")
    return [name]


def choose_kernel(machine: Machine, device: torch.device, dtype: torch.dtype, head_dim: int, groups: int,
                  name: str = "auto") -> AttentionKernel:
    """The first of `candidates` that passes its self-check (the math kernel when none does).

    A refused candidate is logged in one line saying why; one forced by name raises ValueError instead.
    """
    for candidate in candidates(machine, dtype, head_dim, name):
        try:
            kernel = KERNEL_CLASSES[candidate]()
        except Exception as error:  # noqa: BLE001 - any failure to import or bind a package refuses it
            problem = f"it could not be loaded ({one_line(error)})"
            if name not in ("auto", "torch"):
                raise ValueError(f"attention kernel {name!r} could not be loaded ({one_line(error)}); "
                                 f"{_install_hint(candidate)}, or use --attention-kernel auto") from None
        else:
            problem = None if candidate == "math" else self_check(kernel, device, dtype, head_dim, groups)
        if problem is None:
            enable_varlen(kernel, device, dtype, head_dim, groups, candidate)
            enable_band(kernel, device, dtype, head_dim, groups, candidate)
            return kernel
        if name not in ("auto", "torch"):
            raise ValueError(f"attention kernel {name!r} disagrees with the math kernel for {dtype} head_dim "
                             f"{head_dim} GQA group {groups}: {problem}; use --attention-kernel auto")
        log.warning("burst: attention kernel %r not used for %s head_dim %d GQA group %d: %s", candidate,
                    str(dtype).removeprefix("torch."), head_dim, groups, problem)
    return MathKernel()


def enable_varlen(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int, groups: int,
                  name: str) -> None:
    """Let the ring pack a step's documents into one call (burst/varlen.py) when the kernel has a varlen
    path that agrees with the math kernel; otherwise say why in one line and keep one call per block."""
    if not hasattr(kernel, "forward_varlen"):
        return
    problem = varlen_self_check(kernel, device, dtype, head_dim, groups)
    kernel.use_varlen = problem is None
    if problem:
        log.warning("burst: attention kernel %r takes documents one call each for %s head_dim %d GQA group %d: "
                    "its varlen path failed its self-check: %s", name, str(dtype).removeprefix("torch."), head_dim,
                    groups, problem)


def enable_band(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int, groups: int,
                name: str) -> None:
    """Let the kernel mask a sliding window's band blocks itself (burst/varlen.py) when its band path agrees
    with the math kernel; otherwise say why in one line, and the math kernel computes them."""
    if not hasattr(kernel, "forward_band") or isinstance(kernel, MathKernel):
        return
    problem = band_self_check(kernel, device, dtype, head_dim, groups)
    kernel.use_band = problem is None
    if problem:
        log.warning("burst: attention kernel %r leaves sliding-window band blocks to the math kernel for %s head_dim "
                    "%d GQA group %d: its band path failed its self-check: %s", name,
                    str(dtype).removeprefix("torch."), head_dim, groups, problem)


_CHOSEN: dict[tuple, AttentionKernel] = {}


def select_kernel(device: torch.device, dtype: torch.dtype, name: str = "auto", head_dim: int = 64,
                  groups: int = 1) -> AttentionKernel:
    """The kernel for tensors on `device` with `dtype`, `head_dim` and `groups` query heads per kv head.

    Chosen once per (device, dtype, head dim, groups, name) and cached, self-check included; see the
    module docstring. Raises ValueError for an unknown name or a kernel that cannot serve.
    """
    check_kernel_name(name)
    if name == "math":
        return MathKernel()
    key = (str(device), dtype, head_dim, groups, name)
    if key not in _CHOSEN:
        _CHOSEN[key] = choose_kernel(detect_machine(device), device, dtype, head_dim, groups, name)
    return _CHOSEN[key]
