"""The document boundaries of the sequences the trainer packs, for benchmarks that need real ones."""

from __future__ import annotations

from pathlib import Path

from data.loader import SequenceLoader
from data.store import TokenStore


def packed_document_offsets(store: str | Path, seq_len: int, count: int, seed: int = 0) -> list[list[int]]:
    """Cumulative document offsets [0, ..., seq_len] of the first `count` sequences of `seq_len` tokens
    that `burst train --doc-mask --seed SEED` packs from the train split of `store`, in order."""
    loader = SequenceLoader(TokenStore(Path(store)).split("train"), seq_len, 1, seed=seed, reset_positions=True)
    return [next(loader).doc_boundaries[0].tolist() for _ in range(count)]
