"""SHA-256 of files: what tokenizers, token stores and checkpoints record of their files, and check on reading."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file, read in pieces (a tokenizer.json is several MB, a checkpoint shard several GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
