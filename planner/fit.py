"""The fit check `burst train`'s preflight and `burst eval` both call: refuse a run whose ranks cannot fit, before
any process starts, naming the settings that would."""

from __future__ import annotations

from models.config import ModelConfig
from planner import calibration
from planner.estimate import memory_estimate
from planner.hardware import available_memory_bytes, machine_id, memory_only
from planner.search import fitting, longest_sequence
from planner.shape import RunShape

GIB = 2**30


def this_machine(device_kind: str, local_ranks: int):
    """The hardware the fit check measures: one rank's GPU on CUDA (its memory from torch.cuda), else this machine's
    available memory shared by its local ranks."""
    if device_kind == "cuda":  # with `burst plan --calibrate`'s constants, once made here
        import torch

        properties = torch.cuda.get_device_properties(0)
        return memory_only("cuda", properties.total_memory, local_ranks, calibration.cached(properties.name))
    return memory_only("cpu", available_memory_bytes(), local_ranks, calibration.cached(machine_id("cpu")))


def check_fits(shape: RunShape, model_config: ModelConfig, local_ranks: int, device_kind: str = "cpu") -> None:
    """Refuse `shape` when its ranks cannot fit, from the estimate `burst plan` prints: one rank's GPU on CUDA; on CPU
    every local rank (a process each, sharing this machine's memory), so too many local ranks are refused before any
    process starts. The refusal names the settings of the same ranks that fit (cp x dp and recomputation, or for
    evaluation --cp) and the longest sequence that fits as set."""
    cuda = device_kind == "cuda"
    hardware = this_machine(device_kind, local_ranks)
    what = "one rank's GPU" if cuda else f"{local_ranks} local rank{'s' if local_ranks > 1 else ''} on this machine"
    parts, capacity = memory_estimate(shape, model_config, hardware, local_ranks=local_ranks)
    needed = sum(parts.values())
    if needed <= capacity:
        return
    ranks = 1 if cuda else local_ranks
    shown = ", ".join(f"{name} {size / GIB:,.2f}" for name, size in parts.items() if size)
    options = sorted(fitting(shape, model_config, hardware, shape.world_size, local_ranks=local_ranks),
                     key=lambda c: (c.cp, c.dp) != (shape.cp, shape.dp))  # the same layout first, then others

    def need(candidate: RunShape) -> str:
        size = sum(memory_estimate(candidate, model_config, hardware, local_ranks=local_ranks)[0].values())
        return f"{candidate.describe()} (about {ranks * size / GIB:,.1f} GiB)"

    use = f"use {' or '.join(need(c) for c in options[:3])}, " if options else ""
    longest = longest_sequence(shape, model_config, hardware, local_ranks=local_ranks)
    lower = f"lower --seq-len (to {longest:,} as set)" if longest else "lower --seq-len"
    if shape.forward_only:  # evaluation: no batch size, no data parallelism; more ranks split the sequence
        advice = f"{use}{lower} (and any longer --passkey-lengths)"
    else:
        advice = (f"{use}{lower}, --batch-size or --dp x --cp on one machine, raise --cp to split sequences further, "
                  f"or spread the ranks over more machines with torchrun (`burst plan --search` ranks what fits by "
                  f"speed)")
    raise ValueError(f"{what} would need about {ranks * needed / GIB:,.1f} GiB (per rank, GiB: {shown}) but "
                     f"{ranks * capacity / GIB:,.1f} GiB are available; {advice}")
