"""Which kernel calls one ring step makes: the segments of a query shard x key/value shard block.

A `Segment` is one kernel call on a rectangle of rows: batch rows `batch`, query rows
`q_rows` of the query shard, key rows `kv_rows` of the key/value shard, causal or not.

Shards hold runs of consecutive positions (burst/layout.py); two runs of different ranks, or
different runs of one rank, never overlap, so under a causal mask a key run lies wholly before a
query run (seen in full), is the same run (seen causally) or lies after it (not seen). Without
document masking a (query run, key run) pair is one call over every batch row; without a causal
mask the whole block is one call.

With document masking (packed sequences, `doc_boundaries`), a query may only see keys of its own
document. Documents are contiguous runs of global positions, so the visible part of a pair of
runs is one rectangle per document present in both: causal squares on the diagonal, full
rectangles where the key run lies before the query run. Every other position pair is masked, and
masked work is never computed: a key/value shard that holds none of a query shard's documents
costs no kernel call, and the ring sends it nothing; of one it needs, only the rows its calls
touch travel (`Rows`, burst/ring.py).

A document may also see one earlier document whole (`sees`, per row one index per document, -1 for
none: prefix sharing, where both answers of a preference pair see their prompt). Its queries then
meet the seen document's keys in full rectangles as well (the seen document lies wholly before them,
so no causal mask cuts them); consecutive documents that see the same one share a call. Nothing else
changes: a shard that holds only documents no query of another shard sees still gets nothing.

A sliding window W (`window`, always with the causal mask) lets the query at position i see keys j with
i - W < j <= i, within its document (a seen document counts as lying just before the document that sees
it, at the positions a run of the two alone would give them). Every visible rectangle above is cut by
the band (`band_segments`): for a kernel that takes the window natively (`whole_bands`: flash-attn's and
FlashAttention-3/4's `window_size`, the CPU kernel's own strips, burst/kernels/contract.py) into one `band`
segment, the rows and columns of the rectangle that see something, so that each pair of runs holding a
visible pair costs one call; for any other kernel into strips of query rows, a full rectangle between two
partly covered edges, the causal one a causal square and the window's a small `band` segment that the math
kernel masks. Rectangles wholly outside the band cost no call, and rows no call touches do not travel: a
shard whose keys lie outside every window of another's queries sends it nothing (both cuts touch the same
rows, so the same rows travel).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from burst.layout import Layout, Run

ALL = slice(None)


Band = tuple[int, int]  # (lo, hi): a segment's query row r sees its key row c iff lo <= r - c <= hi


@dataclass(frozen=True)
class Segment:
    batch: slice
    q_rows: slice
    kv_rows: slice
    causal: bool
    band: Band | None = None  # set: the pairs the segment sees (causal is then False); every row and column sees one

    @property
    def mask(self) -> bool | Band:
        """What the kernel call masks: its band, else the causal flag (burst/varlen.py)."""
        return self.causal if self.band is None else self.band


def band_strip(window: int) -> int:
    """Query rows per strip of a band: a quarter of the window (the partly covered edges, computed in full
    and masked, are then about an eighth of the work), a power of two between 64 and 512 rows (each
    band segment's mask stays within 512 x 1,023 entries: memory linear in the sequence)."""
    return min(512, max(64, 1 << max(window // 4, 1).bit_length() - 1))


def band_segments(batch: slice, q_rows: slice, kv_rows: slice, distance: int, causal: bool,
                  window: int | None, whole: bool = False) -> list[Segment]:
    """The visible part of one rectangle, as segments: the query at row r sees the key at column c of it
    iff d = distance + r - c (its distance back in positions) satisfies 0 <= d (when `causal`) and
    d < window (when `window`). The rows and columns of each segment all see something, so no kernel
    returns an empty row and the kernels' own alignment of a band holds (burst/kernels/contract.py).
    `whole`: one segment, for a kernel that takes the window natively; otherwise strips of `band_strip`
    query rows where the window cuts, up to three segments each."""
    rows, cols = q_rows.stop - q_rows.start, kv_rows.stop - kv_rows.start
    beyond = rows + cols + abs(distance)  # further than any pair of the rectangle
    lo, hi = (0 if causal else -beyond), (window - 1 if window else beyond)
    segments = []

    def add(r0: int, r1: int, c0: int, c1: int) -> None:
        """The part of rows [r0, r1) x columns [c0, c1) that sees something, as one segment."""
        c0, c1 = max(c0, 0), min(c1, cols)
        r0, r1 = max(r0, c0 - distance + lo), min(r1, c1 - distance + hi)
        c0, c1 = max(c0, r0 + distance - hi), min(c1, r1 - 1 + distance - lo + 1)
        if r0 >= r1 or c0 >= c1:
            return
        n_r, n_c, shift = r1 - r0, c1 - c0, distance + r0 - c0
        band = (max(lo - shift, 1 - n_c), min(hi - shift, n_r - 1))
        full, square = band == (1 - n_c, n_r - 1), band == (0, n_r - 1) and n_r == n_c
        segments.append(Segment(batch, slice(q_rows.start + r0, q_rows.start + r1),
                                slice(kv_rows.start + c0, kv_rows.start + c1), square,
                                None if full or square else band))

    if whole:
        add(0, rows, 0, cols)
        return segments
    strip = band_strip(window) if distance + rows - 1 > hi else rows  # strips only where the window cuts
    for r0 in range(0, rows, strip):
        r1 = min(rows, r0 + strip)
        # the columns every row of the strip sees; left of them the window's edge, right the causal one
        every_lo, every_hi = r1 - 1 + distance - hi, r0 + distance - lo
        if every_lo >= every_hi:
            add(r0, r1, 0, cols)  # the strip is taller than the band is wide: one band segment
            continue
        add(r0, r1, 0, every_lo)
        add(r0, r1, every_lo, every_hi)
        add(r0, r1, every_hi, cols)
    return segments


def run_pairs(q_runs: Sequence[Run], kv_runs: Sequence[Run], causal: bool):
    """(query run, key run, diagonal) of the pairs a causal mask leaves visible (all pairs without one)."""
    for q in q_runs:
        for k in kv_runs:
            if causal and k.start > q.start:
                continue  # the whole key run lies in the queries' future
            yield q, k, causal and k.start == q.start


def block_segments(layout: Layout, query_owner: int, kv_owner: int, causal: bool,
                   window: int | None = None, whole_bands: bool = True) -> list[Segment]:
    """The work between two shards of one layout that every batch row shares, with no document mask.

    Without a causal mask, one call on the whole block. With one, a call per visible pair of runs:
    under zigzag every rank then makes calls of the same shape at every step (its own shard: two
    half-size causal diagonals and one full pair; any other shard: two full pairs), so no rank waits
    for a slower one, and the fused kernels waste less on half-size diagonals than on one causal
    call over the shard (about 10% of that block on PyTorch's CPU kernel). A `window` cuts each pair
    (`band_segments`, whole or in strips as `whole_bands` says).
    """
    if not causal:
        return [Segment(ALL, ALL, ALL, False)]
    if window is None:
        return [Segment(ALL, slice(q.local, q.local + q.length), slice(k.local, k.local + k.length), diagonal)
                for q, k, diagonal in run_pairs(layout.runs(query_owner), layout.runs(kv_owner), causal)]
    return [segment for q, k, _ in run_pairs(layout.runs(query_owner), layout.runs(kv_owner), causal)
            for segment in band_segments(ALL, slice(q.local, q.local + q.length), slice(k.local, k.local + k.length),
                                         q.start - k.start, True, window, whole_bands)]


def document_segments(layout: Layout, query_owner: int, kv_owner: int, causal: bool, offsets: Sequence[int],
                      row: int, sees: Sequence[int] | None = None, window: int | None = None,
                      whole_bands: bool = True) -> list[Segment]:
    """The unmasked rectangles of batch row `row` between two shards when queries see only their own
    document, and the one it sees (if any). offsets: the row's cumulative document offsets over the
    global sequence, [0, ..., seq_len]; sees: per document, the index of the earlier document its queries
    also see whole, or -1 (None: -1 for all). Within a document attention is causal when `causal`, else
    full; a seen document is seen in full. A `window` cuts each rectangle (`band_segments`, whole or in
    strips as `whole_bands` says), a seen document's as if the document that sees it began where it ends."""
    batch = slice(row, row + 1)
    segments = []

    def visible(q_lo: int, q_hi: int, k_lo: int, k_hi: int, causal_: bool, distance: int) -> list[Segment]:
        """Global positions [q_lo, q_hi) x [k_lo, k_hi) of the pair of runs, the first query `distance` after
        the first key (where the window counts it), as segments of the shards' rows."""
        q_rows, kv_rows = slice(q_lo + q_shift, q_hi + q_shift), slice(k_lo + k_shift, k_hi + k_shift)
        if window is None:
            return [Segment(batch, q_rows, kv_rows, causal_)]
        return band_segments(batch, q_rows, kv_rows, distance, True, window, whole_bands)

    for q, k, diagonal in run_pairs(layout.runs(query_owner), layout.runs(kv_owner), causal):
        q_shift, k_shift = q.local - q.start, k.local - k.start
        seen: list[list[int]] = []  # [q_lo, q_hi, k_lo, k_hi] of the seen documents' rectangles, merged
        for doc, (doc_start, doc_end) in _documents_overlapping(offsets, q.start, q.start + q.length):
            q_lo, q_hi = max(doc_start, q.start), min(doc_end, q.start + q.length)
            k_lo, k_hi = max(doc_start, k.start), min(doc_end, k.start + k.length)
            if k_lo < k_hi:  # the document is in both runs
                segments += visible(q_lo, q_hi, k_lo, k_hi, diagonal, q_lo - k_lo)
            if sees is None or sees[doc] < 0:
                continue
            k_lo, k_hi = max(offsets[sees[doc]], k.start), min(offsets[sees[doc] + 1], k.start + k.length)
            if k_lo >= k_hi:
                continue  # the seen document is not in the key run
            if window is not None:  # the document's queries counted from the seen document's end
                segments += visible(q_lo, q_hi, k_lo, k_hi, False, q_lo - doc_start + offsets[sees[doc] + 1] - k_lo)
            elif seen and seen[-1][1] == q_lo and seen[-1][2:] == [k_lo, k_hi]:
                seen[-1][1] = q_hi  # the previous document sees the same keys: one call for both
            else:
                seen.append([q_lo, q_hi, k_lo, k_hi])
        segments += [Segment(batch, slice(q_lo + q_shift, q_hi + q_shift), slice(k_lo + k_shift, k_hi + k_shift),
                             False) for q_lo, q_hi, k_lo, k_hi in seen]
    return segments


def _documents_overlapping(offsets: Sequence[int], start: int, end: int) -> list[tuple[int, tuple[int, int]]]:
    """(index, (doc_start, doc_end)) of the documents that intersect [start, end)."""
    first = bisect_right(offsets, start) - 1
    docs = []
    for i in range(max(first, 0), len(offsets) - 1):
        if offsets[i] >= end:
            break
        docs.append((i, (offsets[i], offsets[i + 1])))
    return docs


@dataclass(frozen=True)
class Rows:
    """The rows of a shard that a rank's kernel calls touch: merged, ascending spans [start, end) of
    local rows, out of `total`. Only these rows of a visitor travel (`pack`), packed one span after
    another, and the gradients that come back hold only these rows (`add_into`)."""

    spans: tuple[tuple[int, int], ...]
    total: int

    @staticmethod
    def union(slices: list[slice], total: int) -> Rows:
        spans: list[list[int]] = []
        for start, stop, _ in sorted(s.indices(total) for s in slices):
            if spans and start <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], stop)
            else:
                spans.append([start, stop])
        return Rows(tuple(map(tuple, spans)), total)

    @staticmethod
    def every(total: int) -> Rows:
        return Rows(((0, total),), total)

    @property
    def count(self) -> int:
        return sum(end - start for start, end in self.spans)

    @property
    def complete(self) -> bool:
        return self.spans == ((0, self.total),)

    def local(self, rows: slice) -> slice:
        """`rows` of the shard (inside one span) as rows of the packed tensor."""
        if self.complete:
            return rows
        start, stop, _ = rows.indices(self.total)
        offset = 0
        for span_start, span_end in self.spans:
            if span_start <= start < span_end:
                return slice(offset + start - span_start, offset + stop - span_start)
            offset += span_end - span_start
        raise ValueError(f"rows {start}:{stop} are outside {self.spans}")

    def within(self, outer: Rows) -> Rows:
        """These rows (a subset of `outer`'s) as rows of a tensor packed with `outer`'s rows."""
        return Rows.union([outer.local(slice(start, end)) for start, end in self.spans], outer.count)

    def empty(self, like: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor like `like` with `count` rows along `dim`, its dimensions in like's memory order
        (heads-first stays heads-first), so that both ends of a transfer see the same bytes."""
        if self.complete:
            return torch.empty_like(like, dtype=dtype)
        shape = list(like.shape)
        shape[dim] = self.count
        order = sorted(range(like.dim()), key=lambda i: (-like.stride(i), i))  # outermost first
        buffer = torch.empty([shape[i] for i in order], dtype=dtype, device=like.device)
        return buffer.permute([order.index(i) for i in range(like.dim())])

    def pack(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """These rows of x along `dim`, one span after another (x itself when every row is needed)."""
        if self.complete:
            return x
        packed, offset = self.empty(x, dim, x.dtype), 0
        for start, end in self.spans:
            packed.narrow(dim, offset, end - start).copy_(x.narrow(dim, start, end - start))
            offset += end - start
        return packed

    def add_into(self, accumulator: torch.Tensor, packed: torch.Tensor, dim: int) -> None:
        """accumulator (all rows) += packed (these rows), along `dim`."""
        if self.complete:
            accumulator += packed
            return
        offset = 0
        for start, end in self.spans:
            accumulator.narrow(dim, start, end - start).add_(packed.narrow(dim, offset, end - start))
            offset += end - start


class AttentionPlan:
    """segments(query_owner, kv_owner) for one call, computed once and reused by backward.

    layouts: the layout of each batch row (one shared by all rows without document masking);
    boundaries: each row's document offsets, or None; sees: each row's seen document per document
    (`document_segments`), or None (no document sees another); window: the sliding window (with the
    causal mask), or None; whole_bands: whether the kernel takes the window natively (one band segment per
    visible rectangle: burst.varlen.takes_window), else each band is cut in strips.
    """

    def __init__(self, layouts: list[Layout], causal: bool, boundaries: list[list[int]] | None,
                 sees: list[list[int]] | None = None, window: int | None = None, whole_bands: bool = True):
        self.layouts, self.causal, self.boundaries = layouts, causal, boundaries
        self.sees, self.window, self.whole_bands = sees, window, whole_bands
        self.world_size, self.shard_len = layouts[0].world_size, layouts[0].shard_len
        self._cache: dict[tuple[int, int], list[Segment]] = {}
        self._rows_cache: dict[tuple[int, int, str], Rows | None] = {}

    def __call__(self, query_owner: int, kv_owner: int) -> list[Segment]:
        key = (query_owner, kv_owner)
        if key not in self._cache:
            if self.boundaries is None:
                self._cache[key] = block_segments(self.layouts[0], query_owner, kv_owner, self.causal, self.window,
                                                  self.whole_bands)
            else:
                sees = self.sees if self.sees is not None else [None] * len(self.layouts)
                self._cache[key] = [segment for row, (layout, offsets, seen) in
                                    enumerate(zip(self.layouts, self.boundaries, sees, strict=True))
                                    for segment in document_segments(layout, query_owner, kv_owner, self.causal,
                                                                     offsets, row, seen, self.window,
                                                                     self.whole_bands)]
        return self._cache[key]

    def has_work(self, query_owner: int, kv_owner: int) -> bool:
        """Whether any query of `query_owner`'s shard sees any key of `kv_owner`'s."""
        return bool(self(query_owner, kv_owner))

    def key_rows(self, query_owner: int, kv_owner: int) -> Rows | None:
        """The rows of `kv_owner`'s keys that `query_owner`'s queries see (None: none), every batch row's."""
        return self._rows(query_owner, kv_owner, "kv_rows")

    def query_rows(self, query_owner: int, kv_owner: int) -> Rows | None:
        """The rows of `query_owner`'s queries that see any of `kv_owner`'s keys (None: none)."""
        return self._rows(query_owner, kv_owner, "q_rows")

    def _rows(self, query_owner: int, kv_owner: int, side: str) -> Rows | None:
        key = (query_owner, kv_owner, side)
        if key not in self._rows_cache:
            segments = self(query_owner, kv_owner)
            self._rows_cache[key] = Rows.union([getattr(s, side) for s in segments], self.shard_len) \
                if segments else None
        return self._rows_cache[key]


def check_window(window, causal: bool) -> None:
    """Refuse a sliding window that is not a positive int, or one without the causal mask; None passes."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive number of positions (a query at i sees keys i - window < j <= i) "
                         f"or None, got {window!r}")
    if not causal:
        raise ValueError("a sliding window is a causal mask's (a query sees the keys up to `window` positions back): "
                         "pass causal=True, or window=None")


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
                             f"got {offsets[:8]}{' ...' if len(offsets) > 8 else ''}{_first_wrong(offsets, seq_len)}")
        result.append(offsets)
    return result


def _first_wrong(offsets: list[int], seq_len: int) -> str:
    """Which offset of a row that does not rise from 0 to `seq_len` is wrong, and how to mend it."""
    if len(offsets) < 2:
        return f": give at least [0, {seq_len}] (one document)"
    for i, offset in enumerate(offsets):
        if not 0 <= offset <= seq_len:
            return (f": offset {offset} at index {i} lies outside the sequence; every offset is a token position "
                    f"0..{seq_len} (a document's start; the last is the sequence's end)")
    if offsets[0] != 0:
        return f": the first offset is {offsets[0]}; the first document starts at 0"
    if offsets[-1] != seq_len:
        return f": the last offset is {offsets[-1]}; the last document ends at the sequence's end, {seq_len}"
    i = next(i for i in range(1, len(offsets)) if offsets[i] <= offsets[i - 1])
    return f": offset {offsets[i]} at index {i} does not come after {offsets[i - 1]}; drop empty documents, sort them"


def sees_by_row(doc_sees, documents: list[int] | None) -> list:
    """doc_sees' rows, checked against each row's document count (`documents`, None: no doc_boundaries)
    by their shapes alone (no values read: a compiled graph keeps it); ValueError otherwise.

    doc_sees: per batch row a 1-D integer tensor or sequence [n_docs] (a 2-D tensor [batch, n_docs]
    where every row has as many documents): doc_sees[row][i] = j, 0 <= j < i, lets document i's
    queries also see all of document j; -1: only their own document.
    """
    if documents is None:
        raise ValueError("doc_sees names documents by their index in doc_boundaries: pass doc_boundaries too")
    rows = list(doc_sees.unbind(0)) if isinstance(doc_sees, torch.Tensor) and doc_sees.dim() == 2 else list(doc_sees)
    if len(rows) != len(documents):
        raise ValueError(f"doc_sees has {len(rows)} rows but doc_boundaries has {len(documents)}; give one 1-D "
                         "tensor per batch row, with one entry per document")
    for b, (row, count) in enumerate(zip(rows, documents, strict=True)):
        if isinstance(row, torch.Tensor) and (row.dim() != 1 or row.is_floating_point()):
            raise ValueError(f"doc_sees row {b} must be a 1-D integer tensor, got {row.dtype} of shape "
                             f"{tuple(row.shape)}")
        if len(row) != count:
            raise ValueError(f"doc_sees row {b} has {len(row)} entries but doc_boundaries row {b} has "
                             f"{count} documents; give one entry per document (-1: sees only itself)")
    return rows


def normalize_sees(doc_sees, boundaries: list[list[int]] | None) -> list[list[int]] | None:
    """Check `doc_sees` (see `sees_by_row`) against the rows' document offsets (already checked) and return
    it as lists of ints, one per batch row; None when no document sees another (every value -1), which is
    plain document masking. Raises ValueError."""
    if doc_sees is None:
        return None
    rows = sees_by_row(doc_sees, None if boundaries is None else [len(offsets) - 1 for offsets in boundaries])
    result = []
    for b, row in enumerate(rows):
        sees = row.tolist() if isinstance(row, torch.Tensor) else [int(x) for x in row]
        bad = [(i, j) for i, j in enumerate(sees) if not -1 <= j < i]
        if bad:
            i, j = bad[0]
            raise ValueError(f"doc_sees row {b}: document {i} sees {j}, but a document may only see an earlier one "
                             f"(0 <= j < {i}) or none (-1)")
        result.append(sees)
    return result if any(j >= 0 for sees in result for j in sees) else None
