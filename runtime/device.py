"""`--device auto|cpu|cuda`: where a command's ranks run, decided in one place for train, eval and bench.

    device = resolve_device(config.device, local_ranks=config.world_size, ranks_flag="--cp x --dp")
    device.kind, device.backend      # "cuda", "nccl"  or  "cpu", "gloo"

The request is the flag (or a config file's `device`), else the BURST_DEVICE environment variable, else
auto: cuda where torch sees a GPU, the CPU elsewhere. --device cpu on a machine with GPUs runs gloo ranks
on the CPU and never touches CUDA (no NCCL, no CUDA tensors): a configuration can be tried at --cp 2 on a
one-GPU workstation, an evaluation can run beside a training that holds the GPU, and a test suite that
means the CPU stays there (tests/conftest.py sets BURST_DEVICE=cpu).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")
ENVIRONMENT = "BURST_DEVICE"


@dataclass(frozen=True)
class Device:
    """The device kind this invocation's ranks run on and why it was chosen."""

    kind: str  # "cpu" or "cuda"
    reason: str  # "--device cpu", "BURST_DEVICE=cpu", "auto: CUDA is available (8 GPUs)", ...

    @property
    def backend(self) -> str:
        """The process group's backend: NCCL between GPUs, gloo between CPU processes."""
        return "nccl" if self.kind == "cuda" else "gloo"


def check_device(value: str, where: str = "--device ") -> str:
    """`value` if it names a device setting; else a ValueError saying which ones do."""
    if value not in DEVICES:
        raise ValueError(f"{where}{value!r} is not one of {', '.join(DEVICES)} (auto: cuda where a GPU is visible, "
                         f"else cpu)")
    return value


def requested_device(requested: str | None) -> tuple[str, str]:
    """(the device asked for, who asked): the flag or config file's `requested`, else BURST_DEVICE, else auto."""
    if requested is not None:
        return check_device(requested), f"--device {requested}"
    environment = os.environ.get(ENVIRONMENT, "").strip()
    if environment:
        return check_device(environment, f"{ENVIRONMENT}="), f"{ENVIRONMENT}={environment}"
    return "auto", "auto"


def resolve_device(requested: str | None, local_ranks: int = 1, ranks_flag: str = "--cp x --dp") -> Device:
    """The device for `local_ranks` ranks on this machine (one GPU each on cuda), as `requested` (None: see
    `requested_device`). Raises ValueError, before any process starts, for cuda without a GPU, and for more
    local ranks than GPUs (`ranks_flag` names the flags that set their number), naming the alternatives."""
    import torch  # here: `burst --help` reads the config, which checks --device, without importing torch

    wanted, asked_by = requested_device(requested)
    if wanted == "cpu":
        return Device("cpu", asked_by)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if wanted == "cuda" and not gpus:
        build = "a CPU-only build of torch" if torch.version.cuda is None else f"torch for CUDA {torch.version.cuda}"
        raise ValueError(f"{asked_by}: this machine has no CUDA device that torch can use ({build}); pass "
                         f"--device cpu (or auto)")
    if not gpus:
        return Device("cpu", "auto: no CUDA device")
    if local_ranks > gpus:
        raise ValueError(f"{ranks_flag} = {local_ranks} ranks on this machine need {local_ranks} GPUs (one each), and "
                         f"it has {gpus}; run them on the CPU with --device cpu (gloo ranks; BURST_DEVICE=cpu does "
                         f"the same), use at most {gpus} rank{'s' if gpus > 1 else ''} here, or start them on several "
                         f"machines with torchrun")
    return Device("cuda", asked_by if wanted == "cuda" else f"auto: CUDA is available ({gpus} "
                                                            f"GPU{'s' if gpus > 1 else ''})")
