"""`burst prepare`: read a corpus, tokenize it on every core, and write a token store.

The store directory follows runtime/directories.py: one prepare writes it at a time (another is
refused, naming it), it is built in a temporary sibling (`DIR.tmp-*`, which the next prepare removes
if this one is killed) and renamed to DIR only when complete, with metadata.json written last, so an
interrupted prepare never leaves a directory that looks like a store; `--force` replaces only a token
store. Input is read and encoded in bounded pieces (data/sources.py, data/pieces.py) and tokens go to
disk chunk by chunk, so memory stays flat for any corpus size and any document length.

With `chat`, the inputs are conversations (data/conversations.py), rendered with the tokenizer's chat template
or burst's plain one (data/chat.py), and the store is an instruction store: each conversation whole, with its
answers marked (data/store.py). With `preference`, the rows are preference pairs (data/preference.py), rendered
the same way, and the store a preference store: each pair's prompt, chosen and rejected ids.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Group
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from data.chat import ChatFormat
from data.conversations import ConversationReader, ConversationRow
from data.pieces import DocumentCutter, Piece
from data.preference import PairRow, PreferenceReader, PreferenceReport, encode_pairs
from data.sources import DocumentReader, InputReport, find_input_files
from data.store import StoreWriter, TokenStore, token_dtype
from data.tokenizer import SPM_FILE, Tokenizer
from data.tokenizer_files import load_tokenizer, tokenizer_beside
from data.tokenizer_spm import train_tokenizer
from runtime.console import make_console
from runtime.directories import exclusive_writer
from runtime.failure import writing
from runtime.launch import available_cores

DEFAULT_VOCAB_SIZE = 32_000
DEFAULT_TEXT_FIELD = "text"
MAX_VOCAB_SIZE = 2**20  # well past any LLaMA-family vocabulary (128,256); more is a typo, not a plan
LONG_DOCUMENT_TOKENS = (8_192, 16_384, 32_768, 65_536, 131_072)  # common sequence lengths
PREFERENCE_HINT = "give each row `prompt`, `chosen` and `rejected` (TRL's format: strings, or lists of messages)"
SPLIT_PROMPTS_HINT = ("; split prompts are rows whose prompt's ids are not the start of prompt + answer's ids as the "
                      "tokenizer encodes the chat template's text (a token merges across the prompt's end)")
CHUNK_CHARS = 4_000_000  # text per encode call: enough work for every core, little memory


@dataclass
class PrepareSummary:
    """What `prepare` wrote and what it found in the input."""

    out_dir: Path
    num_documents: int
    num_train_documents: int
    num_val_documents: int
    num_tokens: int
    vocab_size: int
    length_min: int  # document lengths in tokens, BOS/EOS not counted
    length_median: int
    length_p90: int
    length_max: int
    documents_at_least: dict[int, int]  # {sequence length: documents with at least that many tokens}
    report: InputReport
    seconds: float
    num_scored_tokens: int | None = None  # an instruction store's answer tokens; None: a store of documents


def prepare(inputs: Sequence[str | Path], out_dir: str | Path, *, tokenizer: str | Path | None = None,
            vocab_size: int | None = None, text_field: str | None = None, val_fraction: float = 0.01,
            workers: int | None = None, seed: int = 0, force: bool = False, progress: bool = True,
            chat: bool = False, preference: bool = False) -> PrepareSummary:
    """Tokenize `inputs` (files or directories) into a token store at `out_dir`.

    With `tokenizer` (a Hugging Face tokenizer.json, a SentencePiece .model, or a model directory holding
    one) its ids are used; otherwise a SentencePiece tokenizer of `vocab_size` (default 32,000) is trained
    on the corpus. `text_field` names a row's text (default "text"). With `chat`, the rows are conversations
    and the store an instruction store (`tokenizer` required: conversations are rendered for a model that
    exists); with `preference`, the rows are preference pairs and the store a preference store (`tokenizer`
    required too). `val_fraction` of the documents, chosen with `seed`, form the validation split. Prints a
    progress bar and a summary table unless `progress` is False. An existing `out_dir` is replaced only with
    `force`, and only when it is a token store; while another process writes `out_dir` this one is refused
    (DirectoryBusy). A write that fails during the work (disk full) raises WriteFailed; `out_dir` is then as
    it was.
    """
    started = time.perf_counter()
    out_dir = Path(out_dir)
    if preference and (chat or tokenizer is None):
        raise ValueError("--preference renders preference pairs for the model they will tune: pass its tokenizer "
                         "with --tokenizer" if tokenizer is None else "pass either --chat (conversations) or "
                         "--preference (preference pairs), not both")
    _check_arguments(inputs, out_dir, tokenizer, vocab_size, val_fraction, seed, force, chat or preference,
                     text_field, workers)
    text_field = text_field or DEFAULT_TEXT_FIELD
    console = make_console(quiet=not progress)
    with exclusive_writer(out_dir, "store") as directory:
        directory.check_replaceable(force, older=_is_token_store)  # before the inputs are even listed
        report = PreferenceReport() if preference else InputReport(conversations=chat)
        files = find_input_files(inputs, report)
        if not files:
            raise ValueError(no_documents_message(inputs, report))
        kept = f"; {out_dir} is as it was before" if out_dir.exists() else f"; {out_dir} was not created"
        source = load_tokenizer(tokenizer) if tokenizer is not None else None  # refused here if not a tokenizer
        # A template that cannot work is refused here, naming the user's file, before anything is written.
        chat_format = ChatFormat(source) if chat or preference else None
        with directory.staging() as work_dir, writing(out_dir, kept):
            with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                          TimeRemainingColumn(), console=console) as bar:
                tok = _tokenizer_for(files, work_dir, source, vocab_size, text_field, seed, bar)
                writer = StoreWriter(work_dir, token_dtype(tok.vocab_size), conversations=chat, preferences=preference)
                hard_cuts = 0  # a conversation is never cut
                try:
                    if preference:
                        _tokenize_pairs(PreferenceReader(files, report, chat_format), chat_format, writer, bar)
                    elif chat_format is not None:
                        bar.console.print("conversations rendered with " + (
                            "burst's plain template (the tokenizer has no chat template)" if chat_format.is_plain
                            else f"the chat template in {chat_format.where}"))
                        _tokenize_conversations(ConversationReader(files, report, chat_format), chat_format, writer,
                                                bar)
                    else:
                        hard_cuts = _tokenize(DocumentReader(files, report, text_field), tok, writer, workers, bar)
                finally:
                    writer.close()
            if writer.num_documents == 0:
                raise ValueError(no_documents_message(inputs, report))
            val_documents = _choose_val_documents(writer.num_documents, val_fraction, seed)
            conversations = {"preference_files" if preference else "conversation_files": [str(f) for f in files],
                             "chat": chat_format.metadata()} if chat_format is not None else {"text_field": text_field}
            writer.finish(val_documents, {
                "tokenizer": tok.metadata(),
                "split": {"val_fraction": val_fraction, "seed": seed},
                "inputs": [str(i) for i in inputs], **conversations,
                "input_report": {"files": report.files, "documents": report.documents, **report.problems()}})
    summary = _summarize(TokenStore(out_dir), report, time.perf_counter() - started)
    if hard_cuts:
        console.print(f"[yellow]warning:[/] {hard_cuts:,} cuts inside long documents found no token boundary "
                      f"nearby: the token ids next to them may differ from encoding the document whole")
    console.print(summary_table(summary), soft_wrap=True)  # soft: an example path stays whole on its line
    return summary


def _is_token_store(path: Path) -> bool:
    """Whether `path` is a complete token store: one from a burst that did not mark its directories yet is
    replaced with --force as a marked one is."""
    try:
        TokenStore(path)
    except (OSError, ValueError):
        return False
    return True


def no_documents_message(inputs: Sequence[str | Path], report: InputReport) -> str:
    """What to say when the inputs hold no document at all, naming the likeliest fix."""
    problems = {name: count for name, count in report.problems().items() if count}
    found = ", ".join(f"{count} {name.replace('_', ' ')} (e.g. {report.examples[name][0]})"
                      for name, count in problems.items())
    hint = PREFERENCE_HINT + (SPLIT_PROMPTS_HINT if report.split_prompts else "") \
        if isinstance(report, PreferenceReport) else \
        "choose the field that holds the text with --text-field" if report.missing_text_field else \
        "give each row `messages` ([{role, content}, ...] with an assistant turn), or `prompt` and `completion`" \
        if report.conversations and report.files else \
        "pass .jsonl(.gz) or .parquet files of conversations, or directories holding them" if report.conversations \
        else "pass text or source files, .jsonl(.gz) or .parquet, or directories holding them"
    return (f"no documents to store in {', '.join(map(str, inputs))}: {report.files} files read"
            + (f"; found {found}" if found else "") + f"; {hint}")


def _check_arguments(inputs: Sequence[str | Path], out_dir: Path, tokenizer: str | Path | None,
                     vocab_size: int | None, val_fraction: float, seed: int, force: bool, chat: bool,
                     text_field: str | None, workers: int | None) -> None:
    """Refuse bad arguments before any work is done."""
    if not inputs:
        raise ValueError("no inputs given; pass files or directories to tokenize")
    blocking = next((parent for parent in out_dir.absolute().parents if parent.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ValueError(f"--out {out_dir}: {blocking} is a file, not a directory; choose an --out inside a "
                         f"directory")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers {workers} must be 1 or more (the SentencePiece encoding threads); leave it out "
                         f"to use every core")
    if chat and tokenizer is None:
        raise ValueError("--chat renders conversations for the model they will fine-tune: pass its tokenizer with "
                         "--tokenizer (its tokenizer.json, a model directory, or the token store it was trained on)")
    if chat and text_field is not None:
        raise ValueError(f"--text-field {text_field} names the text of a document; --chat reads conversations from "
                         f"`messages`, or `prompt` and `completion`: drop --text-field")
    if tokenizer is not None and vocab_size is not None:
        raise ValueError("pass either --tokenizer (use an existing model) or --vocab-size (train one), not both")
    if vocab_size is not None and not 300 <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"--vocab-size {vocab_size:,} must be between 300 (byte fallback alone takes 259 ids) and "
                         f"{MAX_VOCAB_SIZE:,}; LLaMA-2 uses 32,000, LLaMA-3 128,256")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction} must be in [0, 1), e.g. 0.01")
    if not 0 <= seed < 2**32:
        raise ValueError(f"--seed {seed} must be between 0 and 2^32 - 1")
    if force and out_dir.exists():
        resolved = out_dir.resolve()
        for item in map(Path, inputs):
            if item.resolve() == resolved or resolved in item.resolve().parents:
                raise ValueError(f"input {item} lies inside --out {out_dir}, which --force would delete; "
                                 f"choose another --out")


def _tokenizer_for(files: list[Path], directory: Path, source: Tokenizer | None, vocab_size: int | None,
                   text_field: str, seed: int, bar: Progress) -> Tokenizer:
    """Copy the given tokenizer's files into the store directory, or train a SentencePiece model on the corpus
    there; the tokenizer as loaded from the store."""
    if source is not None:
        for name, path in source.files.items():
            shutil.copyfile(path, directory / name)
        bar.console.print(f"tokenizer: {source.kind}, {', '.join(map(str, source.files.values()))}, vocabulary "
                          f"{source.vocab_size:,}, BOS {source.bos_id}, EOS {source.eos_id}")
        return tokenizer_beside(directory, prefer=source.kind)
    started, wanted = time.perf_counter(), vocab_size or DEFAULT_VOCAB_SIZE
    bar.console.print(f"training a tokenizer (vocabulary {wanted:,}) on {len(files):,} files")
    report = InputReport()  # problems are reported from the main pass, unless there is no text at all
    reader = DocumentReader(files, report, text_field)
    if next(iter(reader), None) is None:
        raise ValueError(no_documents_message([str(f) for f in files], report))
    tok = train_tokenizer(reader, directory / SPM_FILE, wanted, seed=seed)
    bar.console.print(f"trained the tokenizer in {time.perf_counter() - started:.1f} s")
    if tok.vocab_size < wanted:
        bar.console.print(f"[yellow]warning:[/] the corpus gave a vocabulary of {tok.vocab_size:,} tokens, not the "
                          f"{wanted:,} asked for (too little text for more); the store uses {tok.vocab_size:,}")
    return tok


def _tokenize(reader: DocumentReader, tok: Tokenizer, writer: StoreWriter, workers: int | None,
              bar: Progress) -> int:
    """Encode the documents piece by piece (data/pieces.py), CHUNK_CHARS at a time on `workers` threads, appending
    them to the store in order. Returns how many cuts found no token boundary (DocumentCutter.hard_cuts)."""
    task = bar.add_task("tokenizing", total=sum(p.stat().st_size for p in reader.files))
    threads = workers or available_cores()
    cutter = DocumentCutter(tok.encode)
    batch: list[Piece] = []
    chars = 0

    def flush() -> None:
        encoded = tok.encode_batch([piece.text for piece in batch], threads)
        writer.append(list(cutter.piece_ids(batch, encoded)), [piece.ends_document for piece in batch])
        batch.clear()
        bar.update(task, completed=reader.bytes_read,
                   description=f"tokenizing: {writer.num_documents:,} documents, {writer.num_tokens:,} tokens")

    for text, ends_document in reader.parts():
        for piece in cutter.feed(text, ends_document):
            batch.append(piece)
            chars += len(piece.text)
        if chars >= CHUNK_CHARS:
            flush()
            chars = 0
    if batch:
        flush()
    return cutter.hard_cuts


def _tokenize_conversations(reader: ConversationReader, chat: ChatFormat, writer: StoreWriter, bar: Progress) -> None:
    """Encode the conversations CHUNK_CHARS of text at a time (a template's on the tokenizer's threads) and append
    them whole, with their answers' masks, to the store."""
    task = bar.add_task("tokenizing", total=sum(p.stat().st_size for p in reader.files))
    batch: list[ConversationRow] = []

    def flush() -> None:
        encoded = chat.encode([row.rendered for row in batch])
        writer.append([ids for ids, _ in encoded], scored=[scored for _, scored in encoded],
                      rows=[(row.file, row.row) for row in batch])
        batch.clear()
        bar.update(task, completed=reader.bytes_read, description=f"tokenizing: {writer.num_documents:,} "
                                                                  f"conversations, {writer.num_tokens:,} tokens")

    chars = 0
    for row in reader.conversations():
        batch.append(row)
        chars += len(row.rendered.text)
        if chars >= CHUNK_CHARS:
            flush()
            chars = 0
    if batch:
        flush()


def _tokenize_pairs(reader: PreferenceReader, chat: ChatFormat, writer: StoreWriter, bar: Progress) -> None:
    """Encode the pairs CHUNK_CHARS of text at a time and append the good ones whole to the store."""
    task = bar.add_task("tokenizing", total=sum(p.stat().st_size for p in reader.files))
    batch: list[PairRow] = []
    chars = 0
    for row in reader.pairs():
        batch.append(row)
        chars += len(row.chosen.text) + len(row.rejected.text)
        if chars >= CHUNK_CHARS:
            encode_pairs(batch, chat, reader.report, writer)
            batch, chars = [], 0
            bar.update(task, completed=reader.bytes_read, description=f"tokenizing: {writer.num_documents:,} pairs")
    encode_pairs(batch, chat, reader.report, writer)


def _choose_val_documents(num_documents: int, val_fraction: float, seed: int) -> np.ndarray:
    """Sorted ids of the validation documents: at least one when asked for any, never all of them."""
    if val_fraction == 0 or num_documents < 2:
        return np.zeros(0, np.int64)
    count = min(max(round(num_documents * val_fraction), 1), num_documents - 1)
    return np.sort(np.random.default_rng(seed).choice(num_documents, count, replace=False))


def _summarize(store: TokenStore, report: InputReport, seconds: float) -> PrepareSummary:
    lengths = store.document_lengths
    return PrepareSummary(
        out_dir=store.directory, num_documents=store.num_documents,
        num_train_documents=store.num_documents - store.metadata["num_val_documents"],
        num_val_documents=store.metadata["num_val_documents"], num_tokens=store.num_tokens,
        vocab_size=store.vocab_size, length_min=int(lengths.min()), length_median=int(np.median(lengths)),
        length_p90=int(np.percentile(lengths, 90)), length_max=int(lengths.max()),
        documents_at_least={n: int((lengths >= n).sum()) for n in LONG_DOCUMENT_TOKENS},
        report=report, seconds=seconds,
        num_scored_tokens=store.metadata["num_scored_tokens"] if store.is_conversations else None)


def summary_table(summary: PrepareSummary) -> Group:
    """The summary printed at the end of `burst prepare`: a two-column table that fits 80 columns, then one line
    per kind of bad input found, with the first place it was seen (print it with soft_wrap=True, as prepare does,
    and a path longer than the terminal stays whole on its line)."""
    table = Table(title=f"token store {summary.out_dir}", show_header=False, title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    what = "pairs" if isinstance(summary.report, PreferenceReport) else \
        "documents" if summary.num_scored_tokens is None else "conversations"
    table.add_row(what, f"{summary.num_documents:,} ({summary.num_train_documents:,} train, "
                        f"{summary.num_val_documents:,} val)")
    table.add_row("tokens", f"{summary.num_tokens:,} (vocabulary {summary.vocab_size:,})")
    if summary.num_scored_tokens is not None:
        table.add_row("scored tokens (answers)", f"{summary.num_scored_tokens:,} "
                                                 f"({summary.num_scored_tokens / summary.num_tokens:.1%})")
    table.add_row(f"tokens per {what[:-1]}", f"min {summary.length_min:,}  median {summary.length_median:,}  "
                                             f"p90 {summary.length_p90:,}  max {summary.length_max:,}")
    for length, count in summary.documents_at_least.items():
        table.add_row(f"{what} >= {length // 1024}K tokens", f"{count:,}")
    table.add_row("files read", f"{summary.report.files:,}")
    examples = []
    for problem, count in summary.report.problems().items():
        name = problem.replace("_", " ")
        table.add_row(name, f"{count:,}", style="yellow" if count else None)
        if count:
            examples.append(Text(f"{name}: {count:,}, e.g. {summary.report.examples[problem][0]}", style="yellow"))
    table.add_row("time", f"{summary.seconds:.1f} s")
    return Group(table, *examples)
