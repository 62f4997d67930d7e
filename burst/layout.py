"""How a sequence is laid out over the ranks: which chunks of it each rank holds.

A `Layout` cuts a sequence of S tokens into n equal chunks and gives each of the W ranks n / W of
them; a rank's shard is its chunks in ascending order, concatenated. Attention, the model's position
ids and the data loader all follow the same layout. Two are made here:

  "zigzag"    2W chunks; rank r holds chunks r and 2W-1-r. Under a causal mask over the whole
              sequence every rank does the same work at every ring step (../shared/docs/burstattention.md).
  "balanced"  chosen per sequence from its document boundaries (burst/balance.py). With packed
              documents a token's work is its offset inside its document, not its position in the
              sequence, and zigzag no longer balances the ranks.

Both are pure functions of (document boundaries, sequence length, world size), so every rank and
the data loader compute the same layout with no communication. The document boundaries stay over
the global sequence in its original order whatever the layout. With the balanced layout every batch
row has its own (the sharding functions take the batch rows' dimension, `batch_dim`).

Functions that take `rank`/`world_size` are pure and need no process group (the data loader cuts
shards before any communication); the `group` variants ask the process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
import torch.distributed as dist

from burst import balance
from burst.groups import group_rank_and_size

LAYOUTS = ("zigzag", "balanced")


@dataclass(frozen=True)
class Run:
    """A stretch of consecutive chunks a rank holds: global positions [start, start + length) at
    positions [local, local + length) of the rank's shard."""

    start: int
    local: int
    length: int


@dataclass(frozen=True)
class Layout:
    """chunks[r]: the global chunk indices rank r holds, ascending; every chunk is `chunk` tokens."""

    chunk: int
    chunks: tuple[tuple[int, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.chunks)

    @property
    def shard_len(self) -> int:
        return self.chunk * len(self.chunks[0])

    @property
    def seq_len(self) -> int:
        return self.shard_len * self.world_size

    @cached_property
    def _runs(self) -> tuple[tuple[Run, ...], ...]:
        every = []
        for held in self.chunks:
            runs: list[Run] = []
            for k, c in enumerate(held):
                if runs and runs[-1].start + runs[-1].length == c * self.chunk:
                    runs[-1] = Run(runs[-1].start, runs[-1].local, runs[-1].length + self.chunk)
                else:
                    runs.append(Run(c * self.chunk, k * self.chunk, self.chunk))
            every.append(tuple(runs))
        return tuple(every)

    def runs(self, rank: int) -> tuple[Run, ...]:
        """The stretches of consecutive positions `rank` holds (one kernel call covers a stretch)."""
        return self._runs[rank]

    def positions(self, rank: int) -> torch.Tensor:
        """Global positions [shard_len] held by `rank`, in local order (int64)."""
        return torch.cat([torch.arange(r.start, r.start + r.length) for r in self.runs(rank)])

    def grouped(self, size: int) -> Layout:
        """The layout of groups of `size` consecutive ranks (Ulysses' nodes): group g holds the chunks
        of ranks g x size .. g x size + size - 1, in ascending order."""
        return Layout(self.chunk, tuple(tuple(sorted(c for r in range(g, g + size) for c in self.chunks[r]))
                                        for g in range(0, self.world_size, size)))

    def group_order(self, size: int, group: int) -> torch.Tensor:
        """Where group `group`'s shard (`grouped(size)`) finds each of its positions in the concatenation
        of its ranks' shards, rank after rank: int64 [size x shard_len]."""
        held = self.chunks[group * size:(group + 1) * size]
        source = {c: r * self.shard_len + k * self.chunk for r, cs in enumerate(held) for k, c in enumerate(cs)}
        return torch.cat([torch.arange(source[c], source[c] + self.chunk) for c in sorted(source)])


def check_sequence_length(seq_len: int, world_size: int) -> None:
    """Raise a ValueError unless `seq_len` splits into 2 * world_size equal chunks (both layouts start from them)."""
    step = 2 * world_size
    if seq_len <= 0 or seq_len % step != 0:
        lower = seq_len - seq_len % step
        nearest = f"{lower} or {lower + step}" if lower > 0 else f"{step}"
        raise ValueError(f"sequence length {seq_len} must be a positive multiple of 2 x world size = {step}, the "
                         f"chunks the ranks' layouts are made of; use {nearest}, or pad the sequence")


def check_layout(layout: str, name: str = "layout") -> None:
    """Refuse a layout that is not one of LAYOUTS; `name` is what the caller calls the setting."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown {name} {layout!r}; choose one of {', '.join(LAYOUTS)}")


def whole_sequence(seq_len: int) -> Layout:
    """The layout of a world of one that is not sharded at all: one chunk of any length `seq_len` (burst.local_attn)."""
    return Layout(seq_len, ((0,),))


def zigzag_chunks(rank: int, world_size: int) -> tuple[int, int]:
    """The two chunk indices (out of 2 * world_size) that `rank` holds, in local order."""
    return rank, 2 * world_size - 1 - rank


def zigzag_layout(seq_len: int, world_size: int) -> Layout:
    check_sequence_length(seq_len, world_size)
    return Layout(seq_len // (2 * world_size), tuple(zigzag_chunks(r, world_size) for r in range(world_size)))


def zigzag_positions(seq_len: int, rank: int, world_size: int) -> torch.Tensor:
    """Global positions [seq_len // world_size] held by `rank`, in local order (int64)."""
    return zigzag_layout(seq_len, world_size).positions(rank)


def check_layout_windows(windows) -> tuple[int | None, ...] | None:
    """The sliding window of each layer of a model as a tuple (None: a causal layer), or None when no layer
    has one (the layout is then chosen as for causal attention); ValueError for anything else."""
    if windows is None:
        return None
    windows = tuple(windows)
    if any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1) for w in windows):
        raise ValueError(f"layout_windows must give each layer's sliding window, a positive int, or None for a "
                         f"causal layer; got {list(windows)[:8]}")
    return windows if any(w is not None for w in windows) else None


@lru_cache(maxsize=4096)
def balanced_layout(boundaries: tuple[int, ...], seq_len: int, world_size: int,
                    options: balance.BalanceOptions = balance.DEFAULT_OPTIONS,
                    sees: tuple[int, ...] | None = None, windows: tuple[int | None, ...] | None = None) -> Layout:
    """The balanced layout of a sequence with documents at `boundaries` (cumulative offsets [0, ...,
    seq_len], a tuple), chosen by burst/balance.py; memoised, so the model's layers and the data loader
    plan a sequence once. sees: per document the earlier document it also sees, or -1 (burst/plan.py);
    its work is counted too. windows: each layer's sliding window (None: causal), all layers' work counted."""
    check_sequence_length(seq_len, world_size)
    if not boundaries or boundaries[0] != 0 or boundaries[-1] != seq_len:
        raise ValueError(f"document boundaries must run from 0 to the sequence length {seq_len}; got "
                         f"{list(boundaries[:8])}{' ...' if len(boundaries) > 8 else ''}")
    chunk, chunks = balance.choose_chunks(boundaries, seq_len, world_size, zigzag_layout(seq_len, world_size).chunks,
                                          options, sees, windows)
    return Layout(chunk, chunks)


def row_layouts(layout: str, doc_boundaries, seq_len: int, world_size: int, rows: int,
                doc_sees=None, layout_windows=None) -> list[Layout]:
    """The layout of each of `rows` batch rows: zigzag for all, or each row's balanced layout chosen from
    its document boundaries (doc_boundaries: cumulative offsets per row, as the loader gives them) and
    the documents each sees (doc_sees: per row, the earlier document each document also sees or -1, as
    burst_attn takes it; None: none), in a model whose layers have the sliding windows `layout_windows` (a
    sequence, None for a causal layer; None: all causal)."""
    check_layout(layout)
    windows = check_layout_windows(layout_windows)
    if layout == "zigzag":
        return [zigzag_layout(seq_len, world_size)] * rows
    if doc_boundaries is None:
        raise ValueError("layout 'balanced' is chosen from the documents' boundaries: pass doc_boundaries (one "
                         "row of cumulative offsets per batch row), or use layout 'zigzag'")
    offsets = [tuple(row.tolist() if isinstance(row, torch.Tensor) else (int(x) for x in row))
               for row in doc_boundaries]
    if len(offsets) != rows:
        raise ValueError(f"doc_boundaries has {len(offsets)} rows but the tensor has {rows} batch rows; give "
                         "one row of cumulative document offsets per batch row")
    sees = [None] * rows if doc_sees is None else \
        [tuple(row.tolist() if isinstance(row, torch.Tensor) else (int(x) for x in row)) for row in doc_sees]
    if len(sees) != rows:
        raise ValueError(f"doc_sees has {len(sees)} rows but the tensor has {rows} batch rows; give one row "
                         "per batch row, one entry per document")
    # a row whose documents see none is laid out (and memoised) as plain document masking
    return [balanced_layout(row, seq_len, world_size, balance.OPTIONS,
                            seen if seen is not None and any(j >= 0 for j in seen) else None, windows)
            for row, seen in zip(offsets, sees, strict=True)]


def _same_everywhere(layouts: list[Layout]) -> bool:
    return all(layout == layouts[0] for layout in layouts)


def shard_for_rank(x: torch.Tensor, rank: int, world_size: int, dim: int = 1, *, layout: str = "zigzag",
                   doc_boundaries=None, batch_dim: int = 0, doc_sees=None, layout_windows=None) -> torch.Tensor:
    """`rank`'s shard of the full-sequence tensor `x` along `dim` under `layout` (a contiguous copy).

    x: [..., seq, ...] with seq at `dim` -> [..., seq // world_size, ...]. With the balanced layout each
    batch row (dimension `batch_dim`) is cut by its own layout, chosen from its row of doc_boundaries
    (and of doc_sees, when documents see others, and layout_windows, the model's windows: pass what
    burst_attn gets); this is the one function the data loader cuts sequences with.
    """
    check_sequence_length(x.shape[dim], world_size)
    rows = x.shape[batch_dim] if layout != "zigzag" else 1
    return shard_rows(x, row_layouts(layout, doc_boundaries, x.shape[dim], world_size, rows, doc_sees,
                                     layout_windows), rank, dim, batch_dim)


def shard_rows(x: torch.Tensor, layouts: Sequence[Layout], rank: int, dim: int = 1, batch_dim: int = 0
               ) -> torch.Tensor:
    """`rank`'s shard of `x` along `dim`, each batch row (dimension `batch_dim`) cut by its layout of `layouts`
    (one for every row, or all the same)."""
    if _same_everywhere(layouts):
        return x.index_select(dim, layouts[0].positions(rank).to(x.device)).contiguous()
    row_dim = dim - (dim > batch_dim)  # the sequence's dimension in one row
    return torch.stack([row.index_select(row_dim, lay.positions(rank).to(x.device))
                        for row, lay in zip(x.unbind(batch_dim), layouts, strict=True)], batch_dim).contiguous()


def unshard(parts: list[torch.Tensor], dim: int = 1, *, layout: str = "zigzag", doc_boundaries=None,
            batch_dim: int = 0, doc_sees=None, layout_windows=None) -> torch.Tensor:
    """Inverse of `shard_for_rank`: the full sequence from every rank's shard, in rank order."""
    world_size = len(parts)
    shape = list(parts[0].shape)
    shape[dim] *= world_size
    full = parts[0].new_empty(shape)
    rows = shape[batch_dim] if layout != "zigzag" else 1
    layouts = row_layouts(layout, doc_boundaries, shape[dim], world_size, rows, doc_sees, layout_windows)
    row_dim, same = dim - (dim > batch_dim), _same_everywhere(layouts)
    for rank, part in enumerate(parts):
        if same:
            full.index_copy_(dim, layouts[0].positions(rank).to(part.device), part)
            continue
        for row, piece, lay in zip(full.unbind(batch_dim), part.unbind(batch_dim), layouts, strict=True):
            row.index_copy_(row_dim, lay.positions(rank).to(part.device), piece)
    return full


def shard_sequence(x: torch.Tensor, dim: int = 1, group: dist.ProcessGroup | None = None, *,
                   layout: str = "zigzag", doc_boundaries=None, batch_dim: int = 0, doc_sees=None,
                   layout_windows=None) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor that every rank holds.

    x: [..., seq, ...] with seq at `dim`  ->  [..., seq // world_size, ...]
    """
    rank, world_size = group_rank_and_size(group)
    return shard_for_rank(x, rank, world_size, dim, layout=layout, doc_boundaries=doc_boundaries,
                          batch_dim=batch_dim, doc_sees=doc_sees, layout_windows=layout_windows)


def gather_sequence(x_local: torch.Tensor, dim: int = 1, group: dist.ProcessGroup | None = None, *,
                    layout: str = "zigzag", doc_boundaries=None, batch_dim: int = 0, doc_sees=None,
                    layout_windows=None) -> torch.Tensor:
    """The full sequence on every rank from each rank's shard (inverse of `shard_sequence`).

    x_local: [..., seq // world_size, ...]  ->  [..., seq, ...]
    Not differentiable: it is for inspection, evaluation and tests.
    """
    _, world_size = group_rank_and_size(group)
    if world_size == 1:
        return x_local
    parts = [torch.empty_like(x_local) for _ in range(world_size)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    return unshard(parts, dim, layout=layout, doc_boundaries=doc_boundaries, batch_dim=batch_dim, doc_sees=doc_sees,
                   layout_windows=layout_windows)


def sequence_positions(seq_len: int, group: dist.ProcessGroup | None = None,
                       device: torch.device | str | None = None, *, layout: str = "zigzag",
                       doc_boundaries: Sequence | None = None, doc_sees: Sequence | None = None,
                       layout_windows=None) -> torch.Tensor:
    """Global position ids of this rank's shard (for RoPE): [seq_len // world_size] under zigzag,
    [rows, seq_len // world_size] under the balanced layout (one row per row of doc_boundaries)."""
    rank, world_size = group_rank_and_size(group)
    if layout == "zigzag":
        return zigzag_positions(seq_len, rank, world_size).to(device)
    rows = len(doc_boundaries) if doc_boundaries is not None else 1
    layouts = row_layouts(layout, doc_boundaries, seq_len, world_size, rows, doc_sees, layout_windows)
    return torch.stack([lay.positions(rank) for lay in layouts]).to(device)
