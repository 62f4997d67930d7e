"""Preference pairs read from the inputs of `burst prepare --preference`, rendered into a preference store.

Each row of a JSON Lines (plain or .gz) or Parquet file is one pair in the format TRL and the Hugging Face
preference datasets use: `prompt` (a string: one user turn; or a list of messages: the conversation so far),
`chosen` and `rejected` (strings: one assistant turn each; or lists of messages, the answer turns). The pair is
rendered with the tokenizer's chat template as conversations are (data/chat.py): the prompt with the generation
prompt, and prompt + each answer without it. The answer's ids are what prompt + answer adds after the prompt's
ids, up to its last scored token (the answer and its end-of-turn token; what a template writes after it, such as
the plain template's blank line, is left out). So the prompt's ids must be the first ids of both renderings; a
template that renders them otherwise splits the prompt and the row is refused (split_prompts).

A row that is not a pair is left out whole and counted by kind in the PreferenceReport, with its first places:
no `prompt`, `chosen` or `rejected` (missing_fields); a prompt or answer that is neither a string nor a list of
messages with string roles and contents, or an answer list without an assistant turn (malformed_messages); an
answer with no text (empty_answers); two answers with the same ids, which say nothing of a preference
(identical_answers); whatever the template cannot render as `--chat` counts it (data/chat.py's ConversationRefused:
template_errors, unplaced_answers, unsupported_tool_calls, no_answer); the prompt split (split_prompts).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data.chat import ChatFormat, ConversationRefused, Rendered
from data.sources import DocumentReader, InputReport, kind_of, row_place
from data.store import StoreWriter

FIELDS = ("prompt", "chosen", "rejected")
ASSISTANT = "assistant"
PREFERENCE_PROBLEMS = ("skipped_files", "unreadable_files", "invalid_json", "invalid_utf8", "missing_fields",
                       "malformed_messages", "empty_answers", "identical_answers", "template_errors",
                       "unplaced_answers", "unsupported_tool_calls", "no_answer", "split_prompts")


@dataclass
class PreferenceReport(InputReport):
    """An InputReport with the kinds of bad input a preference row can have."""

    missing_fields: int = 0  # no prompt, chosen or rejected
    identical_answers: int = 0  # chosen and rejected render to the same ids
    split_prompts: int = 0  # the template does not render the prompt as the start of prompt + answer

    def __post_init__(self) -> None:
        self.conversations = True  # rows of JSON Lines or Parquet only, as conversations are

    def problems(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in PREFERENCE_PROBLEMS}


@dataclass
class PairRow:
    """A pair read and rendered: the prompt (with the generation prompt), prompt + chosen, prompt + rejected."""

    prompt: Rendered
    chosen: Rendered
    rejected: Rendered
    file: int  # index into the reader's files
    row: int  # line of a JSON Lines file, row of a Parquet file (1-based)
    where: str


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"] and isinstance(m.get("content"), str)
        for m in value)


def _clean(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keys whose value is null left out, as transformers leaves them out (templates test for presence)."""
    return [{key: value for key, value in message.items() if value is not None} for message in messages]


def messages_of(row: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]] | str:
    """The row's (prompt, chosen, rejected) messages, or the name of the problem (a PreferenceReport field)."""
    if not isinstance(row, dict) or any(row.get(name) is None for name in FIELDS):
        return "missing_fields"
    prompt = [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else row["prompt"]
    answers = [[{"role": ASSISTANT, "content": row[name]}] if isinstance(row[name], str) else row[name]
               for name in ("chosen", "rejected")]
    if not _is_messages(prompt) or not all(_is_messages(a) and any(m["role"] == ASSISTANT for m in a)
                                           for a in answers):
        return "malformed_messages"
    if any(not m["content"].strip() for a in answers for m in a if m["role"] == ASSISTANT):
        return "empty_answers"
    return _clean(prompt), _clean(answers[0]), _clean(answers[1])


class PreferenceReader(DocumentReader):
    """Reads the pairs of `files` in order, each rendered with `chat`, counting bad rows in `report`."""

    keeps_invalid_utf8 = False  # a pair with bad bytes is left out whole

    def __init__(self, files: list[Path], report: PreferenceReport, chat: ChatFormat) -> None:
        super().__init__(files, report)
        self.chat = chat

    def pairs(self) -> Iterator[PairRow]:
        for row in self._each_file(self._file_pairs):
            if row is not None:
                yield row

    def _file_pairs(self, path: Path, size: int) -> Iterator[PairRow]:
        def needed(columns: list[str]) -> list[str]:
            if not set(FIELDS) <= set(columns):
                raise ValueError(f"no columns {', '.join(FIELDS)} (columns: {columns}); --preference reads "
                                 f"preference pairs in TRL's format")
            return list(FIELDS)

        rows = self._json_rows(path) if kind_of(path) == "jsonl" else self._parquet_rows(path, size, needed)
        file = self.files.index(path)
        for row, number in rows:
            where = row_place(path, number)
            messages = messages_of(row)
            if isinstance(messages, str):
                self.report.count(messages, where)
                continue
            prompt, chosen, rejected = messages
            try:
                rendered = Rendered(*self.chat.render_text(prompt, add_generation_prompt=True))
                pair = PairRow(rendered, self.chat.render(prompt + chosen), self.chat.render(prompt + rejected),
                               file, number, where)
            except ConversationRefused as err:  # one row the template cannot render: the read goes on
                self.report.count(err.problem, f"{where}: {err}")
                continue
            yield pair


def answer_ids(prompt: np.ndarray, ids: np.ndarray, scored: np.ndarray) -> np.ndarray | None:
    """The ids prompt + answer (`ids`, its answers' tokens `scored`) adds after `prompt`, through its last scored
    token; None when `prompt` is not where it starts."""
    if len(ids) <= len(prompt) or not np.array_equal(ids[:len(prompt)], prompt):
        return None
    last = np.flatnonzero(scored[len(prompt):])
    return ids[len(prompt):len(prompt) + (int(last[-1]) + 1 if len(last) else len(ids) - len(prompt))]


def encode_pairs(rows: list[PairRow], chat: ChatFormat, report: InputReport,
                 writer: StoreWriter) -> None:
    """Encode `rows` (one batch of the template's texts) and append each good pair to the store: prompt + chosen +
    rejected ids, with its (prompt, chosen) token counts; split prompts and identical answers counted."""
    encoded = chat.encode([r for row in rows for r in (row.prompt, row.chosen, row.rejected)])
    documents, pairs, places = [], [], []
    for i, row in enumerate(rows):
        (prompt, _), *answers = encoded[3 * i:3 * i + 3]
        chosen, rejected = (answer_ids(prompt, ids, scored) for ids, scored in answers)
        if chosen is None or rejected is None or not len(prompt):
            report.count("split_prompts", row.where)
        elif np.array_equal(chosen, rejected):
            report.count("identical_answers", row.where)
        else:
            report.documents += 1
            documents.append(np.concatenate([prompt, chosen, rejected]))
            pairs.append((len(prompt), len(chosen)))
            places.append((row.file, row.row))
    writer.append(documents, rows=places, pairs=pairs)
