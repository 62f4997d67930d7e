"""Long documents read and encoded in bounded pieces (data/sources.py, data/pieces.py) give the ids of the whole."""

from __future__ import annotations

import errno
import json
import os
import random
import re
from pathlib import Path

import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

import data.pieces
import data.sources
from data import TokenStore, prepare
from data.pieces import CONTEXT_CHARS, DocumentCutter
from data.sources import DocumentReader, InputReport, find_input_files
from data.tokenizer_spm import SentencePieceTokenizer
from tests.test_data_prepare import make_text
from tests.test_data_prepare import tokenizer as tokenizer  # noqa: F401  (module-scoped fixture)

# LLaMA-3's pre-tokenizer pattern: a byte-level BPE cut as the real one is, trained here on a few texts.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def byte_level_bpe():
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    bpe.train_from_iterator([make_text(rng, 300) for _ in range(40)],
                            trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return bpe


def long_document(seed: int = 0) -> str:
    """Source-like lines, one very long line of words, a run without whitespace, and CJK without spaces."""
    rng = random.Random(seed)
    return (make_text(rng, 3000) + " ".join(make_text(rng, 2000).split()) + "\n" + "abcdefgh" * 500
            + " x = 1\n" + "数据长上下文" * 300 + "\n" + make_text(rng, 500))


def cut_and_encode(text: str, encode, encode_batch, piece_chars: int, seed: int = 0) -> tuple[list[int], int, int]:
    """Feed `text` in random parts through a DocumentCutter; (ids, the longest text encoded at once, hard cuts)."""
    rng = random.Random(seed)
    cutter = DocumentCutter(encode, piece_chars)
    ids, longest, start = [], 0, 0
    while start < len(text):
        end = min(len(text), start + rng.randint(1, 3 * piece_chars))
        pieces = cutter.feed(text[start:end], ends_document=end == len(text))
        for piece_ids in cutter.piece_ids(pieces, encode_batch([p.text for p in pieces])):
            ids += piece_ids
        longest = max([longest, *(len(piece.text) for piece in pieces)])
        start = end
    return ids, longest, cutter.hard_cuts


@pytest.mark.parametrize("family", ["sentencepiece", "byte-level bpe"])
def test_a_long_document_encoded_in_pieces_has_the_ids_of_the_whole(family, tokenizer, byte_level_bpe):  # noqa: F811
    if family == "sentencepiece":  # adds a space at the start of every text it encodes: the dummy prefix
        encode, encode_batch, decode = tokenizer.encode, tokenizer.encode_batch, tokenizer.decode
    else:
        encode = lambda text: byte_level_bpe.encode(text, add_special_tokens=False).ids
        encode_batch = lambda texts: [e.ids for e in byte_level_bpe.encode_batch(texts, add_special_tokens=False)]
        decode = byte_level_bpe.decode
    text = long_document()
    whole = encode(text)
    for piece_chars in (1000, 4096):
        ids, longest, hard_cuts = cut_and_encode(text, encode, encode_batch, piece_chars)
        assert longest <= piece_chars + CONTEXT_CHARS and len(text) > 9 * piece_chars
        assert hard_cuts == 0 and ids == whole and decode(ids) == text


def test_a_cut_that_finds_no_boundary_is_counted_and_keeps_the_text():
    def encode(text: str) -> list[int]:  # a token per run of one character: "aab" -> "aa", "b"
        return [len(run.group()) * 10 + ord(run.group(1)) for run in re.finditer(r"(.)\1*", text)]

    cutter = DocumentCutter(encode, piece_chars=256)
    rng = random.Random(1)
    text = "".join(rng.choice("ab") for _ in range(1000))  # no whitespace; a token boundary between runs
    pieces = cutter.feed(text, ends_document=True)
    assert "".join(p.body for p in pieces) == text and all(len(p.text) <= 256 + CONTEXT_CHARS for p in pieces)
    assert len(pieces) > 3 and cutter.hard_cuts == 0
    ids = [i for piece_ids in cutter.piece_ids(pieces, [encode(p.text) for p in pieces])
           for i in piece_ids]
    assert ids == encode(text)
    cutter = DocumentCutter(lambda text: [len(text)], piece_chars=256)  # one token for any text: no boundary at all
    pieces = cutter.feed(text, ends_document=True)
    assert "".join(p.body for p in pieces) == text and cutter.hard_cuts == len(pieces) - 1 > 0


def test_text_files_are_read_in_blocks_that_keep_every_character(tmp_path, monkeypatch):
    monkeypatch.setattr(data.sources, "BLOCK_BYTES", 7)  # cuts through multi-byte characters
    files = {"a.txt": "über naïve 数据 🙂\n" * 5, "blank.md": " \n\t " * 10, "late.txt": " " * 30 + "x",
             "bad.txt": b"ok \xff" * 5 + b" more"}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    report = InputReport()
    reader = DocumentReader(sorted(tmp_path.iterdir()), report)
    documents, current = [], ""
    for text, ends in reader.parts():
        assert len(text) <= 7
        current += text
        if ends:
            documents.append(current)
            current = ""
    assert documents == [files["a.txt"], "ok \ufffd" * 5 + " more", files["late.txt"]]  # sorted: a, bad, blank, late
    assert (report.documents, report.empty_documents, report.invalid_utf8) == (3, 1, 1)
    assert report.examples["empty_documents"] == [str(tmp_path / "blank.md")]
    assert reader.bytes_read == sum(p.stat().st_size for p in tmp_path.iterdir())


def test_prepare_encodes_a_one_line_file_and_a_long_row_in_bounded_pieces(tmp_path, tokenizer, monkeypatch):  # noqa: F811
    monkeypatch.setattr(data.pieces, "PIECE_CHARS", 2000)
    monkeypatch.setattr(data.sources, "PART_CHARS", 1500)
    monkeypatch.setattr(data.sources, "BLOCK_BYTES", 3000)
    one_line, row = " ".join(long_document(1).split()), long_document(2)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "line.txt").write_text(one_line)
    (tmp_path / "in" / "rows.jsonl").write_text(json.dumps({"text": row}) + "\n" + json.dumps({"text": "short"}))
    lengths, encode_batch = [], SentencePieceTokenizer.encode_batch
    monkeypatch.setattr(SentencePieceTokenizer, "encode_batch",
                        lambda self, texts, threads=None: lengths.extend(map(len, texts)) or encode_batch(self, texts))
    prepare([tmp_path / "in"], tmp_path / "store", tokenizer=tokenizer.path, val_fraction=0, progress=False)
    store = TokenStore(tmp_path / "store")
    assert [store.document(i).tolist() for i in range(3)] == [tokenizer.encode(t) for t in (one_line, row, "short")]
    assert max(lengths) <= 2000 + CONTEXT_CHARS and len(one_line) > 15 * 2000


def test_a_subdirectory_that_cannot_be_listed_is_counted_not_skipped_in_silence(tmp_path, monkeypatch):
    (tmp_path / "in" / "open").mkdir(parents=True)
    (tmp_path / "in" / "closed").mkdir()
    (tmp_path / "in" / "open" / "a.txt").write_text("alpha")
    (tmp_path / "in" / "closed" / "b.txt").write_text("beta")
    scandir = os.scandir

    def no_permission(path):  # what chmod 000 does to a user other than root (the tests may run as root)
        if Path(path).name == "closed":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", no_permission)
    report = InputReport()
    assert find_input_files([tmp_path / "in"], report) == [tmp_path / "in" / "open" / "a.txt"]
    assert report.unreadable_files == 1
    assert report.examples["unreadable_files"] == [f"{tmp_path / 'in' / 'closed'}: Permission denied"]
