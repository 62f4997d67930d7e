"""What one `burst eval` found: the result run.py returns and report.py shows and writes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from evaluation.passkey import PasskeyResult
from evaluation.perplexity import PerplexityResult
from evaluation.qa import QAResult


@dataclass
class EvalResult:
    checkpoint: Path
    format: str  # the checkpoint's format (a key of checkpoints.SOURCE_FORMATS)
    data: Path  # the token store
    cp: int
    precision: str
    perplexity: PerplexityResult
    passkey: PasskeyResult | None  # None when passkey_trials is 0
    warnings: list[str]
    seconds: float
    qa: QAResult | None = None  # an instruction store's question answering; None: not run
