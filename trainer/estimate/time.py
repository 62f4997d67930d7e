"""Time of one optimizer step, by part, from FLOPs and bytes.

Attention's work is counted from the plan BurstAttention itself runs (burst/plan.py): the visible
(query, key) pairs of every kernel call of the busiest rank, so the causal mask, the zigzag or balanced
layout, document masks and prefix sharing count as they run. Its ring traffic is burst/cost.py's count for
the topology; it hides behind the attention compute of the same layer, and only the excess is paid.
FSDP's gathers and reductions hide behind the matmuls the same way.
"""

from __future__ import annotations

import torch

from burst.cost import choose_topology, plan_bytes
from burst.layout import row_layouts
from burst.plan import AttentionPlan
from models.footprint import Footprint, attention_flops, matmul_flops_per_token
from trainer.config import TrainConfig
from trainer.estimate import calibration
from trainer.estimate.hardware import Hardware
from trainer.estimate.memory import compute_width


def document_boundaries(seq_len: int, doc_len: int | None) -> list[int] | None:
    """Offsets of documents of `doc_len` tokens packed into a sequence (the last one shorter); None: one stream."""
    if doc_len is None or doc_len >= seq_len:
        return None
    return [*range(0, seq_len, doc_len), seq_len]


def prefix_sees(boundaries: list[int] | None) -> list[int] | None:
    """Preference packing with prefix sharing: documents come as (prompt, chosen, rejected), both answers seeing
    their prompt whole."""
    if boundaries is None:
        return None
    return [i - (i % 3) if i % 3 else -1 for i in range(len(boundaries) - 1)]


def attention_plan(config: TrainConfig, doc_len: int | None, prefix_sharing: bool = False) -> AttentionPlan:
    """The plan of one sequence as BurstAttention cuts it (cp ranks, the config's layout)."""
    boundaries = document_boundaries(config.seq_len, doc_len) if config.doc_mask else None
    sees = prefix_sees(boundaries) if prefix_sharing else None
    layout = config.sequence_layout if boundaries is not None else "zigzag"
    layouts = row_layouts(layout, None if boundaries is None else [boundaries], config.seq_len, config.cp, 1,
                          None if sees is None else [sees])
    return AttentionPlan(layouts, True, None if boundaries is None else [boundaries],
                         None if sees is None else [sees])


def segment_pairs(segment) -> int:
    q = segment.q_rows.stop - segment.q_rows.start
    k = segment.kv_rows.stop - segment.kv_rows.start
    return q * (q + 1) // 2 if segment.causal else q * k


def busiest_rank_pairs(plan: AttentionPlan) -> int:
    """Visible (query, key) pairs of the rank with the most, over every key/value shard it meets."""
    return max(sum(segment_pairs(s) for kv in range(plan.world_size) for s in plan(rank, kv))
               for rank in range(plan.world_size))


def ring_bytes(config: TrainConfig, model: Footprint, hardware: Hardware, plan: AttentionPlan) -> tuple[int, int]:
    """(intra-node, inter-node) bytes the busiest rank sends per layer, forward + backward."""
    if config.cp == 1:
        return 0, 0
    dtype = torch.bfloat16 if compute_width(config, hardware) == 2 else torch.float32
    rows = config.seq_len // config.cp
    q = torch.empty(config.batch_size, rows, model.heads, model.head_dim, dtype=dtype, device="meta")
    k = torch.empty(config.batch_size, rows, model.kv_heads, model.head_dim, dtype=dtype, device="meta")
    node = min(hardware.gpus_per_node, config.cp)
    topology = choose_topology(config.cp_topology, q, k, config.attention_backward, node, config.cp)
    if topology == "ulysses":
        topology = "two-level"  # counted as the same crossings (burst/cost.py), without the all-to-all
    worst = (0, 0)
    for rank in range(config.cp):
        forward, forward_across, backward, backward_across = plan_bytes(plan, topology, q, k,
                                                                        config.attention_backward, node, rank)
        total, across = forward + backward, forward_across + backward_across
        worst = max(worst, (total - across, across), key=sum)
    return worst


def time_parts(config: TrainConfig, model: Footprint, hardware: Hardware, doc_len: int | None = None,
               prefix_sharing: bool = False) -> dict[str, float]:
    """Seconds of one optimizer step by part, on the busiest rank."""
    device = hardware.device
    tokens = config.batch_size * config.seq_len // config.cp * config.grad_accum  # per rank per step
    mode = config.activation_checkpointing
    # A CPU's rates are measured on all its cores; the ranks of one machine share them (a GPU is a rank's own)
    sharing = max(1, config.world_size // hardware.nodes) if device == "cpu" else 1
    matmul_rate = hardware.matmul_tflops * 1e12 * calibration.MATMUL_EFFICIENCY[device] / sharing
    attention_rate = hardware.attention_tflops * 1e12 * (calibration.CPU_ATTENTION_FRACTION if device == "cpu"
                                                        else 1.0) / sharing
    recompute = 0 if mode == "none" else 2 * model.matmul  # the recomputed forward of the matmuls
    matmul = tokens * (matmul_flops_per_token(model) + recompute) / matmul_rate
    plan = attention_plan(config, doc_len, prefix_sharing)
    pairs = busiest_rank_pairs(plan) * config.batch_size * config.grad_accum
    passes = 4 if mode == "full" else 3  # forward, backward's two; full recomputes the forward
    attention = passes * attention_flops(model, pairs) / attention_rate
    intra, inter = ring_bytes(config, model, hardware, plan)
    per_layer = max(intra / (hardware.nvlink_gbps * 1e9), inter / (hardware.network_gbps * 1e9))
    ring = per_layer * model.layers * config.grad_accum * (2 if mode == "full" else 1)
    world = config.world_size
    fsdp = 0.0
    if world > 1:
        link = hardware.network_gbps if world > hardware.gpus_per_node else hardware.nvlink_gbps
        gathered = model.parameters * compute_width(config, hardware) * (2 if mode == "none" else 3)
        reduced = model.parameters * 4
        fsdp = (gathered + reduced) * (world - 1) / world / (link * 1e9)
    optimizer = 16 * 3 * model.parameters / world / (hardware.memory_gbps * 1e9)
    return {"matmuls": matmul, "attention": attention, "ring exposed": max(0.0, ring - attention),
            "fsdp exposed": max(0.0, fsdp - matmul), "optimizer": optimizer,
            "overhead": calibration.STEP_OVERHEAD_S[device], "ring (hidden or not)": ring,
            "fsdp (hidden or not)": fsdp}


HIDDEN = ("ring (hidden or not)", "fsdp (hidden or not)")  # shown for information, not added to the step


def step_seconds(parts: dict[str, float]) -> float:
    return sum(value for name, value in parts.items() if name not in HIDDEN)


def model_flops(config: TrainConfig, model: Footprint, doc_len: int | None = None,
                prefix_sharing: bool = False) -> float:
    """The model's FLOPs of one step over all ranks, without recomputation (MFU's numerator)."""
    plan = attention_plan(config, doc_len, prefix_sharing)
    pairs = sum(segment_pairs(s) for r in range(plan.world_size) for kv in range(plan.world_size)
                for s in plan(r, kv))
    sequences = config.batch_size * config.grad_accum * config.dp
    return sequences * (config.seq_len * matmul_flops_per_token(model) + 3 * attention_flops(model, pairs))
