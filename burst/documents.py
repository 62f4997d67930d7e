"""`Documents`: the packed documents of a batch, one value from the data loader to the kernel.

    documents = Documents.of(offsets, seq_len, world_size, layout="balanced", sees=None)

Per batch row it holds the cumulative offsets of the row's documents over the global sequence
([0, end of doc 1, ..., seq_len]); what each document sees beyond itself (prefix sharing: the index of
an earlier document it sees whole, or -1); and the layout the ranks cut the row with (burst/layout.py),
chosen here, once: the data loader shards the row with it, the attention plans with it, and nothing
chooses it again.

It is frozen and hashable (plans are memoised on it). The registered operator takes tensors and plain
values only, so the value crosses it as one int64 tensor, `encoded`, made once with the value, and
comes back out of it with `Documents.decode`, memoised on the tensor's values:

    [rows, seq_len, world_size, layout, has_sees,                         (the header)
     then per row: n, offsets[n], sees[n - 1] (with has_sees), chunk, held, chunks[world_size x held]]

One flat tensor, not a padded 2-D one: a compiled graph holds one symbolic length for it, whatever the
documents per row (trainer/parallelize.py marks it dynamic).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from burst.layout import LAYOUTS, Layout, check_layout, check_layout_windows, row_layouts, shard_rows, whole_sequence
from burst.plan import normalize_boundaries, normalize_sees

Rows = tuple[tuple[int, ...], ...]
WHOLE = "whole"  # the layout of one process's attention (burst.local_attn): each row one chunk, not cut
_LAYOUT_CODES = (*LAYOUTS, WHOLE)


@dataclass(frozen=True)
class Documents:
    """The documents of each batch row, what each sees, and the layout each row is cut with."""

    offsets: Rows  # per row: cumulative document offsets [0, ..., seq_len] over the global sequence
    seq_len: int  # the global sequence's tokens (a field: a compiled graph reads it without the offsets)
    sees: Rows | None  # per row, per document: the earlier document it sees whole, or -1; None: none sees another
    layout: str  # "zigzag" or "balanced" (burst/layout.py), or WHOLE
    layouts: tuple[Layout, ...]  # per row: how the ranks cut it (one `world_size`)
    encoded: torch.Tensor = field(compare=False, repr=False)  # the operator's encoding (module docstring)
    # the layers' sliding windows a balanced layout weighed (None: causal work, or not balanced); the attention
    # refuses documents laid out for other windows than its model's (`check_documents`)
    windows: tuple[int | None, ...] | None = field(default=None, compare=False)

    @staticmethod
    def of(offsets, seq_len: int, world_size: int = 1, layout: str = "zigzag", sees=None,
           rows: int | None = None, layout_windows=None) -> Documents:
        """The value of per-row `offsets` (1-D tensors, arrays or sequences of ints; or a 2-D tensor) over a
        sequence of `seq_len` tokens cut over `world_size` ranks by `layout` (WHOLE: not cut, one process);
        `sees` as `burst_attn`'s doc_sees; `rows`: the batch rows there must be (None: as many as `offsets`
        has); `layout_windows`: each layer's sliding window (None for a causal layer), whose work the balanced
        layout weighs. Raises ValueError, naming what is wrong, for offsets or sees that do not describe
        documents of the sequence."""
        if layout != WHOLE:
            check_layout(layout)
        if isinstance(offsets, torch.Tensor) and offsets.dim() != 2:
            raise ValueError(f"doc_boundaries as a tensor must be 2-D [batch, offsets], got shape "
                             f"{tuple(offsets.shape)}; or pass a list of 1-D tensors, one per batch row")
        checked = normalize_boundaries([_ints(row) for row in offsets], len(offsets) if rows is None else rows,
                                       seq_len)
        seen = normalize_sees(sees, checked)
        offsets_ = tuple(map(tuple, checked))
        sees_ = None if seen is None else tuple(map(tuple, seen))
        layouts = (whole_sequence(seq_len),) * len(offsets_) if layout == WHOLE else \
            tuple(row_layouts(layout, offsets_, seq_len, world_size, len(offsets_), sees_, layout_windows))
        windows = check_layout_windows(layout_windows) if layout == "balanced" else None
        return Documents(offsets_, seq_len, sees_, layout, layouts, _encode(offsets_, seq_len, sees_, layout, layouts),
                         windows)

    @property
    def rows(self) -> int:
        return len(self.offsets)

    @property
    def world_size(self) -> int:
        return self.layouts[0].world_size if self.layouts else 1

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1, batch_dim: int = 0) -> torch.Tensor:
        """`rank`'s shard of the full-sequence tensor `x` [..., seq, ...] (seq at `dim`, the rows at `batch_dim`),
        each row cut by its layout (a contiguous copy)."""
        return shard_rows(x, self.layouts, rank, dim, batch_dim)

    @staticmethod
    def decode(encoded: torch.Tensor) -> Documents:
        """The value `encoded` holds (the inverse of making it); one host read."""
        return _decode(tuple(encoded.tolist()))


def _ints(row) -> list[int]:
    return row.tolist() if hasattr(row, "tolist") else [int(x) for x in row]


def _encode(offsets: Rows, seq_len: int, sees: Rows | None, layout: str, layouts: tuple[Layout, ...]
            ) -> torch.Tensor:
    world_size = layouts[0].world_size if layouts else 1
    values = [len(offsets), seq_len, world_size, _LAYOUT_CODES.index(layout), int(sees is not None)]
    for row, lay in enumerate(layouts):
        values += [len(offsets[row]), *offsets[row], *(sees[row] if sees is not None else ()), lay.chunk,
                   len(lay.chunks[0]), *(c for held in lay.chunks for c in held)]
    return torch.tensor(values, dtype=torch.int64)


@functools.lru_cache(maxsize=64)
def _decode(values: tuple[int, ...]) -> Documents:
    rows, seq_len, world_size, layout, has_sees = values[:5]
    at, offsets, sees, layouts = 5, [], [], []
    for _ in range(rows):
        n = values[at]
        offsets.append(values[at + 1:at + 1 + n])
        at += 1 + n
        if has_sees:
            sees.append(values[at:at + n - 1])
            at += n - 1
        chunk, held = values[at:at + 2]
        at += 2
        layouts.append(Layout(chunk, tuple(values[at + r * held:at + (r + 1) * held] for r in range(world_size))))
        at += world_size * held
    return Documents(tuple(offsets), seq_len, tuple(sees) if has_sees else None, _LAYOUT_CODES[layout],
                     tuple(layouts), torch.tensor(values, dtype=torch.int64))


def documents_of(doc_boundaries: Sequence | torch.Tensor | Documents | None, doc_sees, seq_len: int,
                 world_size: int, layout: str, rows: int, layout_windows=None) -> Documents | None:
    """What an attention call was given as `Documents` (None: no documents): a `Documents` as it is, or the
    per-row offsets and seen documents `burst_attn` and `local_attn` also take, checked against `rows` batch
    rows of `seq_len` tokens cut over `world_size` ranks by `layout`, weighing the layers' `layout_windows`
    (ValueError)."""
    if isinstance(doc_boundaries, Documents):
        if doc_sees is not None:
            raise ValueError("doc_sees is part of a Documents value: pass it to Documents.of, not beside it")
        check_documents(doc_boundaries, seq_len, world_size, layout, rows, layout_windows)
        return doc_boundaries
    if doc_boundaries is None:
        if doc_sees is not None:
            normalize_sees(doc_sees, None)  # the error of sees without boundaries
        if layout == "balanced":
            raise ValueError("layout 'balanced' is chosen from the documents' boundaries: pass doc_boundaries (one "
                             "row of cumulative offsets per batch row), or use layout 'zigzag'")
        return None
    return Documents.of(doc_boundaries, seq_len, world_size, layout, doc_sees, rows, layout_windows)


def check_documents(documents: Documents, seq_len: int, world_size: int, layout: str, rows: int,
                    layout_windows=None) -> None:
    """Refuse a `Documents` made for another batch, sequence, world or layout than the call's, or balanced for
    other layers' windows than the call's `layout_windows` (ValueError); one process (layout WHOLE) attends with
    documents of any layout."""
    made = (documents.rows, documents.seq_len, documents.world_size, documents.layout)
    if made != (rows, seq_len, world_size, layout) and (layout != WHOLE or made[:2] != (rows, seq_len)):
        raise ValueError(f"the documents were made for {documents.rows} rows of {documents.seq_len} tokens cut over "
                         f"{documents.world_size} ranks by layout {documents.layout!r}, but the attention has {rows} "
                         f"rows of {seq_len} tokens over {world_size} ranks with layout {layout!r}; make them with "
                         f"Documents.of(offsets, {seq_len}, {world_size}, {layout!r})")
    if layout == "balanced" and documents.windows != check_layout_windows(layout_windows):
        raise ValueError(f"the documents' balanced layout weighs {_windows(documents.windows)}, but the attention's "
                         f"layers have {_windows(layout_windows)}: "
                         f"make them with Documents.of(..., layout_windows=the model's windows), as the data loader "
                         f"does with its layout_windows (models.ModelConfig.windows)")


def _windows(windows) -> str:
    windows = check_layout_windows(windows)
    return "no sliding window" if windows is None else f"the sliding windows {list(windows)}"
