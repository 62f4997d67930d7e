"""Peak memory of one training (or forward-only) rank, by part.

The peak comes early in backward: every activation backward needs is still held, the optimizer's moments
exist (from the second step on), and the gradients are only those of the blocks already differentiated
(FSDP reduce-scatters each block's as it goes; one process adds them as it goes). Late in backward the
activations are gone and the whole gradient is there; the peak is the larger of the two.

Each part is one function of the shape, the model's footprint and the hardware; `memory_parts` names them.
LoRA keeps the frozen weights in the compute dtype (bf16; on a CPU the blocks' matrices) without gradients or
optimizer state; offloaded activations leave two blocks' inputs on the GPU (one going out, one coming back) and the
rest in host memory (`host_bytes`; on a CPU the host is the device, and the copies add to it: trainer/memory.py's
HostCopy clones each input there); the tiled MLP holds its intermediate for --mlp-tile tokens at a time, the loss its
logits for --loss-tile rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from burst.decode import cache_capacity, cache_dtype
from models.footprint import Footprint
from planner.hardware import Hardware
from planner.shape import RunShape

# Each --lora-targets name's (in, out) features, from a model's footprint.
LORA_FEATURES = {"q": lambda m: (m.dim, m.heads * m.head_dim), "k": lambda m: (m.dim, m.kv_heads * m.head_dim),
                 "v": lambda m: (m.dim, m.kv_heads * m.head_dim), "o": lambda m: (m.heads * m.head_dim, m.dim),
                 "gate": lambda m: (m.dim, m.ffn), "up": lambda m: (m.dim, m.ffn), "down": lambda m: (m.ffn, m.dim)}


class Trainable(NamedTuple):
    """Parameter counts of a run's training: all that train, one block's and outside the blocks', and the frozen."""

    parameters: int
    block: int
    outer: int
    frozen: int


def trainable_parameters(shape: RunShape, model: Footprint) -> Trainable:
    """What trains: every parameter, or under LoRA the adapters (and with train_embeddings_and_norms the embeddings
    and norms, which are then not frozen)."""
    if not shape.lora_rank:
        return Trainable(model.parameters, model.block, model.outer, 0)
    adapters = sum(shape.lora_rank * sum(LORA_FEATURES[target](model)) for target in shape.lora_targets)
    norms, embeddings = (2 * model.dim, model.vocab * model.dim + model.dim) if shape.train_embeddings_and_norms \
        else (0, 0)
    block, outer = adapters + norms, embeddings
    base_trained = model.layers * norms + embeddings
    return Trainable(model.layers * block + outer, block, outer, model.parameters - base_trained)


def frozen_bytes(shape: RunShape, model: Footprint, hardware: Hardware, frozen: int) -> int:
    """Bytes of LoRA's `frozen` weights. A bf16 run keeps them in bf16 (trainer/parallelize.py's
    keep_frozen_in_bf16): all of them on CUDA; on a CPU the blocks' linear layers, which autocast computes in bf16
    (the embeddings and norms compute in float32 there and stay float32). float32 otherwise."""
    if shape.precision != "bf16" or not frozen:
        return 4 * frozen
    if hardware.device == "cuda":
        return 2 * frozen
    block_matrices = model.matmul - model.vocab * model.dim  # frozen whole under LoRA (its adapters are apart)
    return 2 * block_matrices + 4 * (frozen - block_matrices)


def tiled_block_width(shape: RunShape, model: Footprint) -> float:
    """`block_width` with the MLP's two [tokens, ffn] values held for --mlp-tile tokens of the rank's at a time."""
    if not shape.mlp_tile or shape.mlp_tile >= shape.tokens_per_rank:
        return model.block_width
    return model.block_width - 2 * model.ffn * (1 - shape.mlp_tile / shape.tokens_per_rank)


def offloads(shape: RunShape, hardware: Hardware) -> bool:
    """Whether the blocks' kept inputs leave the device: offloaded, recomputed, on a GPU."""
    return shape.offload_activations and shape.activation_checkpointing != "none" and hardware.device == "cuda"


def host_bytes(shape: RunShape, model: Footprint, hardware: Hardware) -> int:
    """Host memory one rank's offloaded activations take: the inputs every block keeps for its recomputation."""
    if not offloads(shape, hardware):
        return 0
    return model.layers * shape.tokens_per_rank * residual_width(shape, hardware) * model.dim


def compute_width(shape: RunShape) -> int:
    """Bytes per value the matmuls read and write: bf16 under --precision bf16, else float32."""
    return 2 if shape.precision == "bf16" else 4


def activation_width(shape: RunShape, hardware: Hardware) -> int:
    """Bytes per value the calibration's activation constants count in: the compute dtype's on CUDA; 4 on CPU, where
    autocast saves most tensors in float32 (tiny at 4K tokens held 2,214 MiB in bf16, 2,523 in fp32), and bf16 has
    constants of its own."""
    return 4 if hardware.device == "cpu" else compute_width(shape)


def residual_width(shape: RunShape, hardware: Hardware) -> int:
    """Bytes per value of the residual stream: bf16 only where FSDP casts the parameters (CUDA, several
    ranks); autocast over float32 parameters keeps the stream float32."""
    return 2 if shape.precision == "bf16" and hardware.device == "cuda" and shape.world_size > 1 else 4


def activation_bytes(shape: RunShape, model: Footprint, hardware: Hardware, mode: str) -> tuple[int, int]:
    """(kept, working): the activations one rank's layers keep for backward under recomputation `mode` (none,
    selective, full), and the working set of the block backward is in, held from its first block to its last.

    kept: none, every other block's saved tensors; full, each block's input; selective, each block's input and
    attention's output (and its log-sum-exp; on CPU more stays, selective_values_per_dim). working: the block's
    saved tensors (recomputed, or its own), the gradients in flight through it (more when the whole block is
    recomputed), and what lies outside the blocks (embedding output, final norm, the loss's hidden rows)."""
    width, residual = activation_width(shape, hardware), residual_width(shape, hardware)
    constants = hardware.constants(shape.precision)
    block_width = tiled_block_width(shape, model)
    block = constants.block_bytes_per_value * block_width * width / 2
    selective = residual * model.dim + constants.selective_values_per_dim * width * model.dim
    kept = {"none": (model.layers - 1) * block,
            "selective": model.layers * (selective + 4 * model.heads),
            "full": model.layers * residual * model.dim}[mode]
    if mode != "none" and offloads(shape, hardware):  # two inputs on the device: one going out, one coming back
        kept -= (model.layers - min(2, model.layers)) * residual * model.dim
    elif mode != "none" and shape.offload_activations and hardware.device == "cpu":
        kept += model.layers * residual * model.dim  # the CPU's "host copy" is a clone beside the input it copies
    # The tiled MLP drops its intermediates from what a block keeps and from the gradients in flight through it, not
    # from what recomputing the whole block adds (tiny at 4K, full recomputation, --mlp-tile 1024: -90 MiB measured,
    # -95 estimated from these two terms; with the third too the estimate claimed -205; malloc's 10% included)
    in_flight = constants.backward_bytes_per_value * block_width + (
        constants.full_recompute_bytes_per_value * model.block_width if mode == "full" else 0.0)
    working = block + in_flight * width / 2 + constants.outer_bytes_per_dim * model.dim
    return int(shape.tokens_per_rank * kept), int(shape.tokens_per_rank * working)


def forward_activation_bytes(shape: RunShape, model: Footprint, hardware: Hardware) -> int:
    """Evaluation's activations: one block's, freed as the next runs."""
    constants = hardware.constants(shape.precision)
    return int(shape.tokens_per_rank * constants.block_bytes_per_value * model.block_width
               * activation_width(shape, hardware) / 2)


def attention_buffer_bytes(shape: RunShape, model: Footprint) -> int:
    """One layer's BurstAttention buffers (cp > 1): the key/value blocks in flight (compute and receive buffer),
    the float32 output and log-sum-exp accumulators, and in backward the travelling side, double-buffered too: the
    query side under burst's backward (q, dout in the compute dtype, dq in float32, lse and delta), keys and values
    under ring's (k, v in the compute dtype, dk, dv in float32; the local dq, lse and delta accumulators stay); auto
    takes the one that sends fewer bytes (burst/cost.py), ring for grouped-query models."""
    if shape.cp == 1:
        return 0
    rows = shape.tokens_per_rank
    width = compute_width(shape)
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    forward = 2 * 2 * rows * kv * width + rows * (q + model.heads) * 4
    if shape.forward_only:
        return forward
    burst_hop, ring_hop = 2 * q * width + 2 * model.heads * 4 + q * 4, 2 * kv * width + 2 * kv * 4  # bytes a row
    mode = shape.attention_backward if shape.attention_backward != "auto" else \
        ("burst" if burst_hop < ring_hop else "ring")
    if mode == "burst":
        backward = 2 * rows * (2 * q * width + q * 4 + 2 * model.heads * 4) + 2 * rows * kv * 4
    else:
        backward = 2 * rows * ring_hop + rows * (q * 4 + 2 * model.heads * 4)
    return max(forward, backward)


def loss_bytes(shape: RunShape, model: Footprint) -> int:
    """The loss's chunk: float32 logits of --loss-tile rows and their softmax gradient (models/loss.py)."""
    rows = min(shape.loss_tile, shape.tokens_per_rank)
    return 2 * rows * model.vocab * 4


def kv_cache_bytes(shape: RunShape, model: Footprint, hardware: Hardware) -> int:
    """Generation's KV cache on one rank (burst/decode.py): every layer's keys and values of the rank's shard of the
    prompt and of its round-robin share of the new tokens, in `cache_dtype` (float32 on a CPU, else the weights'
    dtype); 0 when not generating."""
    if not shape.new_tokens:
        return 0
    tokens = cache_capacity(shape.seq_len, shape.new_tokens, shape.cp)
    width = cache_dtype(torch.bfloat16 if shape.precision == "bf16" else torch.float32, hardware.device).itemsize
    return 2 * model.layers * shape.batch_size * tokens * model.kv_heads * model.head_dim * width


def forward_parts(shape: RunShape, model: Footprint, hardware: Hardware) -> dict[str, int]:
    """Evaluation's tensors: every rank holds each model whole in its dtype, one block's activations, attention's
    buffers and the loss's chunk, and when generating its KV cache; no gradients or optimizer."""
    parts = {"weights": shape.models * compute_width(shape) * model.parameters, "gathered weights": 0,
             "activations": forward_activation_bytes(shape, model, hardware),
             "attention buffers": attention_buffer_bytes(shape, model), "loss chunk": loss_bytes(shape, model)}
    if shape.new_tokens:
        parts["kv cache"] = kv_cache_bytes(shape, model, hardware)
    return parts


def training_parts(shape: RunShape, model: Footprint, hardware: Hardware, mode: str) -> dict[str, int]:
    """Training's tensors at the larger of the early and the late peak of backward (see the module docstring)."""
    world = shape.world_size
    # early in backward every layer's kept activations are held and few gradients; late, the whole gradient and
    # none of them; the block being differentiated, its buffers and the outer activations at both
    kept, working = activation_bytes(shape, model, hardware, mode)
    trainable = trainable_parameters(shape, model)
    early = 4 * (trainable.block + trainable.outer) // world  # gradients held early in backward
    late = 4 * trainable.parameters // world
    early_peak = kept + loss_bytes(shape, model) + early >= late
    weights = 4 * trainable.parameters + frozen_bytes(shape, model, hardware, trainable.frozen)
    return {"weights": weights // world, "gradients": early if early_peak else late,
            "optimizer state": 8 * trainable.parameters // world,
            "gathered weights": (2 * model.block + model.outer) * compute_width(shape) if world > 1 else 0,
            "activations": kept if early_peak else 0, "backward working set": working,
            "attention buffers": attention_buffer_bytes(shape, model),
            "loss chunk": loss_bytes(shape, model) if early_peak else 0}


def memory_parts(shape: RunShape, model: Footprint, hardware: Hardware, mode: str | None = None) -> dict[str, int]:
    """Bytes one rank holds at its peak, by part; `mode` defaults to the shape's recomputation. A forward-only shape
    (evaluation) holds weights and one layer's activations, no gradients or optimizer."""
    if shape.forward_only:
        parts = forward_parts(shape, model, hardware)
    else:
        parts = training_parts(shape, model, hardware, mode or shape.activation_checkpointing)
    constants = hardware.constants(shape.precision)
    parts["allocator"] = int(sum(parts.values()) * constants.allocator_overhead)
    parts["process"] = constants.process_bytes
    return parts


TENSOR_PARTS = ("weights", "gradients", "optimizer state", "gathered weights", "activations", "backward working set",
                "attention buffers", "loss chunk", "kv cache")


def allocated_bytes(parts: dict[str, int]) -> int:
    """The tensors' bytes alone: what torch.cuda.max_memory_allocated measures."""
    return sum(size for name, size in parts.items() if name in TENSOR_PARTS)
