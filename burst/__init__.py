"""burst: exact distributed attention (BurstAttention) for long sequences.

    out = burst.burst_attn(q, k, v, causal=True, group=cp_group)   # q, k, v: this rank's shards
"""

from burst.attention import BACKWARD_MODES, burst_attn, check_backward_mode
from burst.comm import SENT
from burst.cost import choose_backward
from burst.kernels import select_kernel
from burst.layout import (
    gather_sequence,
    sequence_positions,
    shard_for_rank,
    shard_sequence,
    unshard,
    zigzag_positions,
)
from burst.module import BurstAttention

__all__ = [
    "BACKWARD_MODES",
    "BurstAttention",
    "SENT",
    "burst_attn",
    "check_backward_mode",
    "choose_backward",
    "gather_sequence",
    "select_kernel",
    "sequence_positions",
    "shard_for_rank",
    "shard_sequence",
    "unshard",
    "zigzag_positions",
]
