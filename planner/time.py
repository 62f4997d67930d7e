"""Time of one optimizer step, by part, from FLOPs and bytes; and the model FLOPs of a step (MFU's numerator).

Attention's work is counted from the plan BurstAttention itself runs (planner/attention.py's sequence_plan): the
visible (query, key) pairs of every kernel call of the busiest rank, so the causal mask, the zigzag or balanced
layout, document masks and prefix sharing count as they run. Its ring traffic is burst/cost.py's count for
the topology; it hides behind the attention compute of the same layer, and only the excess is paid.
FSDP's gathers and reductions hide behind the matmuls the same way.
"""

from __future__ import annotations

import torch

from burst.cost import choose_topology, plan_bytes
from burst.plan import AttentionPlan
from models.footprint import Footprint, attention_flops, matmul_flops_per_token
from planner.attention import busiest_rank_pairs, document_boundaries, prefix_sees, rank_pairs, sequence_plan
from planner.hardware import Hardware
from planner.memory import compute_width, host_bytes, trainable_parameters
from planner.shape import RunShape


def shape_plan(shape: RunShape, window: int | None = None, layout_windows=None) -> AttentionPlan:
    """The plan of one of the shape's sequences as BurstAttention cuts it (cp ranks, the shape's layout, balanced
    for a model whose layers have the sliding windows `layout_windows`, as training lays it out) for a layer with a
    sliding `window` (None: causal)."""
    boundaries = document_boundaries(shape.seq_len, shape.doc_len)
    sees = prefix_sees(boundaries) if shape.prefix_sharing else None
    return sequence_plan(shape.seq_len, shape.cp, boundaries, sees, shape.layout, window=window,
                         layout_windows=layout_windows)


def over_layers(shape: RunShape, model: Footprint, count) -> float:
    """count(plan) summed over the model's layers, each layer's plan under its own window."""
    return sum(layers * count(shape_plan(shape, window, model.windows or None))
               for window, layers in model.layer_windows().items())


def ring_bytes(shape: RunShape, model: Footprint, hardware: Hardware, plan: AttentionPlan) -> tuple[int, int]:
    """(intra-node, inter-node) bytes the busiest rank sends per layer, forward + backward."""
    if shape.cp == 1:
        return 0, 0
    dtype = torch.bfloat16 if compute_width(shape) == 2 else torch.float32
    rows = shape.seq_len // shape.cp
    q = torch.empty(shape.batch_size, rows, model.heads, model.head_dim, dtype=dtype, device="meta")
    k = torch.empty(shape.batch_size, rows, model.kv_heads, model.head_dim, dtype=dtype, device="meta")
    node = min(hardware.gpus_per_node, shape.cp)
    topology = choose_topology(shape.cp_topology, q, k, shape.attention_backward, node, shape.cp)
    if topology == "ulysses":
        topology = "two-level"  # counted as the same crossings (burst/cost.py), without the all-to-all
    worst = (0, 0)
    for rank in range(shape.cp):
        forward, forward_across, backward, backward_across = plan_bytes(plan, topology, q, k,
                                                                        shape.attention_backward, node, rank)
        total, across = forward + backward, forward_across + backward_across
        worst = max(worst, (total - across, across), key=sum)
    return worst


def time_parts(shape: RunShape, model: Footprint, hardware: Hardware) -> dict[str, float]:
    """Seconds of one optimizer step by part, on the busiest rank."""
    device = hardware.device
    constants = hardware.constants(shape.precision)
    tokens = shape.tokens_per_rank * shape.grad_accum  # per rank per step
    mode = shape.activation_checkpointing
    # A CPU's rates are measured on all its cores; the ranks of one machine share them (a GPU is a rank's own).
    # Its fixed per-step work (Python, the ring's hand-offs) runs on one core a rank, slowed once the ranks
    # outnumber the cores
    local_ranks = max(1, shape.world_size // hardware.nodes)
    sharing = local_ranks if device == "cpu" else 1
    crowding = max(1.0, local_ranks / hardware.cores) if device == "cpu" and hardware.cores else 1.0
    matmul_rate = hardware.peak_tflops(shape.precision) * 1e12 * constants.matmul_efficiency / sharing
    attention_rate = hardware.attention_tflops_in(shape.precision) * 1e12 * constants.attention_fraction / sharing
    # recomputation replays the blocks' forward matmuls, not the output head's (outside the blocks)
    recompute = 0 if mode == "none" else 2 * (model.matmul - model.vocab * model.dim)
    matmul = tokens * (matmul_flops_per_token(model) + recompute) / matmul_rate
    # norms, rotary, SwiGLU, residual adds: memory-bound work over a block's width, forward and backward's two
    # passes, once more when recomputed (dominant on CPU for narrow models; folded into the matmul rate on GPU)
    passes = 3 if mode == "none" else 4
    elementwise = tokens * model.layers * model.block_width * passes * sharing * constants.elementwise_s_per_value
    pairs = over_layers(shape, model, busiest_rank_pairs) * shape.batch_size * shape.grad_accum  # all layers
    passes = 4 if mode == "full" else 3  # forward, backward's two; full recomputes the forward
    # QK^T and PV at the kernel's rate, plus the softmax's exp/max/sum per score, whatever the head's width
    scores = passes * pairs * model.heads
    attention = (passes * attention_flops(model, pairs) / attention_rate
                 + scores * sharing * constants.attention_score_s)

    def layer_ring_s(plan: AttentionPlan) -> float:
        intra, inter = ring_bytes(shape, model, hardware, plan)
        return max(intra / (hardware.nvlink_gbps * 1e9), inter / (hardware.network_gbps * 1e9))

    ring = over_layers(shape, model, layer_ring_s) * shape.grad_accum * (2 if mode == "full" else 1)
    # each ring step's hand-off (a send/receive pair, forward and backward) costs a latency compute cannot hide
    # where the ranks share cores (gloo on CPU); NCCL's microseconds under a GPU's kernels are left out
    ring_steps = 2 * (shape.cp - 1) * model.layers * shape.grad_accum * (2 if mode == "full" else 1)
    handoffs = ring_steps * crowding * constants.ring_step_s
    world = shape.world_size
    fsdp = 0.0
    if world > 1:
        link = hardware.network_gbps if world > hardware.gpus_per_node else hardware.nvlink_gbps
        gathered = model.parameters * compute_width(shape) * (2 if mode == "none" else 3)
        reduced = trainable_parameters(shape, model).parameters * 4  # LoRA: the adapters' gradients only
        fsdp = (gathered + reduced) * (world - 1) / world / (link * 1e9)
    optimizer = 16 * 3 * trainable_parameters(shape, model).parameters / world / (hardware.memory_gbps * 1e9)
    # offloaded block inputs cross PCIe twice a step (out in forward, back in backward), beside the compute
    offload = 2 * host_bytes(shape, model, hardware) * shape.grad_accum / (hardware.pcie_gbps * 1e9) \
        if hardware.pcie_gbps else 0.0
    return {"matmuls": matmul, "elementwise": elementwise, "attention": attention,
            "ring exposed": max(0.0, ring - attention), "ring hand-offs": handoffs,
            "fsdp exposed": max(0.0, fsdp - matmul), "optimizer": optimizer,
            "offload exposed": max(0.0, offload - matmul - attention),
            "overhead": constants.step_overhead_s * crowding, "ring (hidden or not)": ring,
            "fsdp (hidden or not)": fsdp, "offload (hidden or not)": offload}


# shown for information, not added to the step
HIDDEN = ("ring (hidden or not)", "fsdp (hidden or not)", "offload (hidden or not)")


def step_seconds(parts: dict[str, float]) -> float:
    return sum(value for name, value in parts.items() if name not in HIDDEN)


def model_flops(shape: RunShape, model: Footprint) -> float:
    """The model's FLOPs of one step over all ranks, without recomputation: MFU's numerator, the one FLOP count of
    the project (`burst plan` and scripts/gpu_benchmark.py). The matrices and the output head at 6 FLOPs a
    parameter a token; attention's QK^T and PV over the pairs the plan leaves visible, forward and backward."""
    pairs = over_layers(shape, model, lambda plan: sum(rank_pairs(plan)))
    sequences = shape.batch_size * shape.grad_accum * shape.dp
    return sequences * (shape.seq_len * matmul_flops_per_token(model) + 3 * attention_flops(model, pairs))


def model_flops_per_token(shape: RunShape, model: Footprint) -> float:
    """`model_flops` over the step's tokens."""
    return model_flops(shape, model) / shape.tokens_per_step
