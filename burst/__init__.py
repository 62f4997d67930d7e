"""burst: exact distributed attention (BurstAttention) for long sequences.

    out = burst.burst_attn(q, k, v, causal=True, group=cp_group)   # q, k, v: this rank's shards
    out = burst.burst_attn(q, k, v, group=cp_group, doc_boundaries=offsets, layout="balanced")  # packed documents
    out = burst.local_attn(q, k, v, doc_boundaries=offsets)   # one process, the whole sequence, no process group
    out = burst.burst_attn(q, k, v, group=cp_group, window=4096)   # a sliding window: i - 4096 < j <= i
    documents = burst.Documents.of(offsets, seq_len, world_size, "balanced")  # the documents as one value, the
    out = burst.burst_attn(q, k, v, group=cp_group, documents=documents, layout="balanced")  # layout chosen once
"""

from burst.attention import burst_attn
from burst.checks import BACKWARD_MODES, check_backward_mode
from burst.comm import SENT
from burst.cost import choose_backward
from burst.documents import Documents
from burst.kernels import select_kernel
from burst.layout import (
    LAYOUTS,
    Layout,
    balanced_layout,
    gather_sequence,
    sequence_positions,
    shard_for_rank,
    shard_sequence,
    unshard,
    zigzag_positions,
)
from burst.local import local_attn
from burst.module import BurstAttention

__all__ = [
    "BACKWARD_MODES",
    "BurstAttention",
    "Documents",
    "LAYOUTS",
    "Layout",
    "SENT",
    "balanced_layout",
    "burst_attn",
    "check_backward_mode",
    "choose_backward",
    "gather_sequence",
    "local_attn",
    "select_kernel",
    "sequence_positions",
    "shard_for_rank",
    "shard_sequence",
    "unshard",
    "zigzag_positions",
]
