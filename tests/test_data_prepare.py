"""Tokenizer, `burst prepare`, the token store and the embedded corpus, on small generated corpora."""

import gzip
import json
import os
import random
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

import data.corpus
from cli import app
from data import Tokenizer, TokenStore, default_store, prepare, train_tokenizer
from data.prepare import summary_table
from data.sources import InputReport, find_input_files
from data.store import METADATA_FILE, TOKENS_FILE, token_dtype
from data.tokenizer import file_sha256

prepare_module = sys.modules["data.prepare"]  # `data.prepare` names the function

WORDS = ["alpha", "beta", "gamma", "delta", "tensor", "ring", "rank", "shard", "über", "naïve", "数据", "🙂"]


def make_text(rng: random.Random, words: int) -> str:
    lines = []
    while words > 0:
        n = min(words, rng.randint(1, 12))
        indent = " " * rng.choice([0, 4, 8]) + "\t" * rng.randint(0, 1)
        lines.append(indent + " ".join(rng.choice(WORDS) for _ in range(n)) + rng.choice(["", ":", " = 42", "()"]))
        words -= n
    return "\n".join(lines) + rng.choice(["\n", "\n\n", ""])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    rng = random.Random(0)
    texts = [make_text(rng, 300) for _ in range(40)]
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "tokenizer.model", vocab_size=400)


def write_corpus(root: Path, seed: int = 1) -> list[str]:
    """Text, markdown, source and JSON Lines (plain and gzipped) inputs; returns documents in reading order."""
    rng = random.Random(seed)
    docs: list[str] = []
    (root / "sub").mkdir(parents=True)
    for name in ["a.txt", "b.md", "sub/c.py", "sub/d.rs"]:
        text = make_text(rng, rng.randint(5, 400))
        (root / name).write_text(text, encoding="utf-8")
        docs.append(text)
    for name, opener in [("x.jsonl", open), ("y.jsonl.gz", gzip.open)]:
        rows = [make_text(rng, rng.randint(1, 200)) for _ in range(5)]
        with opener(root / name, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": row, "id": i}) + "\n" for i, row in enumerate(rows))
        docs.extend(rows)
    return docs


def test_trained_tokenizer_round_trips_text_and_has_llama_specials(tokenizer):
    text = "def f(x):\n\tif x:\n        return 'über 数据 🙂 Ω'  # unseen: Ω\n\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    assert tokenizer.vocab_size == 400 and len(tokenizer.fingerprint) == 64
    assert tokenizer.bos_id not in tokenizer.encode(text)  # encode adds no specials


def test_store_holds_exactly_the_tokenizer_encoding_of_every_document(tmp_path, tokenizer):
    docs = write_corpus(tmp_path / "corpus")
    summary = prepare([tmp_path / "corpus"], tmp_path / "store", tokenizer=tokenizer.path, val_fraction=0.25,
                      workers=2, progress=False)
    store = TokenStore(tmp_path / "store")
    assert store.num_documents == summary.num_documents == len(docs)
    for i, text in enumerate(docs):
        assert store.document(i).tolist() == tokenizer.encode(text)
    assert store.num_tokens == sum(len(tokenizer.encode(t)) for t in docs) == summary.num_tokens
    assert store.metadata["dtype"] == "uint16" and store.document(0).dtype == np.uint16
    assert store.metadata["tokenizer"]["files"] == {"tokenizer.model": file_sha256(tokenizer.path)}
    assert store.tokenizer().fingerprint == store.tokenizer_fingerprint == tokenizer.fingerprint
    train, val = store.split("train"), store.split("val")
    assert val.num_documents == summary.num_val_documents == 4  # round(14 x 0.25)
    assert train.num_documents + val.num_documents == store.num_documents
    assert train.num_tokens + val.num_tokens == store.num_tokens
    seen = sorted(tuple(s.document(i).tolist()) for s in (train, val) for i in range(s.num_documents))
    assert seen == sorted(tuple(store.document(i).tolist()) for i in range(store.num_documents))
    assert summary.length_max == max(len(tokenizer.encode(t)) for t in docs)
    assert summary.documents_at_least == {8192: 0, 16384: 0, 32768: 0, 65536: 0, 131072: 0}


def test_token_dtype_is_the_smallest_that_fits_and_uint32_stores_read_back(tmp_path, tokenizer, monkeypatch):
    assert token_dtype(4096) == np.uint16 and token_dtype(2**16) == np.uint16 and token_dtype(2**16 + 1) == np.uint32
    docs = write_corpus(tmp_path / "corpus")
    monkeypatch.setattr(prepare_module, "token_dtype", lambda vocab_size: np.dtype(np.uint32))
    prepare([tmp_path / "corpus"], tmp_path / "store", tokenizer=tokenizer.path, progress=False)
    store = TokenStore(tmp_path / "store")
    assert store.metadata["dtype"] == "uint32" and store.document(3).dtype == np.uint32
    assert [store.document(i).tolist() for i in range(len(docs))] == [tokenizer.encode(t) for t in docs]


def test_each_kind_of_bad_input_is_counted_and_good_documents_kept(tmp_path, tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("alpha beta gamma")
    (corpus / "empty.txt").write_text("")
    (corpus / "blank.md").write_text("  \n\t\n")
    (corpus / "latin1.txt").write_bytes("naïve café".encode("latin-1"))
    (corpus / "image.png").write_bytes(b"\x89PNG")
    (corpus / "rows.jsonl").write_bytes(b"\n".join([
        b'{"text": "delta ring"}', b'{"body": "no text field"}', b'{"text": 42}', b'["not", "an", "object"]',
        b'{"text": "unterminated', b'{"text": ""}', b'', b'{"text": "bad \xff byte"}']))
    with gzip.open(corpus / "cut.jsonl.gz", "wb") as f:
        f.write(b'{"text": "shard rank"}\n' * 2000)
    (corpus / "cut.jsonl.gz").write_bytes((corpus / "cut.jsonl.gz").read_bytes()[:-40])  # truncated
    (corpus / "fake.jsonl.gz").write_bytes(b"not gzip at all")
    summary = prepare([corpus], tmp_path / "store", tokenizer=tokenizer.path, progress=False)
    report = summary.report
    assert report.problems() == {"skipped_files": 1, "unreadable_files": 2, "empty_documents": 3,
                                 "missing_text_field": 3, "invalid_json": 1, "invalid_utf8": 2}
    assert report.files == 7  # image.png is skipped, not read
    assert summary.num_documents == report.documents > 1000  # the rows of cut.jsonl.gz before the cut are kept
    store = TokenStore(tmp_path / "store")
    last = [tokenizer.decode(store.document(i)) for i in range(store.num_documents - 4, store.num_documents)]
    assert last == ["alpha beta gamma", "na\ufffdve caf\ufffd", "delta ring", "bad \ufffd byte"]
    console = Console(record=True, width=80)  # a terminal of 80 columns, or a log file
    console.print(summary_table(summary), soft_wrap=True)  # as prepare prints it
    lines = console.export_text().splitlines()
    table = [line for line in lines if line[:1] in "┌│└"]
    assert max(map(len, table)) <= 80, "\n".join(lines)
    for problem, count in [("unreadable files", 2), ("invalid json", 1), ("empty documents", 3)]:
        assert any(re.fullmatch(rf"│ {problem}\s*│ {count}\s*│", line) for line in table), "\n".join(lines)
        example = report.examples[problem.replace(" ", "_")][0]
        assert f"{problem}: {count}, e.g. {example}" in lines, "\n".join(lines)  # whole, on a line of its own


def test_interrupted_prepare_leaves_no_complete_looking_store(tmp_path, tokenizer, monkeypatch):
    write_corpus(tmp_path / "corpus")

    def interrupt(self, documents, ends=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module.StoreWriter, "append", interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare([tmp_path / "corpus"], tmp_path / "store", tokenizer=tokenizer.path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]  # neither store nor temporary directory
    with pytest.raises(FileNotFoundError, match="metadata.json is missing"):
        TokenStore(tmp_path / "store")


def test_incomplete_or_foreign_stores_are_refused_clearly(tmp_path, tokenizer):
    write_corpus(tmp_path / "corpus")
    prepare([tmp_path / "corpus"], tmp_path / "store", tokenizer=tokenizer.path, progress=False)
    meta_path = tmp_path / "store" / METADATA_FILE
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ValueError, match="format version 99"):
        TokenStore(tmp_path / "store")
    meta_path.write_text(json.dumps(meta))
    tokens = tmp_path / "store" / TOKENS_FILE
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(ValueError, match="tokens.bin has .* bytes, metadata.json says"):
        TokenStore(tmp_path / "store")


def test_existing_output_is_refused_unless_forced(tmp_path, tokenizer):
    docs = write_corpus(tmp_path / "corpus")
    out = tmp_path / "store"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="burst did not write .* so it will not delete"):
        prepare([tmp_path / "corpus"], out, tokenizer=tokenizer.path, progress=False)
    assert (out / "precious.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="not a token store written by `burst prepare`"):
        prepare([tmp_path / "corpus"], out, tokenizer=tokenizer.path, force=True, progress=False)
    assert (out / "precious.txt").read_text() == "keep me"
    (out / "precious.txt").unlink()
    prepare([tmp_path / "corpus"], out, tokenizer=tokenizer.path, progress=False)
    with pytest.raises(ValueError, match="inside --out"):
        prepare([out], out, tokenizer=tokenizer.path, force=True, progress=False)
    prepare([tmp_path / "corpus"], out, tokenizer=tokenizer.path, force=True, progress=False)  # a store: replaced
    assert TokenStore(out).num_documents == len(docs)


def test_cli_prepare_trains_a_tokenizer_and_reports_errors(tmp_path):
    write_corpus(tmp_path / "corpus")
    runner = CliRunner()
    result = runner.invoke(app, ["prepare", str(tmp_path / "corpus"), "--out", str(tmp_path / "store"),
                                 "--vocab-size", "300", "--val-fraction", "0.1", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "documents" in result.output and "14 (13 train, 1 val)" in result.output
    store = TokenStore(tmp_path / "store")
    assert store.vocab_size == store.tokenizer().vocab_size <= 300
    result = runner.invoke(app, ["prepare", str(tmp_path / "corpus"), "--out", str(tmp_path / "store")])
    assert result.exit_code == 2 and "--force" in result.output


def test_default_store_prepares_once_under_concurrent_callers(tmp_path, monkeypatch):
    """The embedded-corpus path on a small slice of the standard library, called by 3 'ranks' at once."""
    sources = data.corpus.stdlib_sources()
    assert len(sources) > 500
    monkeypatch.setattr(data.corpus, "stdlib_sources", lambda: sources[:: len(sources) // 25])
    monkeypatch.setitem(data.corpus.CORPUS_OPTIONS, "vocab_size", 500)
    calls, real_prepare = [], data.corpus.prepare

    def counting_prepare(*args, **kwargs):
        calls.append(threading.get_ident())
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(data.corpus, "prepare", counting_prepare)
    with ThreadPoolExecutor(3) as pool:  # flock locks per open file, so threads contend like processes
        paths = list(pool.map(lambda _: default_store(tmp_path, progress=False), range(3)))
    assert len(set(paths)) == 1 and len(calls) == 1
    store = TokenStore(paths[0])
    assert store.num_documents >= 20 and store.vocab_size == 500
    assert default_store(tmp_path, progress=False) == paths[0] and len(calls) == 1


def test_every_file_of_the_embedded_corpus_is_one_prepare_accepts():
    """The default corpus names its files one by one, and prepare refuses a named file that is not
    UTF-8: the standard library's encoding tests (module_koi8_r.py, ...) must be left out, or the
    README's first `burst train` fails on a fresh machine."""
    sources = data.corpus.stdlib_sources()
    assert len(sources) > 500
    assert find_input_files(sources, InputReport()) == sources  # raises on a binary or non-UTF-8 file


def test_parquet_rows_are_documents_and_bad_rows_are_counted(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    pq.write_table(pa.table({"text": ["alpha beta", None, "", "gamma 数据"]}), corpus / "a.parquet", row_group_size=2)
    pq.write_table(pa.table({"body": ["no text column"]}), corpus / "b.parquet")
    summary = prepare([corpus], tmp_path / "store", tokenizer=tokenizer.path, progress=False)
    assert summary.report.problems() == {"skipped_files": 0, "unreadable_files": 1, "empty_documents": 1,
                                         "missing_text_field": 1, "invalid_json": 0, "invalid_utf8": 0}
    assert "no column 'text'" in summary.report.examples["unreadable_files"][0]
    store = TokenStore(tmp_path / "store")
    assert [store.document(i).tolist() for i in range(2)] == [tokenizer.encode(t) for t in ["alpha beta", "gamma 数据"]]


def test_the_embedded_corpus_leaves_out_links_and_what_is_not_a_regular_file(tmp_path, monkeypatch):
    """Debian's and Ubuntu's Pythons link _sysconfigdata__linux_*.py to another file of the standard library (which
    prepare refused as one file given twice) and sitecustomize.py to /etc; a link, a pipe or a directory named
    *.py is not a document of the corpus."""
    stdlib, elsewhere = tmp_path / "lib" / "python3.12", tmp_path / "etc"
    (stdlib / "json").mkdir(parents=True)
    elsewhere.mkdir()
    (stdlib / "_sysconfigdata__x86_64-linux-gnu.py").write_text("build_time_vars = {}\n")
    (stdlib / "_sysconfigdata__linux_x86_64-linux-gnu.py").symlink_to("_sysconfigdata__x86_64-linux-gnu.py")
    (elsewhere / "sitecustomize.py").write_text("import os\n")
    (stdlib / "sitecustomize.py").symlink_to(elsewhere / "sitecustomize.py")
    (stdlib / "broken.py").symlink_to(stdlib / "gone.py")
    (stdlib / "json" / "decoder.py").write_text("def decode(text):\n    return text\n")
    (stdlib / "folder.py").mkdir()
    os.mkfifo(stdlib / "pipe.py")
    monkeypatch.setattr(data.corpus.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib)})
    sources = data.corpus.stdlib_sources()
    assert sources == [stdlib / "_sysconfigdata__x86_64-linux-gnu.py", stdlib / "json" / "decoder.py"]
    assert find_input_files(sources, InputReport()) == sources
