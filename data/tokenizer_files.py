"""Finding a tokenizer on disk and loading it with the right backend (data/tokenizer.py has the interface).

`burst prepare --tokenizer` takes a Hugging Face tokenizer.json, a SentencePiece .model, or a model
directory holding either (tokenizer.json first: it is what Hugging Face models are published with).
LLaMA-3's tokenizer.model is not SentencePiece but tiktoken's format (a base64 token and its rank per
line); it is refused with the tokenizer.json to pass instead, as is any file that is neither.
"""

from __future__ import annotations

import re
from pathlib import Path

from data.tokenizer import HF_FILE, HUGGINGFACE, SENTENCEPIECE, SPM_FILE, Tokenizer, files_of
from data.tokenizer_hf import HFTokenizer
from data.tokenizer_spm import SentencePieceTokenizer

TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+")  # "IQ== 0": a base64 token and its rank


def is_tiktoken(path: Path) -> bool:
    """Whether `path` is a tiktoken BPE file (LLaMA-3's tokenizer.model): its first lines are "base64 rank"."""
    with open(path, "rb") as f:
        lines = f.read(4096).splitlines()[:8]
    return bool(lines) and all(TIKTOKEN_LINE.fullmatch(line.strip()) for line in lines[:-1] or lines)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at `path`: a tokenizer.json, a SentencePiece .model, or a directory holding one."""
    path = Path(path)
    if path.is_dir():
        tokenizer = tokenizer_beside(path)
        if tokenizer is None:
            raise ValueError(f"{path} holds no tokenizer: neither a {HF_FILE} nor a SentencePiece {SPM_FILE}"
                             + (f" (its {SPM_FILE} is tiktoken's format, which burst does not read)"
                                if (path / SPM_FILE).is_file() else "")
                             + "; pass the directory of a model published with one, or the file itself")
        return tokenizer
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {path} does not exist; pass a tokenizer.json, a SentencePiece .model, "
                                f"a model directory holding one, or let `burst prepare` train one with --vocab-size")
    if path.suffix == ".json":
        return HFTokenizer(path)
    if is_tiktoken(path):
        beside = path.parent / HF_FILE
        instead = f"the {HF_FILE} beside it ({beside})" if beside.is_file() else \
            f"the {HF_FILE} published with the same model"
        raise ValueError(f"{path} is a tiktoken tokenizer (LLaMA-3's tokenizer.model: a base64 token and its rank per "
                         f"line), which burst does not read; pass {instead}, or the model directory")
    return SentencePieceTokenizer(path)


def tokenizer_beside(directory: Path, prefer: str = HUGGINGFACE) -> Tokenizer | None:
    """The tokenizer kept in `directory` (a model, run, export or store), the `prefer` kind first when it holds
    both (LLaMA-2's directories do); None when it holds none."""
    kind = kind_beside(directory, prefer)
    if kind is None:
        return None
    return HFTokenizer(directory / HF_FILE) if kind == HUGGINGFACE else SentencePieceTokenizer(directory / SPM_FILE)


def files_beside(directory: Path, prefer: str = HUGGINGFACE) -> tuple[str, dict[str, Path]] | None:
    """The kind and files of the tokenizer `tokenizer_beside(directory, prefer)` loads, found without loading it
    (a 262,144-token tokenizer.json takes about 3 CPU s to read); None when `directory` holds none."""
    kind = kind_beside(directory, prefer)
    if kind is None:
        return None
    return kind, files_of(kind, directory / (HF_FILE if kind == HUGGINGFACE else SPM_FILE))


def kind_beside(directory: Path, prefer: str) -> str | None:
    """The kind of tokenizer `directory` keeps, `prefer` first where it keeps both; None where it keeps none."""
    hf = directory / HF_FILE
    spm = directory / SPM_FILE
    found = {HUGGINGFACE: hf.is_file(), SENTENCEPIECE: spm.is_file() and not is_tiktoken(spm)}
    return next((kind for kind in sorted(found, key=lambda kind: kind != prefer) if found[kind]), None)
