"""Which kernel calls one ring step makes: the segments of a query shard x key/value shard block.

A `Segment` is one kernel call on a rectangle of rows: batch rows `batch`, query rows
`q_rows` of the query shard, key rows `kv_rows` of the key/value shard, causal or not.

Without document masking a block is one segment (see `block_segments`). With document
masking (packed sequences, `doc_boundaries`), a query may only see keys of its own document.
Documents are contiguous runs of global positions and each zigzag chunk is one too, so the
visible part of a (query chunk, key chunk) pair is a set of rectangles, one per document
present in both: causal squares on the diagonal chunk, full rectangles where the key chunk
lies before the query chunk. Every other position pair is masked, and masked work is never
computed: a key/value shard that holds none of a query chunk's documents costs no kernel call.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from burst.layout import zigzag_chunks

ALL = slice(None)


@dataclass(frozen=True)
class Segment:
    batch: slice
    q_rows: slice
    kv_rows: slice
    causal: bool


def block_segments(query_owner: int, kv_owner: int, shard_len: int, world_size: int, causal: bool) -> list[Segment]:
    """The work between the query shard of `query_owner` and the key/value shard of `kv_owner`.

    Without a mask, one call on the whole block. With a causal mask, one call per visible
    pair of zigzag chunks: a key chunk before the query chunk is seen in full, the same chunk
    causally, a later one not at all. Every rank then makes calls of the same shape at every
    step (its own shard: two half-size causal diagonals and one full pair; any other shard:
    two full pairs), so no rank waits for a slower one, and the fused kernels waste less on
    half-size diagonals than on one causal call over the shard (about 10% of that block on
    PyTorch's CPU kernel).
    """
    if not causal:
        return [Segment(ALL, ALL, ALL, False)]
    chunk = shard_len // 2
    rows = (slice(0, chunk), slice(chunk, None))
    q_chunks, kv_chunks = zigzag_chunks(query_owner, world_size), zigzag_chunks(kv_owner, world_size)
    return [Segment(ALL, rows[qi], rows[ki], kc == qc)
            for qi, qc in enumerate(q_chunks) for ki, kc in enumerate(kv_chunks) if kc <= qc]


def document_segments(query_owner: int, kv_owner: int, shard_len: int, world_size: int, causal: bool,
                      boundaries: Sequence[Sequence[int]]) -> list[Segment]:
    """The unmasked rectangles between two shards when queries see only their own document.

    boundaries[b]: the cumulative document offsets of batch row b over the global sequence,
    [0, ..., seq_len]. Within a document attention is causal when `causal`, else full.
    """
    chunk = shard_len // 2
    q_chunks, kv_chunks = zigzag_chunks(query_owner, world_size), zigzag_chunks(kv_owner, world_size)
    segments = []
    for b, offsets in enumerate(boundaries):
        for qi, qc in enumerate(q_chunks):
            for ki, kc in enumerate(kv_chunks):
                if causal and kc > qc:
                    continue  # the whole key chunk lies in the queries' future
                q_start, k_start = qc * chunk, kc * chunk
                for doc_start, doc_end in _documents_overlapping(offsets, q_start, q_start + chunk):
                    q_lo, q_hi = max(doc_start, q_start), min(doc_end, q_start + chunk)
                    k_lo, k_hi = max(doc_start, k_start), min(doc_end, k_start + chunk)
                    if q_lo >= q_hi or k_lo >= k_hi:
                        continue  # the document is not in both chunks
                    q_local, k_local = qi * chunk - q_start, ki * chunk - k_start
                    segments.append(Segment(slice(b, b + 1), slice(q_lo + q_local, q_hi + q_local),
                                            slice(k_lo + k_local, k_hi + k_local), causal and qc == kc))
    return segments


def _documents_overlapping(offsets: Sequence[int], start: int, end: int) -> list[tuple[int, int]]:
    """(doc_start, doc_end) of the documents that intersect [start, end)."""
    first = bisect_right(offsets, start) - 1
    docs = []
    for i in range(max(first, 0), len(offsets) - 1):
        if offsets[i] >= end:
            break
        docs.append((offsets[i], offsets[i + 1]))
    return docs


class AttentionPlan:
    """segments(query_owner, kv_owner) for one call, computed once and reused by backward."""

    def __init__(self, shard_len: int, world_size: int, causal: bool, boundaries: list[list[int]] | None):
        self.shard_len, self.world_size, self.causal, self.boundaries = shard_len, world_size, causal, boundaries
        self._cache: dict[tuple[int, int], list[Segment]] = {}

    def __call__(self, query_owner: int, kv_owner: int) -> list[Segment]:
        key = (query_owner, kv_owner)
        if key not in self._cache:
            self._cache[key] = (
                block_segments(query_owner, kv_owner, self.shard_len, self.world_size, self.causal)
                if self.boundaries is None
                else document_segments(query_owner, kv_owner, self.shard_len, self.world_size, self.causal,
                                       self.boundaries))
        return self._cache[key]


def normalize_boundaries(doc_boundaries, batch: int, seq_len: int) -> list[list[int]]:
    """Check document boundaries and return them as lists of ints, one per batch row.

    Accepts a list of 1-D integer tensors or sequences, or a 2-D tensor [batch, n]; each row
    must rise strictly from 0 to the global sequence length. Raises ValueError otherwise.
    """
    rows = list(doc_boundaries.unbind(0)) if isinstance(doc_boundaries, torch.Tensor) and doc_boundaries.dim() == 2 \
        else list(doc_boundaries)
    if len(rows) != batch:
        raise ValueError(f"doc_boundaries has {len(rows)} rows but the batch has {batch}; give one 1-D tensor of "
                         "cumulative document offsets per batch row")
    result = []
    for b, row in enumerate(rows):
        offsets = row.tolist() if isinstance(row, torch.Tensor) else [int(x) for x in row]
        if (len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != seq_len
                or any(a >= c for a, c in pairwise(offsets))):
            raise ValueError(f"doc_boundaries row {b} must rise strictly from 0 to the global sequence length "
                             f"{seq_len} (cumulative offsets [0, end of doc 1, ..., {seq_len}]); "
                             f"got {offsets[:8]}{' ...' if len(offsets) > 8 else ''}")
        result.append(offsets)
    return result
