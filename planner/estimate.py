"""One model of a run's memory and time: what `burst plan` prints and the fit check of train and eval refuses by."""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig
from models.footprint import footprint
from planner.hardware import Hardware
from planner.memory import allocated_bytes, host_bytes, memory_parts
from planner.shape import RunShape
from planner.time import model_flops, step_seconds, time_parts

# The share of a node's host memory offloaded activations may take: the rest is the processes', the page cache's
# and the pinned staging of checkpoints.
HOST_SHARE = 0.75


@dataclass(frozen=True)
class Estimate:
    """What one rank of a run needs and how fast the run goes on `hardware`."""

    memory_bytes: dict[str, int]  # by part, the largest rank's
    capacity_bytes: int  # what one rank may use (on CPU: this machine's memory over its local ranks)
    step_time_parts: dict[str, float]
    tokens_per_step: int
    world_size: int
    model_flops: float
    peak_tflops: float
    doc_len: int | tuple[int, ...] | None = None  # the packed documents' length attention was counted for
    vocab_size: int = 0  # the model's vocabulary the estimate counted (the head, the loss's chunk)
    host_bytes: int = 0  # offloaded activations in one node's host memory (all its ranks')
    host_capacity_bytes: int = 0  # a node's host memory (0: not counted)

    @property
    def peak_memory_bytes(self) -> int:
        return sum(self.memory_bytes.values())

    @property
    def allocated_bytes(self) -> int:
        return allocated_bytes(self.memory_bytes)

    @property
    def fits(self) -> bool:
        """The device memory, and the host memory offloaded activations take (where the hardware says it)."""
        return self.peak_memory_bytes <= self.capacity_bytes and self.host_fits

    @property
    def host_fits(self) -> bool:
        return not self.host_capacity_bytes or self.host_bytes <= HOST_SHARE * self.host_capacity_bytes

    @property
    def step_time_s(self) -> float:
        return step_seconds(self.step_time_parts)

    @property
    def tokens_per_s(self) -> float:
        """Per GPU (per rank)."""
        return self.tokens_per_step / self.step_time_s / self.world_size

    @property
    def mfu(self) -> float:
        return mfu(self.tokens_per_s, self.model_flops / self.tokens_per_step, self.peak_tflops)

    def to_json(self) -> dict:
        return {"peak_memory_bytes": self.peak_memory_bytes, "allocated_bytes": self.allocated_bytes,
                "memory_bytes": self.memory_bytes, "capacity_bytes": self.capacity_bytes, "fits": self.fits,
                "step_time_s": self.step_time_s, "step_time_parts": self.step_time_parts,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "doc_len": list(self.doc_len) if isinstance(self.doc_len, tuple) else self.doc_len,
                "vocab_size": self.vocab_size, "host_bytes": self.host_bytes,
                "host_capacity_bytes": self.host_capacity_bytes}


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: the model's FLOPs a GPU does per second over its dense peak."""
    return tokens_per_s_per_gpu * flops_per_token / (peak_tflops * 1e12)


def estimate(shape: RunShape, model_config: ModelConfig, hardware: Hardware, *,
             local_ranks: int | None = None) -> Estimate:
    """Memory and step time of `shape` training (or, forward only, evaluating) `model_config` on `hardware`.
    local_ranks: ranks sharing one CPU machine's memory (default: the shape's ranks over the nodes)."""
    model = footprint(model_config)
    parts, capacity = memory_estimate(shape, model_config, hardware, local_ranks=local_ranks)
    node_ranks = min(shape.world_size, hardware.gpus_per_node)
    return Estimate(parts, capacity, time_parts(shape, model, hardware), shape.tokens_per_step, shape.world_size,
                    model_flops(shape, model), hardware.peak_tflops(shape.precision), shape.doc_len,
                    model_config.vocab_size, node_ranks * host_bytes(shape, model, hardware),
                    hardware.host_memory_bytes)


def memory_estimate(shape: RunShape, model_config: ModelConfig, hardware: Hardware, *,
                    local_ranks: int | None = None) -> tuple[dict[str, int], int]:
    """(bytes by part, bytes one rank may use) of `shape` on `hardware`: the memory half of `estimate`, which the fit
    check of `burst train` and `burst eval` refuses by (no rates needed)."""
    parts = memory_parts(shape, footprint(model_config), hardware)
    capacity = hardware.memory_bytes
    if hardware.shared_memory:  # every rank of a node is a process of this machine
        capacity //= local_ranks or -(-shape.world_size // hardware.nodes)
    return parts, capacity


def fits(shape: RunShape, model_config: ModelConfig, hardware: Hardware, *, local_ranks: int | None = None) -> bool:
    parts, capacity = memory_estimate(shape, model_config, hardware, local_ranks=local_ranks)
    offloaded = min(shape.world_size, hardware.gpus_per_node) * host_bytes(shape, footprint(model_config), hardware)
    host_fits = not hardware.host_memory_bytes or offloaded <= HOST_SHARE * hardware.host_memory_bytes
    return sum(parts.values()) <= capacity and host_fits
