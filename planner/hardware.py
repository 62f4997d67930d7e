"""The hardware a plan is made for: this machine (measured), or a GPU from a small table of datasheet figures.

Rates are what a run can reach, not marketing peaks: `matmul_tflops` is the dense bf16 (fp32 on CPU) peak
the MFU is measured against, `attention_tflops` what a fused attention kernel achieves in training
(forward + backward), links are one direction's bandwidth per GPU.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from planner import calibration
from planner.calibration import Calibration, Constants

MIB, GIB = 2**20, 2**30


@dataclass(frozen=True)
class Hardware:
    name: str
    device: str  # "cuda" or "cpu"
    memory_bytes: int  # what one rank may use: the GPU's memory, or this machine's available RAM (all ranks share it)
    matmul_tflops: float  # dense peak per GPU (the MFU's denominator), or measured on this CPU (all cores)
    attention_tflops: float  # a fused attention kernel's achieved rate, forward + backward
    nvlink_gbps: float  # GB/s one way, per GPU, inside a node
    network_gbps: float  # GB/s one way, per GPU, between nodes
    memory_gbps: float  # GB/s of device memory (the optimizer's pass)
    gpus_per_node: int = 1
    nodes: int = 1
    source: str = ""
    cores: int = 0  # a CPU's cores, which its ranks share (0: a GPU, each rank has its own)
    fp32_tflops: float = 0.0  # a GPU's dense fp32 peak without tensor cores (0: matmul_tflops, a CPU's measured rate)
    calibration: Calibration | None = None  # the constants this hardware is planned with (None: its device's default)
    host_memory_bytes: int = 0  # a GPU node's host memory, which offloaded activations fill (0: not counted)
    pcie_gbps: float = 0.0  # GB/s one way between a GPU and host memory (offloaded activations' link)

    @property
    def shared_memory(self) -> bool:
        """Whether the ranks of one node share `memory_bytes` (processes on one CPU) instead of having it each."""
        return self.device == "cpu"

    @property
    def record(self) -> Calibration:
        """The calibration record the plan uses: this hardware's own, else the one shipped for its device."""
        return self.calibration or calibration.default(self.device)

    def constants(self, precision: str) -> Constants:
        return self.record.constants(precision)

    def peak_tflops(self, precision: str) -> float:
        """The dense matmul peak in `precision`: MFU's denominator. A GPU's bf16 peak needs tensor cores, which fp32
        matmuls do not use (burst leaves TF32 off); a CPU's rate is measured in the run's precision."""
        if self.device == "cuda" and precision != "bf16" and self.fp32_tflops:
            return self.fp32_tflops
        return self.matmul_tflops

    def attention_tflops_in(self, precision: str) -> float:
        """The attention rate in `precision`: the fused kernels' bf16 rate, scaled as the matmul peak is in fp32."""
        return self.attention_tflops * self.peak_tflops(precision) / self.matmul_tflops if self.matmul_tflops else \
            self.attention_tflops


# Figures and their sources. Memory is what torch.cuda reports as total (a little below the marketing GB).
GPUS: dict[str, Hardware] = {
    "h100": Hardware("H100 SXM 80GB", "cuda", 81_559 * MIB, 989.0, 320.0, 450.0, 50.0, 3350.0, 8, 1,
                     "NVIDIA H100 datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 900 GB/s both ways; "
                     "ConnectX-7 400 Gb/s per GPU; attention as measured on the H200 (same GH100 compute); "
                     "fp32 67 TFLOP/s",
                     fp32_tflops=67.0),
    "h200": Hardware("H200 141GB", "cuda", 143_771 * MIB, 989.0, 320.0, 450.0, 50.0, 4800.0, 8, 1,
                     "NVIDIA H200 datasheet: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e, NVLink 900 GB/s both ways; "
                     "attention 320 TFLOP/s measured on one H200 (issue 36); fp32 67 TFLOP/s", fp32_tflops=67.0),
    "a100": Hardware("A100 SXM 80GB", "cuda", 81_251 * MIB, 312.0, 225.0, 300.0, 25.0, 2039.0, 8, 1,
                     "NVIDIA A100 datasheet: 312 TFLOP/s dense bf16, 2.0 TB/s HBM2e, NVLink 600 GB/s both ways; "
                     "HDR 200 Gb/s per GPU (DGX A100); attention: FlashAttention-2 paper, up to 225 TFLOP/s "
                     "training on A100; fp32 19.5 TFLOP/s", fp32_tflops=19.5),
    "b200": Hardware("B200 192GB", "cuda", 183_359 * MIB, 2250.0, 730.0, 900.0, 50.0, 8000.0, 8, 1,
                     "NVIDIA B200 datasheet: 2.25 PFLOP/s dense bf16 (4.5 with sparsity), 8 TB/s HBM3e, NVLink 5 "
                     "1.8 TB/s both ways; ConnectX-7 400 Gb/s per GPU (DGX B200); attention: the H200's measured "
                     "fraction of peak (320 / 989), not measured; fp32 80 TFLOP/s", fp32_tflops=80.0),
}


# Host memory of a GPU node and each GPU's PCIe link, where --offload-activations puts the blocks' inputs. The
# reference systems' datasheets; the link what a pinned copy reaches (about 85% of the PCIe x16 peak).
TiB = 2**40
HOSTS: dict[str, tuple[int, float, str]] = {
    "h100": (2 * TiB, 55.0, "DGX H100: 2 TB host memory for 8 GPUs; PCIe Gen5 x16, 64 GB/s one way"),
    "h200": (2 * TiB, 55.0, "DGX H200: 2 TB host memory for 8 GPUs; PCIe Gen5 x16, 64 GB/s one way"),
    "a100": (1 * TiB, 25.0, "DGX A100: 1 TB host memory for 8 GPUs; PCIe Gen4 x16, 32 GB/s one way"),
    "b200": (4 * TiB, 55.0, "DGX B200: 4 TB host memory for 8 GPUs (the largest option); PCIe Gen5 x16"),
}
GPUS = {key: replace(known, host_memory_bytes=HOSTS[key][0], pcie_gbps=HOSTS[key][1],
                     source=f"{known.source}; {HOSTS[key][2]}") for key, known in GPUS.items()}


def gpu(name: str, gpus_per_node: int | None = None, nodes: int = 1) -> Hardware:
    """The table's GPU `name` (h100, h200, a100, b200; case and a "-80gb"-like tail ignored)."""
    key = name.lower().replace(" ", "").split("-")[0].split("sxm")[0]
    if key not in GPUS:
        raise ValueError(f"--gpu {name!r} is not in the table; known: {', '.join(GPUS)} (or leave --gpu out to plan "
                         f"for this machine)")
    known = GPUS[key]
    return replace(known, gpus_per_node=gpus_per_node or known.gpus_per_node, nodes=nodes)


def table_gpu(device_name: str) -> Hardware | None:
    """The table's entry for a GPU as torch.cuda names it ("NVIDIA H100 80GB HBM3"), or None for one not in it."""
    return next((GPUS[key] for key in GPUS if key in device_name.lower()), None)


def local_hardware(gpus_per_node: int | None = None, nodes: int = 1, precision: str = "fp32",
                   device: str = "auto") -> Hardware:
    """This machine: its first GPU (matched to the table by name for the rates; not under device "cpu"), else its
    CPU, whose matmul rate in `precision` (fp32 or bf16) is measured once and cached."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        named = table_gpu(properties.name) or GPUS["h100"]
        return replace(named, name=properties.name, memory_bytes=properties.total_memory,
                       gpus_per_node=gpus_per_node or torch.cuda.device_count(), nodes=nodes,
                       source=f"torch.cuda for memory; rates of the table's {named.name}",
                       calibration=calibration.cached(properties.name))
    from runtime.launch import available_cores

    tflops, cores = cpu_matmul_tflops(dtype=torch.bfloat16 if precision == "bf16" else torch.float32), available_cores()
    return Hardware("this CPU", "cpu", available_memory_bytes(), tflops, tflops, 5.0, 1.0, 10.0, gpus_per_node or 1,
                    nodes, f"MemAvailable; {precision} matmul {tflops:.3f} TFLOP/s measured on {cores} cores", cores,
                    calibration=calibration.cached(machine_id("cpu")))


def machine_id(device: str) -> str:
    """This machine as a calibration record names it: its first GPU's name, or its CPU's model, torch's threads and
    its vector capability (what the CPU constants depend on)."""
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{cpu_model()}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"


def planned_machine(hardware: Hardware) -> str:
    """The machine `hardware` describes, as a record names one: a table GPU by its entry's key, this CPU by
    `machine_id`."""
    if hardware.device == "cuda":
        return next((key for key in GPUS if key in hardware.name.lower()), hardware.name)
    return machine_id("cpu")


def foreign_constants(hardware: Hardware) -> bool:
    """Whether `hardware` is planned with constants fitted on another machine."""
    record = hardware.record
    if hardware.device == "cuda":
        return next((key for key in GPUS if key in record.machine.lower()), record.machine) != \
            planned_machine(hardware)
    return record.machine != machine_id("cpu")


def available_memory_bytes() -> int:
    """Memory this machine can still give: MemAvailable (Linux), else its RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_matmul_tflops(cache: Path | None = None, dtype=None) -> float:
    """Matmul TFLOP/s of this CPU in `dtype` (float32 by default, or bfloat16) with torch's threads, measured once
    (the best of ten 0.03 s bursts) and kept in `cache` (~/.cache/burst/cpu_matmul.json, keyed by the CPU model,
    thread count and, for bf16, the dtype)."""
    import torch

    dtype = dtype or torch.float32
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "burst" / "cpu_matmul.json"
    key = f"{cpu_model()}|{torch.get_num_threads()}" + ("" if dtype == torch.float32 else f"|{dtype}")
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(key), float):
        return known[key]
    a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
    a @ b  # warm the kernels
    # the best of ten short bursts, not their mean: a rate measured while other work shares the cores would
    # otherwise be cached as this CPU's (one taken beside other processes read 14x low)
    tflops = 0.0
    for _ in range(10):
        started, runs = time.perf_counter(), 0
        while time.perf_counter() - started < 0.03:
            a @ b
            runs += 1
        tflops = max(tflops, 2 * 512**3 * runs / (time.perf_counter() - started) / 1e12)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({**known, key: tflops}))
    except OSError:
        pass  # a read-only home: measured again next time
    return tflops


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


def memory_only(device: str, memory_bytes: int, gpus_per_node: int = 1, record: Calibration | None = None) -> Hardware:
    """Hardware known by its memory alone, for checks that need no rates (the fit check's); its constants `record`'s
    (None: the device's default)."""
    return Hardware(f"this {'GPU' if device == 'cuda' else 'machine'}", device, memory_bytes, 0.0, 0.0, 0.0, 0.0, 0.0,
                    gpus_per_node, 1, "torch.cuda total memory" if device == "cuda" else "MemAvailable",
                    calibration=record)
