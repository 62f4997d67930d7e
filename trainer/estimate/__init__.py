"""One model of a run's memory and time, shared by `burst plan` and `burst train`'s preflight."""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig
from models.footprint import footprint
from trainer.config import TrainConfig
from trainer.estimate.hardware import Hardware
from trainer.estimate.memory import allocated_bytes, memory_parts
from trainer.estimate.time import model_flops, step_seconds, time_parts


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
    doc_len: int | list[int] | None = None  # the packed documents' length attention was counted for (None: one)
    vocab_size: int = 0  # the model's vocabulary the estimate counted (the head, the loss's chunk)

    @property
    def peak_memory_bytes(self) -> int:
        return sum(self.memory_bytes.values())

    @property
    def allocated_bytes(self) -> int:
        return allocated_bytes(self.memory_bytes)

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes

    @property
    def step_time_s(self) -> float:
        return step_seconds(self.step_time_parts)

    @property
    def tokens_per_s(self) -> float:
        """Per GPU (per rank)."""
        return self.tokens_per_step / self.step_time_s / self.world_size

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_time_s / self.world_size / (self.peak_tflops * 1e12)

    def to_json(self) -> dict:
        return {"peak_memory_bytes": self.peak_memory_bytes, "allocated_bytes": self.allocated_bytes,
                "memory_bytes": self.memory_bytes, "capacity_bytes": self.capacity_bytes, "fits": self.fits,
                "step_time_s": self.step_time_s, "step_time_parts": self.step_time_parts,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "doc_len": self.doc_len,
                "vocab_size": self.vocab_size}


def estimate(config: TrainConfig, model_config: ModelConfig, hardware: Hardware, *, local_ranks: int | None = None,
             doc_len: int | None = None, forward_only: bool = False) -> Estimate:
    """Memory and step time of `config` training `model_config` on `hardware`. local_ranks: ranks sharing one
    CPU machine's memory (default: the config's ranks over the nodes); doc_len: the packed documents'
    length for --doc-mask (None: one document per sequence)."""
    model = footprint(model_config)
    parts, capacity = memory_estimate(config, model_config, hardware, local_ranks=local_ranks,
                                      forward_only=forward_only)
    prefix = config.doc_mask and config.objective != "nll" and config.prefix_sharing
    times = time_parts(config, model, hardware, doc_len, prefix)
    return Estimate(parts, capacity, times, config.batch_size * config.seq_len * config.grad_accum * config.dp,
                    config.world_size, model_flops(config, model, doc_len, prefix), hardware.matmul_tflops,
                    doc_len if config.doc_mask else None, model_config.vocab_size)


def memory_estimate(config: TrainConfig, model_config: ModelConfig, hardware: Hardware, *,
                    local_ranks: int | None = None, forward_only: bool = False) -> tuple[dict[str, int], int]:
    """(bytes by part, bytes one rank may use) of `config` on `hardware`: the memory half of `estimate`, which
    `burst train`'s and `burst eval`'s preflight check (no rates needed)."""
    parts = memory_parts(config, footprint(model_config), hardware, forward_only=forward_only)
    capacity = hardware.memory_bytes
    if hardware.shared_memory:  # every rank of a node is a process of this machine
        capacity //= local_ranks or -(-config.world_size // hardware.nodes)
    return parts, capacity


def fits(config: TrainConfig, model_config: ModelConfig, hardware: Hardware, *, local_ranks: int | None = None,
         forward_only: bool = False) -> bool:
    parts, capacity = memory_estimate(config, model_config, hardware, local_ranks=local_ranks,
                                      forward_only=forward_only)
    return sum(parts.values()) <= capacity
