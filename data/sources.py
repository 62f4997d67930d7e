"""Reading documents from the inputs of `burst prepare`: text files, JSON Lines, Parquet.

A plain text or source file is one document; a JSON Lines row or a Parquet row is one
document (its text field), or with `burst prepare --chat` one conversation (data/conversations.py).
Bad input never stops the read and is never dropped silently: each problem is counted in an
`InputReport`, with the first few places it happened.

Documents are handed on in parts of bounded size, so a one-line 40 MB file costs no more memory
than many small ones: a text file is read BLOCK_BYTES at a time; a row's text (which JSON Lines and
Parquet hold whole, about three times its size while it is read) is passed on PART_CHARS at a time.
"""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

TEXT_SUFFIXES = frozenset(
    ".txt .md .rst .tex .py .pyi .c .h .cc .cpp .hpp .cu .rs .go .java .js .ts .sh .rb .lua .swift "
    ".kt .scala .hs .ml .jl .sql .html .css .toml .yaml .yml".split())
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIX = ".parquet"
MAX_EXAMPLES = 5  # places kept per kind of problem, for the summary
SNIFF_BYTES = 8192  # read from each file named on the command line to tell text from binary
BLOCK_BYTES = 2**20  # a text file is read this much at a time
PART_CHARS = 2**20  # a longer row's text is handed on in parts of this many characters
DOCUMENT_PROBLEMS = ("skipped_files", "unreadable_files", "empty_documents", "missing_text_field", "invalid_json",
                     "invalid_utf8")
CONVERSATION_PROBLEMS = ("skipped_files", "unreadable_files", "invalid_json", "invalid_utf8", "missing_messages",
                         "malformed_messages", "no_answer", "empty_answers", "template_errors", "unplaced_answers",
                         "unsupported_tool_calls")
Item = TypeVar("Item")
_INVALID = object()  # a JSON Lines row that could not be read (counted)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only a row holding one can decode to a lone surrogate
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads has joined every valid pair already


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
    # Conversations (`burst prepare --chat`): rows that are not one, each refused whole.
    missing_messages: int = 0  # rows with neither `messages` nor `prompt` and `completion`
    malformed_messages: int = 0  # a message that is not an object with a string role and string content
    no_answer: int = 0  # no assistant turn (or none the chat template renders as an answer)
    empty_answers: int = 0  # an assistant turn with no text
    template_errors: int = 0  # the chat template raised on the conversation
    unplaced_answers: int = 0  # the template renders the conversation's start otherwise than the whole's
    unsupported_tool_calls: int = 0  # tool calls, which the template does not render
    conversations: bool = False  # what the read expects: conversations, or documents
    examples: dict[str, list[str]] = field(default_factory=dict)

    def count(self, problem: str, where: str) -> None:
        setattr(self, problem, getattr(self, problem) + 1)
        places = self.examples.setdefault(problem, [])
        if len(places) < MAX_EXAMPLES:
            places.append(where)

    def problems(self) -> dict[str, int]:
        """Each kind of bad input the read can meet and how often it occurred (zeros included)."""
        return {name: getattr(self, name) for name in
                (CONVERSATION_PROBLEMS if self.conversations else DOCUMENT_PROBLEMS)}


def find_input_files(inputs: Sequence[str | Path], report: InputReport) -> list[Path]:
    """The files to read, in a stable order: each input file, and each directory searched recursively.

    A file named explicitly is read as text unless it is JSON Lines or Parquet (and refused if it is
    binary); inside directories only known suffixes are read and the rest are counted as skipped.
    Conversations (report.conversations) are rows of JSON Lines or Parquet only: a text file named
    explicitly is refused, one inside a directory counted as skipped.
    A file reached twice (`DIR DIR`, or a file and its directory) is refused: it would be stored twice,
    and could land in both splits.
    """
    files: list[Path] = []
    given_by: dict[Path, Path] = {}  # each file, resolved -> the input that reached it
    for item in map(Path, inputs):
        if item.is_dir():
            found = []
            for path in _files_under(item, report):
                if kind_of(path) == "unsupported" or report.conversations and kind_of(path) == "text":
                    report.count("skipped_files", str(path))
                else:
                    found.append(path)
        elif item.is_file():
            if report.conversations and kind_of(item) not in ("jsonl", "parquet"):
                raise ValueError(f"input {item} is not JSON Lines or Parquet: --chat reads conversations, one per "
                                 f"row of a .jsonl(.gz) or .parquet file (a `messages` list, or `prompt` and "
                                 f"`completion`); prepare documents in a store of their own, without --chat")
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
        raise ImportError("reading .parquet inputs needs pyarrow: pip install 'burst-attention[parquet]' "
                          "(or pass other inputs)")
    return files


def _files_under(directory: Path, report: InputReport) -> list[Path]:
    """Every file under `directory`, sorted (symbolic links to directories are not followed, as rglob does not);
    a subdirectory that cannot be listed (no permission) is counted as unreadable, not skipped in silence."""
    def unreadable(error: OSError) -> None:
        report.count("unreadable_files", f"{error.filename}: {error.strerror}")

    found = []
    for root, _, names in os.walk(directory, onerror=unreadable):
        found += [path for path in (Path(root) / name for name in names) if path.is_file()]
    return sorted(found)


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
    """Reads the documents of `files` in order, counting bad input in `report`.

    `parts()` yields each document's text in bounded parts; iterating yields the parts' texts alone (what
    training a tokenizer needs). `bytes_read` follows the position on disk, for a progress bar.
    """

    # A row that is not UTF-8 is kept with U+FFFD where its bad bytes were (a document, a conversation), or left
    # out whole (a preference pair: a replaced character in one answer alone would be a preference to learn).
    keeps_invalid_utf8 = True

    def __init__(self, files: Sequence[Path], report: InputReport, text_field: str = "text") -> None:
        self.files, self.report, self.text_field = list(files), report, text_field
        self.bytes_read = 0

    def __iter__(self) -> Iterator[str]:
        for text, _ in self.parts():
            yield text

    def parts(self) -> Iterator[tuple[str, bool]]:
        """(text, ends_document) for every document in order: its text in one or more consecutive parts, the
        last with ends_document True. A file that breaks off part-way ends the document it was reading there."""
        document_open = False
        for item in self._each_file(self._file_parts):
            if item is None:  # the file broke off
                if document_open:
                    yield "", True  # what was read of it is kept, as the rows before a cut are
                document_open = False
                continue
            document_open = not item[1]
            yield item

    def _each_file(self, read: Callable[[Path, int], Iterator[Item]]) -> Iterator[Item | None]:
        """What `read(path, size)` yields for every file in order, then None after a file that broke off part-way
        (counted as unreadable; what it gave before is kept)."""
        for path in self.files:
            self.report.files += 1
            size = path.stat().st_size
            done_before = self.bytes_read
            try:
                yield from read(path, size)
            except (OSError, EOFError, zlib.error, ValueError) as error:  # gzip and pyarrow errors included
                self.report.count("unreadable_files", f"{path}: {error}")
                yield None
            self.bytes_read = done_before + size

    def _file_parts(self, path: Path, size: int) -> Iterator[tuple[str, bool]]:
        kind = kind_of(path)
        if kind == "jsonl":
            return self._jsonl(path)
        if kind == "parquet":
            return self._parquet(path, size)
        return self._text(path)

    def _text(self, path: Path) -> Iterator[tuple[str, bool]]:
        """A text file, block by block: decoded incrementally, counted once as invalid UTF-8 when it is not."""
        where = str(path)
        if _blank(path):
            self.report.count("empty_documents", where)
            return
        self.report.documents += 1
        strict, lenient = codecs.getincrementaldecoder("utf-8")(), codecs.getincrementaldecoder("utf-8")("replace")
        valid, start = True, self.bytes_read
        with open(path, "rb") as f:
            block = f.read(BLOCK_BYTES)
            while True:
                following = f.read(BLOCK_BYTES)
                last = not following
                if valid:
                    try:
                        strict.decode(block, final=last)
                    except UnicodeDecodeError:
                        valid = False
                        self.report.count("invalid_utf8", where)
                self.bytes_read = start + f.tell() - len(following)
                yield lenient.decode(block, final=last), last
                if last:
                    return
                block = following

    def _jsonl(self, path: Path) -> Iterator[tuple[str, bool]]:
        for row, number in self._json_rows(path):
            where = row_place(path, number)
            text = row.get(self.text_field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                self.report.count("missing_text_field", where)
                continue
            del row
            yield from self._accept(text, where)

    def _json_rows(self, path: Path) -> Iterator[tuple[Any, int]]:
        """Every row of a JSON Lines file (plain or gzip) and its line number; invalid JSON is counted."""
        with open(path, "rb") as raw:
            lines = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
            start = self.bytes_read
            for line_number, line in enumerate(lines, 1):
                self.bytes_read = start + raw.tell()
                if not line.strip():
                    continue  # blank lines are layout, not records
                where = row_place(path, line_number)
                try:
                    row = self._parse_row(line, line_number == 1, where)
                finally:
                    del line  # a long row's bytes are not kept while its text is passed on
                if row is not _INVALID:
                    yield row, line_number
                del row

    def _parse_row(self, line: bytes, first: bool, where: str) -> Any:
        """The row a JSON Lines line holds, or _INVALID (counted): not JSON, or nested past what Python's parser
        can follow. A UTF-8 byte order mark before the first row is not part of it; bytes that are not UTF-8, or
        a lone surrogate escape ("\\ud800", which no UTF-8 text can hold), are counted as invalid UTF-8 and
        replaced with U+FFFD, or the row is _INVALID where the reader does not keep such rows."""
        if first and line.startswith(codecs.BOM_UTF8):
            line = line[len(codecs.BOM_UTF8):]
        try:
            text = self._decode(line, where)
            if text is None:
                return _INVALID
            row = json.loads(text)
        except json.JSONDecodeError:
            self.report.count("invalid_json", where)
            return _INVALID
        except RecursionError:
            self.report.count("invalid_json", f"{where} (nested too deeply to read)")
            return _INVALID
        if _SURROGATE_ESCAPE.search(line):
            row, replaced = _without_surrogates(row)
            if replaced:
                self.report.count("invalid_utf8", f"{where} (a lone surrogate escape)")
                if not self.keeps_invalid_utf8:
                    return _INVALID
        return row

    def _parquet(self, path: Path, size: int) -> Iterator[tuple[str, bool]]:
        def needed(columns: list[str]) -> list[str]:
            if self.text_field not in columns:
                raise ValueError(f"no column {self.text_field!r} (columns: {columns}); choose one with --text-field")
            return [self.text_field]

        for row, number in self._parquet_rows(path, size, needed):
            where = row_place(path, number)
            text = row[self.text_field]
            if not isinstance(text, str):
                self.report.count("missing_text_field", where)
                continue
            yield from self._accept(text, where)

    def _parquet_rows(self, path: Path, size: int, needed: Callable[[list[str]], list[str]]
                      ) -> Iterator[tuple[dict[str, Any], int]]:
        """Every row of a Parquet file as {column: value} over the columns `needed(all columns)` names (it raises
        ValueError when the file lacks what it needs), and its row number."""
        import pyarrow.parquet as pq  # optional dependency, checked by find_input_files

        table = pq.ParquetFile(path)
        columns = needed(table.schema_arrow.names)
        rows, start = max(table.metadata.num_rows, 1), self.bytes_read
        row_number = 0
        for batch in table.iter_batches(columns=columns):
            for row in batch.to_pylist():
                row_number += 1
                yield row, row_number
            self.bytes_read = start + size * row_number // rows

    def _decode(self, data: bytes, where: str) -> str | None:
        """`data` as text; not UTF-8, counted, then replaced with U+FFFD, or None where such rows are left out."""
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            self.report.count("invalid_utf8", where)
            return data.decode("utf-8", errors="replace") if self.keeps_invalid_utf8 else None

    def _accept(self, text: str, where: str) -> Iterator[tuple[str, bool]]:
        if not text or text.isspace():
            self.report.count("empty_documents", where)
            return
        self.report.documents += 1
        for start in range(0, len(text), PART_CHARS):
            yield text[start:start + PART_CHARS], start + PART_CHARS >= len(text)


def row_place(path: str | Path, number: int) -> str:
    """Where a row is, as reports name it: path:line of a JSON Lines file, path: row N of a Parquet file."""
    return f"{path}: row {number}" if kind_of(Path(path)) == "parquet" else f"{path}:{number}"


def _blank(path: Path) -> bool:
    """Whether the text file `path` holds nothing but whitespace; reads no further than its first other character."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            text = decoder.decode(block)
            if text and not text.isspace():
                return False
    tail = decoder.decode(b"", final=True)
    return not tail or tail.isspace()


def _without_surrogates(value: Any) -> tuple[Any, bool]:
    """`value` (a parsed JSON row) with every lone surrogate replaced by U+FFFD, and whether there was one; walked
    with a stack, not recursion, as the row may be nested as deep as Python's parser allows."""
    def clean(item: Any) -> Any:
        nonlocal replaced
        if isinstance(item, str) and _LONE_SURROGATE.search(item):
            replaced = True
            return _LONE_SURROGATE.sub("\ufffd", item)
        return item

    replaced = False
    value = clean(value)
    stack = [value] if isinstance(value, dict | list) else []
    while stack:
        container = stack.pop()
        keys = range(len(container)) if isinstance(container, list) else list(container)
        for key in keys:
            item = container[key]
            if isinstance(key, str) and _LONE_SURROGATE.search(key):
                del container[key]
                key = clean(key)
            container[key] = clean(item)
            if isinstance(item, dict | list):
                stack.append(item)
    return value, replaced
