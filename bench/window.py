"""`burst bench attention --window W`: what a sliding window saves each rank, counted from the plans.

For every rank of a zigzag layout (no documents) the windowed plan (burst/plan.py, for a kernel taking the
window natively, as the CPU kernel and flash-attn's do) and the full causal one are counted without running a
kernel: the kernel calls of the rank's queries (one per segment: the calls the ring makes of a kernel without
a varlen path, tests/test_window.py counts them), the (query, key) pairs those calls compute (a causal square by
half, a band block as the CPU kernel computes it: each strip of its query rows against every key the strip
sees, burst/kernels/cpu.py's `band_strips`), and the bytes the rank sends in forward and in backward
(burst/cost.py's count of the plan, which the ring's own byte counter matches, tests/test_window.py), and the
kernel work in tiles of TILE x TILE (a causal square's diagonal tiles on, a band block's tiles holding a pair it
sees, as flash-attn's window skips the others). Each is set against the band's own: the pairs the window
lets the rank's queries see, and the rows that must cross between ranks for them, worked out from the
positions each rank holds, not from the plan: in forward, each key row that some query of another rank
sees, once per such rank; in backward, the rows the backward mode sends (the query side in "burst", the
key side in "ring") once per rank that works on them, and their gradients back. The band's own kernel calls
are the fewest any plan of the layout can make: one per pair of stretches of consecutive positions (one of the
rank's queries, one of any rank's keys) holding a visible pair, what a kernel taking the window natively
(flash-attn's window_size) computes in one call; its own tiles are the TILE x TILE tiles of the global
(query, key) square, aligned to the positions, that hold a visible pair.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from bench.attention import AttentionBenchConfig
from bench.documents import MIB, _meta
from burst.balance import DEFAULT_OPTIONS, tile_count
from burst.cost import choose_backward, packet_bytes, plan_bytes
from burst.kernels.cpu import band_strips
from burst.layout import zigzag_layout
from burst.plan import AttentionPlan

TILE = DEFAULT_OPTIONS.tile  # the kernels' tile (128: the GPU flash kernels' block) the work is counted in


@dataclass
class RankCount:
    """One rank's kernel calls, computed pairs and bytes sent under one plan (window None: full causal)."""

    rank: int
    window: int | None
    steps: int  # key/value shards (the rank's own included) its queries make a kernel call on: its ring steps with work
    calls: int
    tiles: int  # TILE x TILE tiles the rank's kernel calls compute, over the batch rows and one head
    computed_pairs: int  # (query, key) pairs the rank's kernel calls compute, over the batch rows and one head
    sent_forward_mib: float
    sent_backward_mib: float


@dataclass
class BandOwn:
    """What the window itself asks of one rank: the pairs its queries see, the bytes that must travel."""

    rank: int
    steps: int  # key/value shards (its own included) holding a key that one of the rank's queries sees
    calls: int  # the fewest kernel calls (module docstring); a call takes every batch row
    tiles: int  # TILE x TILE tiles holding a visible pair, over the batch rows
    visible_pairs: int
    sent_forward_mib: float
    sent_backward_mib: float


def count_plan(plan: AttentionPlan, config: AttentionBenchConfig, mode: str) -> list[RankCount]:
    """Each rank's calls, computed pairs and bytes under `plan`."""
    q, k = _meta(config)
    counts = []
    for rank in range(plan.world_size):
        segments = [s for owner in range(plan.world_size) for s in plan(rank, owner)]
        pairs = tiles = 0
        for s in segments:
            rows, cols = (len(range(plan.shard_len)[x]) for x in (s.q_rows, s.kv_rows))
            pairs += computed_pairs(rows, cols, s.causal, s.band)
            tiles += tile_count(rows, cols, s.causal, TILE, s.band)
        forward, _, backward, _ = plan_bytes(plan, "flat", q, k, mode, plan.world_size, rank)
        steps = sum(bool(plan(rank, owner)) for owner in range(plan.world_size))
        counts.append(RankCount(rank, plan.window, steps, len(segments), tiles * config.batch, pairs * config.batch,
                                forward / MIB, backward / MIB))
    return counts


def computed_pairs(rows: int, cols: int, causal: bool, band: tuple[int, int] | None) -> int:
    """The (query, key) pairs the CPU kernel computes in one call on a rows x cols block: a causal square by half,
    a band strip by strip (`band_strips`), each strip's rows against all the keys it sees."""
    if band is not None:
        return sum(len(range(rows)[r]) * len(range(cols)[c]) for r, c, _ in band_strips(rows, cols, band))
    return rows * (rows + 1) // 2 if causal else rows * cols


def band_own(config: AttentionBenchConfig, window: int, mode: str) -> list[BandOwn]:
    """Each rank's share of the band itself (see the module docstring), from the positions of the zigzag layout."""
    layout = zigzag_layout(config.seq_len, config.nproc)
    owner = np.empty(config.seq_len, dtype=np.int64)  # [seq]: the rank holding each position
    for rank in range(config.nproc):
        owner[layout.positions(rank).numpy()] = rank
    q, k = _meta(config)
    mode = choose_backward(q, k, mode)
    kv_row = 2 * k[0, 0].numel() * k.element_size()  # k and v of one row
    visitor, gradient = (n // q.shape[1] // config.batch for n in packet_bytes(q, k, mode))  # per row
    positions = np.arange(config.seq_len)

    def holds(rank: int) -> np.ndarray:
        """[seq + 1]: how many positions before each one `rank` holds (a prefix sum)."""
        return np.concatenate([[0], np.cumsum(owner == rank)])

    prefix = [holds(rank) for rank in range(config.nproc)]
    counts = []
    for rank in range(config.nproc):
        mine = positions[owner == rank]
        keys_seen = queries_seeing = 0
        steps = 1  # its own shard: a query's nearest key is itself
        for other in range(config.nproc):
            if other == rank:
                continue
            # a key of mine at p is seen by `other` if it holds a query in [p, p + window - 1]
            end = np.minimum(mine + window, config.seq_len)
            keys_seen += int(np.count_nonzero(prefix[other][end] - prefix[other][mine]))
            # a query of mine at i sees `other`'s keys if it holds one in [i - window + 1, i]
            start = np.maximum(mine - window + 1, 0)
            seeing = int(np.count_nonzero(prefix[other][mine + 1] - prefix[other][start]))
            queries_seeing += seeing
            steps += seeing > 0
        rows_backward = queries_seeing if mode == "burst" else keys_seen
        visible = int(np.minimum(mine + 1, window).sum())
        calls = sum(sees(queries, keys, window) for queries in layout.runs(rank)
                    for other in range(config.nproc) for keys in layout.runs(other))
        tiles = sum(sees(range(i, min(i + TILE, config.seq_len)), range(j, min(j + TILE, config.seq_len)), window)
                    for i in mine[::TILE].tolist() for j in range(0, config.seq_len, TILE))
        counts.append(BandOwn(rank, steps, calls, tiles * config.batch, visible * config.batch,
                              keys_seen * kv_row * config.batch / MIB,
                              rows_backward * (visitor + gradient) * config.batch / MIB))
    return counts


def sees(queries, keys, window: int) -> bool:
    """Whether a query of the stretch `queries` sees a key of the stretch `keys` (i - window < j <= i); each a
    range, or a layout's Run."""
    (q0, q1), (k0, k1) = (_bounds(x) for x in (queries, keys))  # first and last position
    return k0 <= q1 and k1 > q0 - window


def _bounds(stretch) -> tuple[int, int]:
    return (stretch.start, stretch.stop - 1) if isinstance(stretch, range) else \
        (stretch.start, stretch.start + stretch.length - 1)


def window_counts(config: AttentionBenchConfig, window: int) -> dict[str, list]:
    """The windowed plan's counts, the full causal plan's and the band's own, per rank, for the first mode."""
    mode = config.modes[0]
    layouts = [zigzag_layout(config.seq_len, config.nproc)] * config.batch
    return {"window": count_plan(AttentionPlan(layouts, True, None, window=window), config, mode),
            "causal": count_plan(AttentionPlan(layouts, True, None), config, mode),
            "band": band_own(config, window, mode)}


def print_window_counts(config: AttentionBenchConfig, window: int, counts: dict[str, list]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    mode = config.modes[0]
    title = (f"window {window:,}: {config.seq_len:,} tokens on {config.nproc} ranks (zigzag), {config.heads}/"
             f"{config.kv_heads} heads x {config.head_dim}, {config.dtype}, backward {mode}, counted from the plans")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), show_edge=False)
    for column in ("rank", "per rank", "window", "band", "window / band", "causal", "causal / window"):
        table.add_column(column, justify="left" if column == "per rank" else "right")

    def ratio(got: float, own: float) -> str:
        return f"{got / own:.2f}x" if own else "-"

    for win, causal, band in zip(counts["window"], counts["causal"], counts["band"], strict=True):
        for what, got, own, full, shown in (
                ("steps with work", win.steps, band.steps, causal.steps, str),
                ("kernel calls", win.calls, band.calls, causal.calls, str),
                (f"tiles {TILE}x{TILE}", win.tiles, band.tiles, causal.tiles, str),
                ("pairs computed (M)", win.computed_pairs, band.visible_pairs, causal.computed_pairs,
                 lambda x: f"{x / 1e6:.2f}"),
                ("sent forward (MiB)", win.sent_forward_mib, band.sent_forward_mib, causal.sent_forward_mib,
                 lambda x: f"{x:.2f}"),
                ("sent backward (MiB)", win.sent_backward_mib, band.sent_backward_mib, causal.sent_backward_mib,
                 lambda x: f"{x:.2f}")):
            table.add_row(str(win.rank) if what.startswith("steps") else "", what, shown(got),
                          "-" if own is None else shown(own), "-" if own is None else ratio(got, own), shown(full),
                          ratio(full, got))
    Console().print(table)
    Console().print("band: what the window itself asks of the rank: the shards holding keys its queries see, the "
                    "(query, key) pairs it lets them see (per head), and the rows that must cross between ranks for "
                    "them; steps with work: the ring steps, the shards the rank's kernel calls use (the others cost "
                    "no call and no bytes); band kernel calls: the fewest any plan can make (one per stretch of the "
                    "rank's queries and stretch of keys that meet, a kernel taking the window natively); tiles: "
                    f"the {TILE}x{TILE} tiles computed, or holding a visible pair; pairs computed: by its kernel "
                    "calls (a causal square by half, a band strip by strip as the CPU kernel computes it)", style="dim")


def write_window_json(path: str, config: AttentionBenchConfig, window: int, counts: dict[str, list]) -> None:
    with open(path, "w") as f:
        json.dump({"config": asdict(config), "window": window,
                   "ranks": {name: [asdict(c) for c in rows] for name, rows in counts.items()}}, f, indent=1)
