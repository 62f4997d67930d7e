"""Peak memory of one training (or forward-only) rank, by part.

The peak comes early in backward: every activation backward needs is still held, the optimizer's moments
exist (from the second step on), and the gradients are only those of the blocks already differentiated
(FSDP reduce-scatters each block's as it goes; one process adds them as it goes). Late in backward the
activations are gone and the whole gradient is there; the peak is the larger of the two.
"""

from __future__ import annotations

from models.footprint import Footprint
from trainer.config import TrainConfig
from trainer.estimate import calibration
from trainer.estimate.hardware import Hardware

LOSS_CHUNK = 1024  # rows of logits models/loss.py forms at a time


def compute_width(config: TrainConfig, hardware: Hardware) -> int:
    """Bytes per value the matmuls read and write: bf16 under --precision bf16, else float32."""
    return 2 if config.precision == "bf16" else 4


def activation_width(config: TrainConfig, hardware: Hardware) -> int:
    """Bytes per value the calibration's activation constants count in: the compute dtype's on CUDA; 4 on CPU, where
    autocast saves most tensors in float32 (tiny at 4K tokens held 2,214 MiB in bf16, 2,523 in fp32), and bf16 has
    constants of its own."""
    return 4 if hardware.device == "cpu" else compute_width(config, hardware)


def residual_width(config: TrainConfig, hardware: Hardware) -> int:
    """Bytes per value of the residual stream: bf16 only where FSDP casts the parameters (CUDA, several
    ranks); autocast over float32 parameters keeps the stream float32."""
    return 2 if config.precision == "bf16" and hardware.device == "cuda" and config.world_size > 1 else 4


def activation_bytes(config: TrainConfig, model: Footprint, hardware: Hardware, mode: str) -> tuple[int, int]:
    """(kept, working): the activations one rank's layers keep for backward under recomputation `mode` (none,
    selective, full), and the working set of the block backward is in, held from its first block to its last.

    kept: none, every other block's saved tensors; full, each block's input; selective, each block's input and
    attention's output (and its log-sum-exp; on CPU more stays, SELECTIVE_VALUES_PER_DIM). working: the block's
    saved tensors (recomputed, or its own), the gradients in flight through it (more when the whole block is
    recomputed), and what lies outside the blocks (embedding output, final norm, the loss's hidden rows)."""
    tokens = config.batch_size * config.seq_len // config.cp
    width, residual = activation_width(config, hardware), residual_width(config, hardware)
    key = calibration.key(hardware.device, config.precision)
    block = calibration.BLOCK_BYTES_PER_VALUE[key] * model.block_width * width / 2
    selective = residual * model.dim + calibration.SELECTIVE_VALUES_PER_DIM[key] * width * model.dim
    kept = {"none": (model.layers - 1) * block,
            "selective": model.layers * (selective + 4 * model.heads),
            "full": model.layers * residual * model.dim}[mode]
    in_flight = calibration.BACKWARD_BYTES_PER_VALUE[key] + (
        calibration.FULL_RECOMPUTE_BYTES_PER_VALUE[key] if mode == "full" else 0.0)
    working = block + in_flight * model.block_width * width / 2 + calibration.OUTER_BYTES_PER_DIM[key] * model.dim
    return int(tokens * kept), int(tokens * working)


def attention_buffer_bytes(config: TrainConfig, model: Footprint, hardware: Hardware, forward_only: bool) -> int:
    """One layer's BurstAttention buffers (cp > 1): the key/value blocks in flight (compute and receive buffer),
    the float32 output and log-sum-exp accumulators, and in backward the travelling query side (q, dout in the
    compute dtype, dq in float32, lse and delta), double-buffered too."""
    if config.cp == 1:
        return 0
    rows = config.batch_size * config.seq_len // config.cp
    width = compute_width(config, hardware)
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    forward = 2 * 2 * rows * kv * width + rows * (q + model.heads) * 4
    backward = 2 * rows * (2 * q * width + q * 4 + 2 * model.heads * 4) + 2 * rows * kv * 4
    return forward if forward_only else max(forward, backward)


def loss_bytes(config: TrainConfig, model: Footprint) -> int:
    """The loss's chunk: float32 logits of LOSS_CHUNK rows and their softmax gradient (models/loss.py)."""
    rows = min(LOSS_CHUNK, config.batch_size * config.seq_len // config.cp)
    return 2 * rows * model.vocab * 4


def memory_parts(config: TrainConfig, model: Footprint, hardware: Hardware, mode: str | None = None,
                 forward_only: bool = False) -> dict[str, int]:
    """Bytes one rank holds at its peak, by part (see the module docstring); `mode` defaults to the config's
    recomputation. forward_only (evaluation): weights and one layer's activations, no gradients or optimizer."""
    mode = mode or config.activation_checkpointing
    world = config.world_size
    width = compute_width(config, hardware)
    key = calibration.key(hardware.device, config.precision)
    weights = 4 * model.parameters // world
    gathered = (2 * model.block + model.outer) * width if world > 1 else 0
    if forward_only:  # evaluation: every rank holds the whole model in its dtype, unsharded
        weights, gathered = width * model.parameters, 0
        tokens = config.batch_size * config.seq_len // config.cp
        activations = int(tokens * calibration.BLOCK_BYTES_PER_VALUE[key] * model.block_width
                          * activation_width(config, hardware) / 2)
        parts = {"weights": weights, "gathered weights": gathered, "activations": activations,
                 "attention buffers": attention_buffer_bytes(config, model, hardware, True),
                 "loss chunk": loss_bytes(config, model)}
    else:
        # early in backward every layer's kept activations are held and few gradients; late, the whole gradient
        # and none of them; the block being differentiated, its buffers and the outer activations at both
        kept, working = activation_bytes(config, model, hardware, mode)
        buffers = attention_buffer_bytes(config, model, hardware, False)
        early = 4 * (model.block + model.outer) // (world if world > 1 else 1)  # gradients held early in backward
        late = 4 * model.parameters // world
        early_peak = kept + loss_bytes(config, model) + early >= late
        parts = {"weights": weights, "gradients": early if early_peak else late,
                 "optimizer state": 8 * model.parameters // world, "gathered weights": gathered,
                 "activations": kept if early_peak else 0, "backward working set": working,
                 "attention buffers": buffers, "loss chunk": loss_bytes(config, model) if early_peak else 0}
    tensors = sum(parts.values())
    parts["allocator"] = int(tensors * calibration.ALLOCATOR_OVERHEAD[key])
    parts["process"] = calibration.PROCESS_BYTES[key]
    return parts


TENSOR_PARTS = ("weights", "gradients", "optimizer state", "gathered weights", "activations", "backward working set",
                "attention buffers", "loss chunk")


def allocated_bytes(parts: dict[str, int]) -> int:
    """The tensors' bytes alone: what torch.cuda.max_memory_allocated measures."""
    return sum(size for name, size in parts.items() if name in TENSOR_PARTS)
