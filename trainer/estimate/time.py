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


def document_boundaries(seq_len: int, doc_len: int | list[int] | None) -> list[int] | None:
    """Offsets of documents packed into a sequence (the last one cut short); None: one stream. `doc_len`: one
    length, or a pattern of lengths repeated (a preference pair's prompt, chosen and rejected answers). For a
    mix of lengths the length that counts attention right is the length-weighted mean, sum(l^2) / sum(l)."""
    pattern = [doc_len] if isinstance(doc_len, int) else doc_len
    if not pattern or sum(pattern) >= seq_len and len(pattern) == 1:
        return None
    offsets = [0]
    while offsets[-1] < seq_len:
        offsets.append(min(seq_len, offsets[-1] + pattern[(len(offsets) - 1) % len(pattern)]))
    return offsets


def effective_doc_len(lengths, seq_len: int) -> int:
    """The one document length whose packing has as many attention pairs as `lengths` (a store's documents)
    packed into sequences of `seq_len`: sum(l^2) / sum(l) over the pieces, a document longer than the sequence
    cut into sequence-long pieces and a remainder. The plain mean undercounts: on the embedded corpus it is
    5,637 tokens where 128K sequences attend as if their documents were 24,241 long."""
    total = squares = 0
    for length in (int(n) for n in lengths):
        total += length
        squares += (length // seq_len) * seq_len**2 + (length % seq_len) ** 2
    if total == 0:
        raise ValueError("no documents to take a length from")
    return max(1, round(squares / total))


def prefix_sees(boundaries: list[int] | None) -> list[int] | None:
    """Preference packing with prefix sharing: documents come as (prompt, chosen, rejected), both answers seeing
    their prompt whole."""
    if boundaries is None:
        return None
    return [i - (i % 3) if i % 3 else -1 for i in range(len(boundaries) - 1)]


def attention_plan(config: TrainConfig, doc_len: int | list[int] | None, prefix_sharing: bool = False) -> AttentionPlan:
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


def time_parts(config: TrainConfig, model: Footprint, hardware: Hardware, doc_len: int | list[int] | None = None,
               prefix_sharing: bool = False) -> dict[str, float]:
    """Seconds of one optimizer step by part, on the busiest rank."""
    device = hardware.device
    key = calibration.key(device, config.precision)
    tokens = config.batch_size * config.seq_len // config.cp * config.grad_accum  # per rank per step
    mode = config.activation_checkpointing
    # A CPU's rates are measured on all its cores; the ranks of one machine share them (a GPU is a rank's own).
    # Its fixed per-step work (Python, the ring's hand-offs) runs on one core a rank, slowed once the ranks
    # outnumber the cores
    local_ranks = max(1, config.world_size // hardware.nodes)
    sharing = local_ranks if device == "cpu" else 1
    crowding = max(1.0, local_ranks / hardware.cores) if device == "cpu" and hardware.cores else 1.0
    matmul_rate = hardware.matmul_tflops * 1e12 * calibration.MATMUL_EFFICIENCY[key] / sharing
    attention_rate = hardware.attention_tflops * 1e12 * calibration.ATTENTION_FRACTION[key] / sharing
    # recomputation replays the blocks' forward matmuls, not the output head's (outside the blocks)
    recompute = 0 if mode == "none" else 2 * (model.matmul - model.vocab * model.dim)
    matmul = tokens * (matmul_flops_per_token(model) + recompute) / matmul_rate
    # norms, rotary, SwiGLU, residual adds: memory-bound work over a block's width, forward and backward's two
    # passes, once more when recomputed (dominant on CPU for narrow models; folded into the matmul rate on GPU)
    passes = 3 if mode == "none" else 4
    elementwise = (tokens * model.layers * model.block_width * passes * sharing
                   * calibration.ELEMENTWISE_S_PER_VALUE[key])
    plan = attention_plan(config, doc_len, prefix_sharing)
    pairs = busiest_rank_pairs(plan) * config.batch_size * config.grad_accum
    passes = 4 if mode == "full" else 3  # forward, backward's two; full recomputes the forward
    # QK^T and PV at the kernel's rate, plus the softmax's exp/max/sum per score, whatever the head's width
    scores = passes * pairs * model.heads * model.layers
    attention = (passes * attention_flops(model, pairs) / attention_rate
                 + scores * sharing * calibration.ATTENTION_SCORE_S[key])
    intra, inter = ring_bytes(config, model, hardware, plan)
    per_layer = max(intra / (hardware.nvlink_gbps * 1e9), inter / (hardware.network_gbps * 1e9))
    ring = per_layer * model.layers * config.grad_accum * (2 if mode == "full" else 1)
    # each ring step's hand-off (a send/receive pair, forward and backward) costs a latency compute cannot hide
    # where the ranks share cores (gloo on CPU); NCCL's microseconds under a GPU's kernels are left out
    ring_steps = 2 * (config.cp - 1) * model.layers * config.grad_accum * (2 if mode == "full" else 1)
    handoffs = ring_steps * crowding * calibration.RING_STEP_S[key]
    world = config.world_size
    fsdp = 0.0
    if world > 1:
        link = hardware.network_gbps if world > hardware.gpus_per_node else hardware.nvlink_gbps
        gathered = model.parameters * compute_width(config, hardware) * (2 if mode == "none" else 3)
        reduced = model.parameters * 4
        fsdp = (gathered + reduced) * (world - 1) / world / (link * 1e9)
    optimizer = 16 * 3 * model.parameters / world / (hardware.memory_gbps * 1e9)
    return {"matmuls": matmul, "elementwise": elementwise, "attention": attention,
            "ring exposed": max(0.0, ring - attention), "ring hand-offs": handoffs,
            "fsdp exposed": max(0.0, fsdp - matmul), "optimizer": optimizer,
            "overhead": calibration.STEP_OVERHEAD_S[key] * crowding, "ring (hidden or not)": ring,
            "fsdp (hidden or not)": fsdp}


HIDDEN = ("ring (hidden or not)", "fsdp (hidden or not)")  # shown for information, not added to the step


def step_seconds(parts: dict[str, float]) -> float:
    return sum(value for name, value in parts.items() if name not in HIDDEN)


def model_flops(config: TrainConfig, model: Footprint, doc_len: int | list[int] | None = None,
                prefix_sharing: bool = False) -> float:
    """The model's FLOPs of one step over all ranks, without recomputation (MFU's numerator)."""
    plan = attention_plan(config, doc_len, prefix_sharing)
    pairs = sum(segment_pairs(s) for r in range(plan.world_size) for kv in range(plan.world_size)
                for s in plan(r, kv))
    sequences = config.batch_size * config.grad_accum * config.dp
    return sequences * (config.seq_len * matmul_flops_per_token(model) + 3 * attention_flops(model, pairs))
