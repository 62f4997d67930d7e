"""One sequence as BurstAttention cuts it: its documents, its plan of kernel calls, and the work that plan does.

`sequence_plan` is the one way the planner, `burst bench attention --docs` and benchmarks/ make the plan of a
sequence whose documents they know (burst/plan.py's AttentionPlan over burst/layout.py's layouts); the step time
counts its visible pairs, the benchmarks its tiles (burst/balance.py's plan_work) and bytes (burst/cost.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from burst.balance import band_pairs
from burst.layout import row_layouts
from burst.plan import AttentionPlan


def sequence_plan(seq_len: int, world: int, boundaries: Sequence[int] | None = None,
                  sees: Sequence[int] | None = None, layout: str = "zigzag", rows: int = 1,
                  causal: bool = True, window: int | None = None, layout_windows=None) -> AttentionPlan:
    """The plan of `rows` batch rows of one sequence cut over `world` ranks: documents at `boundaries` (offsets
    [0, ..., seq_len]; None: one stream, cut zigzag), each seeing the earlier document `sees` names (-1: none; None:
    none at all), the shards laid out by `layout` (zigzag or balanced: weighing the work of a model whose layers have
    the sliding windows `layout_windows`, as training chooses it), under a sliding `window` (None: none)."""
    if boundaries is None:
        layouts = row_layouts("zigzag", None, seq_len, world, rows, None)
        return AttentionPlan(layouts, causal, None, None, window)
    boundaries, sees = list(boundaries), None if sees is None else list(sees)
    (chosen,) = row_layouts(layout, [boundaries], seq_len, world, 1, None if sees is None else [sees],
                            layout_windows)
    return AttentionPlan([chosen] * rows, causal, [boundaries] * rows, None if sees is None else [sees] * rows, window)


def document_boundaries(seq_len: int, doc_len: int | Sequence[int] | None) -> list[int] | None:
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


def segment_pairs(segment) -> int:
    q = segment.q_rows.stop - segment.q_rows.start
    k = segment.kv_rows.stop - segment.kv_rows.start
    return band_pairs(q, k, segment.causal, segment.band)


def rank_pairs(plan: AttentionPlan) -> list[int]:
    """Visible (query, key) pairs of each rank, over every key/value shard it meets."""
    return [sum(segment_pairs(s) for kv in range(plan.world_size) for s in plan(rank, kv))
            for rank in range(plan.world_size)]


def busiest_rank_pairs(plan: AttentionPlan) -> int:
    """Visible (query, key) pairs of the rank with the most."""
    return max(rank_pairs(plan))
