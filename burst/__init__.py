"""burst: exact distributed attention (BurstAttention) for long sequences."""

from burst.layout import (
    gather_sequence,
    sequence_positions,
    shard_for_rank,
    shard_sequence,
    unshard,
    zigzag_positions,
)

__all__ = [
    "gather_sequence",
    "sequence_positions",
    "shard_for_rank",
    "shard_sequence",
    "unshard",
    "zigzag_positions",
]
