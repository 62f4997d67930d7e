"""The SentencePiece backend of the tokenizer interface: loading a .model (ours or, say, LLaMA-2's) and training one.

Training settings are chosen so that decode(encode(text)) == text for any text, source code
included: BPE with byte fallback (no unknown tokens), identity normalisation, whitespace kept
as it is, and training pieces that keep their newlines so the vocabulary learns indentation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from data.tokenizer import SENTENCEPIECE, SPM_FILE, Tokenizer, file_sha256
from runtime.launch import available_cores

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2  # LLaMA's ids, so models and tokenizers agree on the specials

# SentencePiece skips training sentences longer than max_sentence_length bytes; pieces of at
# most this many characters (<= 4 bytes each in UTF-8) are never skipped.
MAX_PIECE_CHARS = 4096


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file; BOS and EOS are the model's own."""

    kind = SENTENCEPIECE

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as err:  # SentencePiece's parse error names the proto, not the fix
            raise ValueError(f"{path} is not a SentencePiece .model file ({err}); pass the tokenizer.model of a "
                             f"model or token store, a tokenizer.json, or let `burst prepare` train one with "
                             f"--vocab-size") from None
        self.path, self.files, self.special_tokens = path, {SPM_FILE: path}, {}
        self.digest = file_sha256(path)
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise ValueError(f"tokenizer {path} defines no BOS or EOS token (bos_id={self.bos_id}, "
                             f"eos_id={self.eos_id}); documents are packed between BOS and EOS, so use a model "
                             f"that has both")

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int | None = None) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=num_threads or available_cores())

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(list(ids))


def training_pieces(text: str, max_chars: int = MAX_PIECE_CHARS) -> Iterator[str]:
    """Cut a document into SentencePiece training sentences: paragraphs, then lines, then slices.

    Each piece keeps its trailing newlines, so newlines and indentation become learnable.
    """
    for paragraph in re.split(r"(?<=\n\n)", text):
        if len(paragraph) <= max_chars:
            if paragraph.strip():
                yield paragraph
            continue
        piece = ""
        for line in paragraph.splitlines(keepends=True):
            if len(piece) + len(line) > max_chars and piece:
                yield piece
                piece = ""
            for start in range(0, len(line), max_chars):
                piece += line[start:start + max_chars]
                if len(piece) >= max_chars:
                    yield piece
                    piece = ""
        if piece.strip():
            yield piece


def train_tokenizer(texts_or_files: Iterable[str | Path], out_path: str | Path, vocab_size: int, *,
                    input_sentence_size: int = 300_000, max_training_chars: int = 200_000_000,
                    seed: int = 0, num_threads: int | None = None) -> SentencePieceTokenizer:
    """Train a BPE SentencePiece model on documents (str) or plain text files (Path).

    SentencePiece keeps a seeded random sample of `input_sentence_size` pieces; reading stops after
    `max_training_chars` characters so a huge corpus does not make training slow. Returns the
    tokenizer written to `out_path` (a `.model` file). With little text the vocabulary may come out
    smaller than `vocab_size`; its `vocab_size` says what it is.
    """
    out_path = Path(out_path)
    if vocab_size < 300:
        raise ValueError(f"vocab size {vocab_size} is too small: byte fallback alone takes 259 ids; use >= 300")
    if out_path.suffix != ".model":
        raise ValueError(f"tokenizer path {out_path} must end in .model (SentencePiece writes <prefix>.model)")

    def sentences() -> Iterator[str]:
        chars = 0
        for item in texts_or_files:
            text = item.read_text(encoding="utf-8", errors="replace") if isinstance(item, Path) else item
            for piece in training_pieces(text):
                yield piece
                chars += len(piece)
            if chars >= max_training_chars:
                return

    out_path.parent.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(), model_prefix=str(out_path.with_suffix("")), model_type="bpe",
        vocab_size=vocab_size, hard_vocab_limit=False, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
        max_sentence_length=4 * MAX_PIECE_CHARS, character_coverage=0.9995,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
        num_threads=num_threads or available_cores(), minloglevel=2)
    out_path.with_suffix(".vocab").unlink(missing_ok=True)  # a human-readable copy nothing reads
    return SentencePieceTokenizer(out_path)
