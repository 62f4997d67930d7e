"""Reading documents from the inputs of `burst prepare`: text files, JSON Lines, Parquet.

A plain text or source file is one document; a JSON Lines row or a Parquet row is one
document (its text field). Bad input never stops the read and is never dropped silently:
each problem is counted in an `InputReport`, with the first few places it happened.
"""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import json
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TEXT_SUFFIXES = frozenset(
    ".txt .md .rst .tex .py .pyi .c .h .cc .cpp .hpp .cu .rs .go .java .js .ts .sh .rb .lua .swift "
    ".kt .scala .hs .ml .jl .sql .html .css .toml .yaml .yml".split())
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIX = ".parquet"
MAX_EXAMPLES = 5  # places kept per kind of problem, for the summary
SNIFF_BYTES = 8192  # read from each file named on the command line to tell text from binary


@dataclass
class InputReport:
    """What the read found: files, documents, and each kind of bad input, counted."""

    files: int = 0
    documents: int = 0
    skipped_files: int = 0  # unsupported file types inside input directories
    unreadable_files: int = 0  # could not be opened, or broke off part-way (then counted from there)
    empty_documents: int = 0
    missing_text_field: int = 0  # rows without the text field, or where it is not a string
    invalid_json: int = 0
    invalid_utf8: int = 0  # documents decoded with U+FFFD replacement characters, then kept
    examples: dict[str, list[str]] = field(default_factory=dict)

    def count(self, problem: str, where: str) -> None:
        setattr(self, problem, getattr(self, problem) + 1)
        places = self.examples.setdefault(problem, [])
        if len(places) < MAX_EXAMPLES:
            places.append(where)

    def problems(self) -> dict[str, int]:
        """Each kind of bad input and how often it occurred (zeros included)."""
        return {name: getattr(self, name) for name in
                ("skipped_files", "unreadable_files", "empty_documents", "missing_text_field",
                 "invalid_json", "invalid_utf8")}


def find_input_files(inputs: Sequence[str | Path], report: InputReport) -> list[Path]:
    """The files to read, in a stable order: each input file, and each directory searched recursively.

    A file named explicitly is read as text unless it is JSON Lines or Parquet (and refused if it is
    binary); inside directories only known suffixes are read and the rest are counted as skipped.
    A file reached twice (`DIR DIR`, or a file and its directory) is refused: it would be stored twice,
    and could land in both splits.
    """
    files: list[Path] = []
    given_by: dict[Path, Path] = {}  # each file, resolved -> the input that reached it
    for item in map(Path, inputs):
        if item.is_dir():
            found = []
            for path in sorted(p for p in item.rglob("*") if p.is_file()):
                if kind_of(path) == "unsupported":
                    report.count("skipped_files", str(path))
                else:
                    found.append(path)
        elif item.is_file():
            if kind_of(item) not in ("jsonl", "parquet") and looks_binary(item):
                raise ValueError(f"input {item} is not UTF-8 text (it looks binary); pass text or source files, "
                                 f".jsonl(.gz) or .parquet, or directories holding them")
            found = [item]
        else:
            raise FileNotFoundError(f"input {item} does not exist; pass text, source, .jsonl(.gz) or .parquet "
                                    f"files, or directories holding them")
        for path in found:
            earlier = given_by.setdefault(path.resolve(), item)
            if earlier is not item:
                raise ValueError(f"{path} is given twice, by the inputs {earlier} and {item}: it would be stored "
                                 f"twice (and could be in both splits); pass each file or directory once")
        files += found
    if any(kind_of(p) == "parquet" for p in files) and importlib.util.find_spec("pyarrow") is None:
        raise ImportError("reading .parquet inputs needs pyarrow: pip install -e '.[parquet]' (or pass other inputs)")
    return files


def looks_binary(path: Path) -> bool:
    """Whether the start of `path` holds a NUL byte or is not UTF-8 (a sequence cut at the end is fine)."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return True
    return b"\0" in head


def kind_of(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIX):
        return "parquet"
    return "text" if path.suffix.lower() in TEXT_SUFFIXES else "unsupported"


class DocumentReader:
    """Iterates over the documents of `files`, counting bad input in `report`.

    `bytes_read` follows the position on disk, for a progress bar over the total input size.
    """

    def __init__(self, files: Sequence[Path], report: InputReport, text_field: str = "text") -> None:
        self.files, self.report, self.text_field = list(files), report, text_field
        self.bytes_read = 0

    def __iter__(self) -> Iterator[str]:
        for path in self.files:
            self.report.files += 1
            size = path.stat().st_size
            done_before = self.bytes_read
            try:
                if kind_of(path) == "jsonl":
                    yield from self._jsonl(path)
                elif kind_of(path) == "parquet":
                    yield from self._parquet(path, size)
                else:
                    text = self._decode(path.read_bytes(), str(path))
                    self.bytes_read += size
                    yield from self._accept(text, str(path))
            except (OSError, EOFError, zlib.error, ValueError) as error:  # gzip and pyarrow errors included
                self.report.count("unreadable_files", f"{path}: {error}")
            self.bytes_read = done_before + size

    def _jsonl(self, path: Path) -> Iterator[str]:
        with open(path, "rb") as raw:
            lines = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
            start = self.bytes_read
            for line_number, line in enumerate(lines, 1):
                self.bytes_read = start + raw.tell()
                if not line.strip():
                    continue  # blank lines are layout, not records
                where = f"{path}:{line_number}"
                try:
                    row = json.loads(self._decode(line, where))
                except json.JSONDecodeError:
                    self.report.count("invalid_json", where)
                    continue
                text = row.get(self.text_field) if isinstance(row, dict) else None
                if not isinstance(text, str):
                    self.report.count("missing_text_field", where)
                    continue
                yield from self._accept(text, where)

    def _parquet(self, path: Path, size: int) -> Iterator[str]:
        import pyarrow.parquet as pq  # optional dependency, checked by find_input_files

        table = pq.ParquetFile(path)
        if self.text_field not in table.schema_arrow.names:
            raise ValueError(f"no column {self.text_field!r} (columns: {table.schema_arrow.names}); "
                             f"choose one with --text-field")
        rows, start = max(table.metadata.num_rows, 1), self.bytes_read
        row_number = 0
        for batch in table.iter_batches(columns=[self.text_field]):
            for text in batch.column(0).to_pylist():
                row_number += 1
                if not isinstance(text, str):
                    self.report.count("missing_text_field", f"{path}: row {row_number}")
                    continue
                yield from self._accept(text, f"{path}: row {row_number}")
            self.bytes_read = start + size * row_number // rows

    def _decode(self, data: bytes, where: str) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            self.report.count("invalid_utf8", where)
            return data.decode("utf-8", errors="replace")

    def _accept(self, text: str, where: str) -> Iterator[str]:
        if not text.strip():
            self.report.count("empty_documents", where)
            return
        self.report.documents += 1
        yield text
