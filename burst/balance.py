"""The balanced layout: per packed sequence, which equal chunks each rank holds so that every rank
does the same attention work in forward and in backward.

Work is counted as the fused kernels do it, in tiles of `tile` x `tile` (query rows x key rows): a
kernel call on an r x c rectangle computes ceil(r / tile) x ceil(c / tile) tiles, one on a causal
square of n rows the ceil(n / tile) (ceil(n / tile) + 1) / 2 tiles on and below its diagonal, and
masked pairs outside the calls cost nothing (burst/plan.py). With packed documents the work of a
query chunk is the sum over its documents of the keys before it in the same document; the work
against a key chunk (where the backward of "burst" computes it) the queries after it. Both must
balance: the forward's ring steps wait for the rank with the most query work, the backward's for
the one with the most key work. A document that sees an earlier one whole (prefix sharing, `sees`)
adds the full rectangles of its queries against that document's keys to both counts.

The layout cuts the sequence into K chunks per rank and assigns them (`assign_chunks`): the chunks
in decreasing order of work, each to the rank it leaves least loaded (longest-processing-time
first, on the larger of its forward and backward shares; of the ranks that stay as lightly loaded,
the one holding most of the chunk's documents, so that fewer rows travel), then swaps of a chunk
between the most loaded rank and another while one lowers it (vectorised over the chunk pairs).
More chunks balance better but
cut documents into more kernel calls and smaller tiles, so a cost model (`choose_chunks`) weighs
the candidates, K = 2, 4, 8, 16 with chunks of at least `min_chunk_tiles` tiles, and zigzag itself:
the slowest rank's forward work plus BACKWARD_WEIGHT x the slowest rank's backward work (on the key
side or the query side, as the backward mode has it: the larger), in tiles, each kernel call
counted as `call_tiles` more. It is never worse than zigzag in that model, and replaces it (or a
candidate with fewer chunks) only for a gain of more than `min_gain`. The shards have a fixed
size, so every rank holds K chunks; a long document cut into K x W chunks of nearly equal work then
balances to about one chunk in K, which is why K goes up to 16.

With sliding windows (`windows`: the window of each layer of the model, None for a causal one; every layer
runs on the same layout) a query sees at most W keys back: its work is min(its offset in its document + 1,
W), nearly flat along a long document where causal work grows. The windowed layers' work is counted per
position (`windowed_work`: the band's pairs in tiles' area, and a call per key chunk the band reaches, as a
kernel taking the window natively is called) and
added to the causal layers', layer by layer, so the layout balances what the model as a whole runs.

The layout is chosen for causal attention, what a language model runs (attention without a causal
mask runs on it as correctly, if less evenly). Everything here is a pure function of (boundaries,
seq_len, world_size, options): each rank and the data loader compute the same layout with no
communication (`burst.layout.balanced_layout` wraps it, memoised).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

Chunks = tuple[tuple[int, ...], ...]  # per rank, the global indices of the chunks it holds, ascending

# A tile's backward costs about 2.5 of its forward: five matrix products against two.
BACKWARD_WEIGHT = 2.5


@dataclass(frozen=True)
class BalanceOptions:
    tile: int = 128  # the kernels' tile (query rows = key rows); GPU flash kernels use 128 x 128
    min_chunk_tiles: int = 4  # no chunk shorter than this many tiles (512 tokens): smaller ones waste tiles
    max_chunks_per_rank: int = 16
    call_tiles: float = 1.0  # a kernel call's fixed cost (launch, merge), in tiles of work
    # A layout replaces zigzag, or one with fewer chunks, only when it lowers the modelled step time by
    # more than this share: a sequence zigzag balances keeps zigzag's calls, and so its time.
    min_gain: float = 0.03


DEFAULT_OPTIONS = BalanceOptions()
# The options every balanced layout is chosen with (burst.layout.row_layouts): the data loader's and the
# attention's must be the same. Tests lower the tile to reach several chunks per rank on short sequences.
OPTIONS = DEFAULT_OPTIONS


def tile_count(rows: int, cols: int, causal: bool, tile: int, band: tuple[int, int] | None = None) -> int:
    """Tiles a kernel call computes on a rows x cols rectangle (a causal call: a square, diagonal tiles on; a band
    (lo, hi), where row r sees column c iff lo <= r - c <= hi: the tiles holding a pair it sees, what a kernel
    taking the window natively computes)."""
    r = -(-rows // tile)
    if band is None:
        return r * (r + 1) // 2 if causal else r * -(-cols // tile)
    lo, hi = band
    tiles = 0
    for first in range(0, rows, tile):  # the columns a tile's rows see are one stretch: every tile on it counts
        start, end = max(0, first - hi), min(cols - 1, min(rows, first + tile) - 1 - lo)
        tiles += end // tile - start // tile + 1 if start <= end else 0
    return tiles


@dataclass(frozen=True)
class ChunkWork:
    """Per chunk: tiles and kernel calls of its queries (forward) and against its keys (backward)."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]
    forward_calls: tuple[int, ...]
    backward_calls: tuple[int, ...]

    def costs(self, call_tiles: float) -> tuple[list[float], list[float]]:
        return ([t + call_tiles * c for t, c in zip(self.forward, self.forward_calls, strict=True)],
                [t + call_tiles * c for t, c in zip(self.backward, self.backward_calls, strict=True)])


def _pieces(start: int, end: int, size: int, tile: int) -> tuple[int, list[int]]:
    """(first chunk, tiles along each piece) of the document [start, end) cut into chunks of `size`."""
    first = start // size
    return first, [-(-(min(end, (c + 1) * size) - max(start, c * size)) // tile)
                   for c in range(first, (end - 1) // size + 1)]


def chunk_work(boundaries: Sequence[int], seq_len: int, chunks: int, tile: int,
               sees: Sequence[int] | None = None) -> ChunkWork:
    """The causal work of each of `chunks` equal chunks of a sequence with documents at `boundaries`,
    each document also seeing document sees[i] whole where that is not -1 (None: none).

    A document's piece in chunk i meets its piece in chunk j <= i in one kernel call (a causal square
    when j = i), whichever ranks hold the two chunks, and each piece of the document it sees in a full
    rectangle. O(chunks spanned) per document, and per pair of pieces of a document and the one it sees.
    """
    size = seq_len // chunks
    forward, backward = [0] * chunks, [0] * chunks
    forward_calls, backward_calls = [0] * chunks, [0] * chunks
    for doc, (start, end) in enumerate(pairwise(boundaries)):
        first, pieces = _pieces(start, end, size, tile)
        if sees is not None and sees[doc] >= 0:
            seen_first, seen = _pieces(boundaries[sees[doc]], boundaries[sees[doc] + 1], size, tile)
            for k, t in enumerate(pieces):  # queries of piece k see every piece of the seen document
                forward[first + k] += t * sum(seen)
                forward_calls[first + k] += len(seen)
            for k, t in enumerate(seen):  # keys of a seen piece are seen by every piece of the document
                backward[seen_first + k] += t * sum(pieces)
                backward_calls[seen_first + k] += len(pieces)
        before = 0
        for k, t in enumerate(pieces):  # queries of piece k see every earlier piece, and themselves causally
            forward[first + k] += t * before + t * (t + 1) // 2
            forward_calls[first + k] += k + 1
            before += t
        after = 0
        for k in reversed(range(len(pieces))):  # keys of piece k are seen by every later piece
            t = pieces[k]
            backward[first + k] += t * after + t * (t + 1) // 2
            backward_calls[first + k] += len(pieces) - k
            after += t
    return ChunkWork(tuple(forward), tuple(backward), tuple(forward_calls), tuple(backward_calls))


def windowed_work(boundaries: Sequence[int], seq_len: int, chunks: int, tile: int, window: int,
                  sees: Sequence[int] | None = None) -> ChunkWork:
    """`chunk_work` of a layer with a sliding window: a query at offset o of its document sees min(o + 1,
    window) keys of it (and of a document it sees, those a run of the two alone puts in its window),
    counted per position in units of a tile's area; calls: per piece of a document in a chunk, one per key
    chunk its band reaches (burst/plan.py's band segments, for a kernel that takes the window natively)."""
    size, offsets = seq_len // chunks, np.asarray(boundaries)
    position = np.arange(seq_len)
    doc = np.searchsorted(offsets, position, side="right") - 1
    start, end = offsets[doc], offsets[doc + 1]
    seen_keys = np.minimum(position - start + 1, window).astype(float)  # [seq]: keys each query sees
    seeing_queries = np.minimum(end - position, window).astype(float)  # [seq]: queries that see each key
    forward_calls, backward_calls = [0] * chunks, [0] * chunks
    for d, (s, e) in enumerate(pairwise(boundaries)):
        for c in range(s // size, (e - 1) // size + 1):  # the document's piece in chunk c and the chunks it reaches
            a = max(s, c * size)
            first = max(s, a - window + 1) // size
            forward_calls[c] += c - first + 1
            for kc in range(first, c + 1):
                backward_calls[kc] += 1
        if sees is None or sees[d] < 0:
            continue
        seen_start, seen_end = offsets[sees[d]], offsets[sees[d] + 1]
        mine = position[s:e]
        virtual = mine - s + seen_end  # where the document's queries stand after the one they see
        seen_keys[s:e] += np.clip(seen_end - np.maximum(seen_start, virtual - window + 1), 0, None)
        keys = position[seen_start:seen_end]
        seeing_queries[seen_start:seen_end] += np.clip(np.minimum(e, keys + window - seen_end + s) - s, 0, e - s)
        reach = range(max(seen_start, seen_end - window + 1) // size, (seen_end - 1) // size + 1)
        for c in range(s // size, min(e - 1, s + window - 1) // size + 1):
            forward_calls[c] += len(reach)
            for kc in reach:
                backward_calls[kc] += 1
    area = float(tile * tile)
    return ChunkWork(tuple((seen_keys.reshape(chunks, size).sum(1) / area).tolist()),
                     tuple((seeing_queries.reshape(chunks, size).sum(1) / area).tolist()),
                     tuple(forward_calls), tuple(backward_calls))


def model_work(boundaries: Sequence[int], seq_len: int, chunks: int, tile: int, sees: Sequence[int] | None = None,
               windows: tuple[int | None, ...] | None = None) -> ChunkWork:
    """The work of every layer of a model with these `windows` (None: one causal layer, `chunk_work`)."""
    if windows is None:
        return chunk_work(boundaries, seq_len, chunks, tile, sees)
    total = None
    for window in sorted(set(windows), key=lambda w: -1 if w is None else w):
        layer = chunk_work(boundaries, seq_len, chunks, tile, sees) if window is None else \
            windowed_work(boundaries, seq_len, chunks, tile, window, sees)
        layers = windows.count(window)
        parts = [tuple(layers * x for x in part) for part in
                 (layer.forward, layer.backward, layer.forward_calls, layer.backward_calls)]
        total = ChunkWork(*parts) if total is None else ChunkWork(
            *(tuple(x + y for x, y in zip(old, new, strict=True)) for old, new in
              zip((total.forward, total.backward, total.forward_calls, total.backward_calls), parts, strict=True)))
    return total


def chunk_links(boundaries: Sequence[int], seq_len: int, chunks: int,
                sees: Sequence[int] | None = None) -> np.ndarray:
    """[chunks, chunks]: rows of chunk j that share a document with chunk i (i != j), or that hold a
    document seen by one in chunk i or seeing one there: what would travel between the two if different
    ranks held them."""
    size = seq_len // chunks
    links = np.zeros((chunks, chunks))

    def rows_by_chunk(start: int, end: int) -> np.ndarray:
        """[chunks]: rows of [start, end) in each chunk."""
        return np.array([max(0, min(end, (c + 1) * size) - max(start, c * size)) for c in range(chunks)], float)

    for doc, (start, end) in enumerate(pairwise(boundaries)):
        if sees is not None and sees[doc] >= 0:
            mine, seen = rows_by_chunk(start, end), rows_by_chunk(boundaries[sees[doc]], boundaries[sees[doc] + 1])
            cross = (mine > 0)[:, None] * seen[None, :] + (seen > 0)[:, None] * mine[None, :]
            np.fill_diagonal(cross, 0)
            links += cross
        first, last = start // size, (end - 1) // size
        if first == last:
            continue
        span = range(first, last + 1)
        rows = np.array([min(end, (c + 1) * size) - max(start, c * size) for c in span], float)
        links[first:last + 1, first:last + 1] += rows[None, :]
        links[span, span] -= rows
    return links


def assign_chunks(forward: Sequence[float], backward: Sequence[float], world_size: int, links: np.ndarray) -> Chunks:
    """Chunks per rank (ascending), as many to each, balancing both costs (see the module docstring).
    Among the ranks a chunk leaves no more loaded than the least loaded choice (or the mean), it goes
    to the one holding most of its `links` (chunk_links): fewer rows travel."""
    n, per_rank = len(forward), len(forward) // world_size
    mean_f, mean_b = sum(forward) / world_size or 1.0, sum(backward) / world_size or 1.0
    f, b = [x / mean_f for x in forward], [x / mean_b for x in backward]  # in units of the mean rank's load
    load_f, load_b = [0.0] * world_size, [0.0] * world_size
    held: list[list[int]] = [[] for _ in range(world_size)]
    shared = np.zeros((n, world_size))  # [chunk, rank]: rows it shares with the chunks the rank holds
    for c in sorted(range(n), key=lambda c: (-max(f[c], b[c]), c)):
        open_ranks = [r for r in range(world_size) if len(held[r]) < per_rank]
        after = {r: max(load_f[r] + f[c], load_b[r] + b[c]) for r in open_ranks}
        bound = max(min(after.values()), 1.0)
        r = min((r for r in open_ranks if after[r] <= bound),
                key=lambda r: (-shared[c, r], after[r], load_f[r] + load_b[r], r))
        held[r].append(c)
        load_f[r] += f[c]
        load_b[r] += b[c]
        shared[:, r] += links[:, c]
    f, b, load_f, load_b = np.array(f), np.array(b), np.array(load_f), np.array(load_b)
    for _ in range(4 * len(f)):  # each swap lowers the most loaded rank; a bound, not a budget
        worst = max(range(world_size), key=lambda r: (max(load_f[r], load_b[r]), -r))
        others = sorted((r for r in range(world_size) if r != worst), key=lambda r: (max(load_f[r], load_b[r]), r))
        if not any(_swap_best(f, b, held, load_f, load_b, worst, other) for other in others):
            break
    return tuple(tuple(sorted(h)) for h in held)


def _swap_best(f: np.ndarray, b: np.ndarray, held: list[list[int]], load_f: np.ndarray, load_b: np.ndarray,
               first: int, second: int) -> bool:
    """Swap the chunk pair between two ranks that most lowers the larger of their loads (ties: the one
    that leaves their four loads closest to the mean), if one lowers it; in place."""
    x, y = np.array(held[first]), np.array(held[second])
    df = f[y][None, :] - f[x][:, None]  # [chunk of first, chunk of second]: first's forward load change
    db = b[y][None, :] - b[x][:, None]
    loads = (load_f[first] + df, load_b[first] + db, load_f[second] - df, load_b[second] - db)
    peak = np.maximum(np.maximum(loads[0], loads[1]), np.maximum(loads[2], loads[3]))
    if peak.min() >= max(load_f[first], load_b[first], load_f[second], load_b[second]) - 1e-12:
        return False
    spread = sum((load - 1) ** 2 for load in loads)
    i, j = np.unravel_index(np.lexsort((spread.ravel(), peak.ravel()))[0], peak.shape)
    held[first][i], held[second][j] = int(y[j]), int(x[i])
    load_f[first] += df[i, j]
    load_b[first] += db[i, j]
    load_f[second] -= df[i, j]
    load_b[second] -= db[i, j]
    return True


def layout_cost(chunks: Chunks, work: ChunkWork, call_tiles: float) -> float:
    """Modelled step time, in tiles: the slowest rank's forward + BACKWARD_WEIGHT x the slowest rank's
    backward, which is query-side work ("ring") or key-side work ("burst"): the larger of the two."""
    forward, backward = work.costs(call_tiles)
    slowest_forward = max(sum(forward[c] for c in held) for held in chunks)
    slowest_backward = max(sum(backward[c] for c in held) for held in chunks)
    return slowest_forward + BACKWARD_WEIGHT * max(slowest_forward, slowest_backward)


def chunks_per_rank_candidates(seq_len: int, world_size: int, options: BalanceOptions) -> list[int]:
    """K = 2, 4, 8, ... up to max_chunks_per_rank, whose chunks divide the sequence and are long enough."""
    candidates, k = [], 2
    while k <= options.max_chunks_per_rank:
        if seq_len % (k * world_size) == 0 and (k == 2 or seq_len // (k * world_size) >=
                                                 options.min_chunk_tiles * options.tile):
            candidates.append(k)
        k *= 2
    return candidates


def choose_chunks(boundaries: Sequence[int], seq_len: int, world_size: int, zigzag: Chunks,
                  options: BalanceOptions = DEFAULT_OPTIONS, sees: Sequence[int] | None = None,
                  windows: tuple[int | None, ...] | None = None) -> tuple[int, Chunks]:
    """(chunk length, chunks per rank): the cheapest of `zigzag` (2 chunks per rank) and the balanced
    assignments of K chunks per rank (see the module docstring), for documents at `boundaries` that see
    `sees` (None: none), in a model whose layers have these sliding `windows` (None: all causal). seq_len
    splits into 2 x world_size."""
    best, best_cost = (seq_len // (2 * world_size), zigzag), None
    for k in chunks_per_rank_candidates(seq_len, world_size, options) if world_size > 1 else []:
        work = model_work(boundaries, seq_len, k * world_size, options.tile, sees, windows)
        forward, backward = work.costs(options.call_tiles)
        candidates = [zigzag] if best_cost is None else []  # k = 2 comes first: zigzag is costed on its chunks
        links = chunk_links(boundaries, seq_len, k * world_size, sees)
        candidates.append(assign_chunks(forward, backward, world_size, links))
        if sees is not None:  # the greedy is a heuristic: the documents' own assignment is sometimes the better
            own = model_work(boundaries, seq_len, k * world_size, options.tile, None, windows)
            candidates.append(assign_chunks(*own.costs(options.call_tiles), world_size,
                                            chunk_links(boundaries, seq_len, k * world_size)))
        for chunks in candidates:
            cost = layout_cost(chunks, work, options.call_tiles)
            if best_cost is None or cost < best_cost * (1 - options.min_gain):
                best, best_cost = (seq_len // (k * world_size), chunks), cost
    return best


@dataclass(frozen=True)
class PlanWork:
    """What a plan's kernel calls compute, per rank, in tiles (see the module docstring)."""

    forward: tuple[int, ...]  # tiles of each rank's queries: its forward (and "ring" backward) work
    backward: tuple[int, ...]  # tiles against each rank's keys: its "burst" backward work
    calls: tuple[int, ...]  # kernel calls of each rank's queries
    visible_pairs: int  # (query, key) pairs the mask leaves visible, all computed
    idle_pairs: int  # (query rank, key rank) pairs of different ranks with no kernel call

    @property
    def masked_share(self) -> float:
        """The share of the computed tiles' area that is masked (diagonals, tiles cut by document ends)."""
        return 1 - self.visible_pairs / (sum(self.forward) * self._tile_area)

    _tile_area: int = 128 * 128


def band_pairs(rows: int, cols: int, causal: bool, band: tuple[int, int] | None) -> int:
    """The pairs a kernel call on a rows x cols rectangle sees: all, a causal square's, or its band's
    (row r sees column c iff lo <= r - c <= hi, burst/plan.py)."""
    if band is None:
        return rows * (rows + 1) // 2 if causal else rows * cols
    lo, hi = band
    return sum(max(0, min(cols - 1, r - lo) - max(0, r - hi) + 1) for r in range(rows))


def plan_work(plan, tile: int = 128) -> PlanWork:
    """Count the tiles, calls and visible pairs of every kernel call `plan` (burst.plan.AttentionPlan) makes."""
    world, rows = plan.world_size, len(plan.layouts)
    forward, backward, calls = [0] * world, [0] * world, [0] * world
    visible = idle = 0
    for q in range(world):
        for kv in range(world):
            segments = plan(q, kv)
            idle += q != kv and not segments
            for seg in segments:
                batch = len(range(rows)[seg.batch])
                n_q, n_k = len(range(plan.shard_len)[seg.q_rows]), len(range(plan.shard_len)[seg.kv_rows])
                tiles = batch * tile_count(n_q, n_k, seg.causal, tile, seg.band)
                forward[q] += tiles
                backward[kv] += tiles
                calls[q] += 1
                visible += batch * band_pairs(n_q, n_k, seg.causal, seg.band)
    return PlanWork(tuple(forward), tuple(backward), tuple(calls), visible, idle, tile * tile)
