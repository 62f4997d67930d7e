"""Encoding speed of the two tokenizer backends on the default corpus (the standard library's .py files), as
`burst prepare` encodes: chunks of data.prepare.CHUNK_CHARS characters, encode_batch on every core.

Three tokenizers: the default corpus's SentencePiece BPE (4,096 tokens) through SentencePiece; the very same
model converted to a tokenizer.json (models/hf_tokenizer.py) through the `tokenizers` library, which must give
the same ids for every document (checked); and any tokenizer.json given with --tokenizer (LLaMA-3.2's, say).
Wall time and process CPU time (every thread) are both reported: on a shared machine the CPU seconds are the
steadier figure.

    python benchmarks/tokenize_speed.py --tokenizer /path/to/llama/tokenizer.json --rounds 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from data import HFTokenizer, TokenStore, default_store, load_tokenizer
from data.corpus import stdlib_sources
from data.prepare import CHUNK_CHARS
from data.tokenizer import Tokenizer
from models import ModelConfig
from models.hf_tokenizer import write_hf_tokenizer


def chunks(texts: list[str]) -> list[list[str]]:
    out, chunk, size = [], [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= CHUNK_CHARS:
            out.append(chunk)
            chunk, size = [], 0
    return out + [chunk] if chunk else out


def encode_all(tokenizer: Tokenizer, pieces: list[list[str]]) -> tuple[list[list[int]], float, float]:
    """Every document's ids, and the wall and CPU seconds the encoding took."""
    wall, cpu = time.perf_counter(), time.process_time()
    ids = [doc for chunk in pieces for doc in tokenizer.encode_batch(chunk)]
    return ids, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", action="append", default=[], help="A tokenizer.json (or its directory) to time.")
    parser.add_argument("--rounds", type=int, default=3, help="Timed rounds of each tokenizer, interleaved.")
    args = parser.parse_args()

    texts = [path.read_text(encoding="utf-8", errors="replace") for path in stdlib_sources()]
    pieces = chunks(texts)
    print(f"corpus: {len(texts):,} documents, {sum(map(len, texts)) / 1e6:.1f}M characters, {len(pieces)} chunks")
    sentencepiece = TokenStore(default_store(progress=False)).tokenizer()
    directory = Path(tempfile.mkdtemp())
    write_hf_tokenizer(sentencepiece.path.parent, directory, ModelConfig.from_name("debug"))  # as an export does
    tokenizers = {"SentencePiece BPE 4,096 (sentencepiece)": sentencepiece,
                  "the same as tokenizer.json (tokenizers)": HFTokenizer(directory / "tokenizer.json"),
                  **{f"{path} (tokenizers)": load_tokenizer(path) for path in args.tokenizer}}
    for tokenizer in tokenizers.values():  # warm-up: thread pools, caches
        tokenizer.encode_batch(pieces[0][:50])
    results: dict[str, list[tuple[int, float, float]]] = {name: [] for name in tokenizers}
    reference = None
    for _ in range(args.rounds):
        for name, tokenizer in tokenizers.items():
            ids, wall, cpu = encode_all(tokenizer, pieces)
            if tokenizer is not sentencepiece and name.startswith("the same"):
                assert ids == reference, "the converted tokenizer.json encodes otherwise than SentencePiece"
            if tokenizer is sentencepiece:
                reference = ids
            results[name].append((sum(map(len, ids)), wall, cpu))
    print("tokens per wall second and per CPU second (all threads), and CPU / wall (the cores busy), each round:")
    for name, rounds in results.items():
        tokens = rounds[0][0]
        walls = ", ".join(f"{tokens / wall / 1e6:.2f}M" for _, wall, _ in rounds)
        cpus = ", ".join(f"{tokens / cpu / 1e6:.2f}M" for _, _, cpu in rounds)
        cores = ", ".join(f"{cpu / wall:.2f}" for _, wall, cpu in rounds)
        print(f"{name}\n    {tokens:,} tokens; per wall s {walls}; per CPU s {cpus}; CPU / wall {cores}")


if __name__ == "__main__":
    main()
