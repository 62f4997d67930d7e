"""Reading conversations for `burst prepare --chat`: one per row of JSON Lines (plain or .gz) or Parquet.

A row holds either `messages`, a list of {"role": ..., "content": ...} in the OpenAI and Hugging Face chat
format (roles as the chat template knows them: system, user, assistant, tool, ...; other keys are passed to
the template as they are), or `prompt` and `completion`: two strings (a user turn and the assistant's answer),
or two lists of messages (the conversation so far, then the answer turns), as TRL's prompt-completion data.

A row that is not a conversation is counted by kind in the InputReport and left out whole, never cut:
neither messages nor prompt and completion (missing_messages); a message that is not an object with a
non-empty string role and a string content (malformed_messages); no assistant turn (no_answer); an
assistant turn with no text (empty_answers); a template that raises on it (template_errors). The
conversation is rendered here (data/chat.py), so that every row's problems are counted in one place.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.chat import ChatFormat, ChatTemplateError, Rendered
from data.sources import DocumentReader, InputReport, kind_of, row_place

FIELDS = ("messages", "prompt", "completion")
ASSISTANT = "assistant"


@dataclass
class ConversationRow:
    """A conversation read and rendered: its text and answers' spans, and where it came from."""

    rendered: Rendered
    file: int  # index into the reader's files
    row: int  # line of a JSON Lines file, row of a Parquet file (1-based)


def messages_of(row: Any) -> list[dict[str, Any]] | str:
    """The row's messages, or the name of the problem (an InputReport field) that makes it no conversation."""
    if not isinstance(row, dict):
        return "missing_messages"
    if row.get("messages") is not None:
        messages = row["messages"]
    elif row.get("prompt") is not None and row.get("completion") is not None:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [{"role": "user", "content": prompt}, {"role": ASSISTANT, "content": completion}]
        elif isinstance(prompt, list) and isinstance(completion, list):
            messages = prompt + completion
        else:
            return "malformed_messages"
    else:
        return "missing_messages"
    if not isinstance(messages, list) or not messages:
        return "malformed_messages"
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and message["role"]
                and isinstance(message.get("content"), str)):
            return "malformed_messages"
    answers = [message["content"] for message in messages if message["role"] == ASSISTANT]
    if not answers:
        return "no_answer"
    if any(not answer.strip() for answer in answers):
        return "empty_answers"
    # Keys whose value is null are left out, as transformers leaves them out (templates test for presence).
    return [{key: value for key, value in message.items() if value is not None} for message in messages]


class ConversationReader(DocumentReader):
    """Reads the conversations of `files` in order, each rendered with `chat`, counting bad rows in `report`."""

    def __init__(self, files: list[Path], report: InputReport, chat: ChatFormat) -> None:
        super().__init__(files, report)
        self.chat = chat
        report.conversations = True

    def conversations(self) -> Iterator[ConversationRow]:
        for row in self._each_file(self._file_conversations):
            if row is not None:
                yield row

    def _file_conversations(self, path: Path, size: int) -> Iterator[ConversationRow]:
        def needed(columns: list[str]) -> list[str]:
            present = [name for name in FIELDS if name in columns]
            if "messages" not in present and not {"prompt", "completion"} <= set(present):
                raise ValueError(f"no column 'messages', nor 'prompt' and 'completion' (columns: {columns}); "
                                 f"--chat reads conversations in the OpenAI / Hugging Face chat format")
            return present

        rows = self._json_rows(path) if kind_of(path) == "jsonl" else self._parquet_rows(path, size, needed)
        file = self.files.index(path)
        for row, number in rows:
            where = row_place(path, number)
            messages = messages_of(row)
            if isinstance(messages, str):
                self.report.count(messages, where)
                continue
            try:
                rendered = self.chat.render(messages)
            except ChatTemplateError as err:
                self.report.count("template_errors", f"{where}: {err}")
                continue
            if not rendered.spans:
                self.report.count("no_answer", where)
                continue
            self.report.documents += 1
            yield ConversationRow(rendered, file, number)
