"""Reading conversations for `burst prepare --chat`: one per row of JSON Lines (plain or .gz) or Parquet.

A row holds either `messages`, a list of {"role": ..., "content": ...} in the OpenAI and Hugging Face chat
format (roles as the chat template knows them: system, user, assistant, tool, ...; other keys are passed to
the template as they are), or `prompt` and `completion`: two strings (a user turn and the assistant's answer),
or two lists of messages (the conversation so far, then the answer turns), as TRL's prompt-completion data.
An assistant message may call tools instead of (or besides) answering in text: `tool_calls`, a list, its
content then empty or absent, as transformers' templates take them; the row's `tools` (a list of the tools'
JSON schemas) reach the template as apply_chat_template's `tools=` does.

A row that is not a conversation is counted by kind in the InputReport and left out whole, never cut:
neither messages nor prompt and completion (missing_messages); a message that is not an object with a
non-empty string role and a string content (malformed_messages); no assistant turn (no_answer); an
assistant turn with no text and no tool call (empty_answers); a template that raises on it (template_errors),
that renders its answers empty (empty_answers), or elsewhere than the conversation's start renders them
(unplaced_answers), or that does not render tool calls when it has them (unsupported_tool_calls). The
conversation is rendered here (data/chat.py), so that every row's problems are counted in one place.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.chat import ChatFormat, ConversationRefused, Rendered
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
    return checked_messages(messages)


def checked_messages(messages: Any) -> list[dict[str, Any]] | str:
    """`messages` as the template is given them, or the name of the problem (an InputReport field) that makes them
    no conversation: a non-empty list of messages, each with a role and string content (an assistant's may be
    left out, or empty, when it calls tools), at least one assistant turn, none with neither text nor calls."""
    if not isinstance(messages, list) or not messages:
        return "malformed_messages"
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and message["role"]):
            return "malformed_messages"
        calls = message.get("tool_calls")
        if calls is not None and not (message["role"] == ASSISTANT and isinstance(calls, list)):
            return "malformed_messages"
        if not (isinstance(message.get("content"), str) or calls and message.get("content") is None):
            return "malformed_messages"
    answers = [message for message in messages if message["role"] == ASSISTANT]
    if not answers:
        return "no_answer"
    if any(not (message.get("content") or "").strip() and not message.get("tool_calls") for message in answers):
        return "empty_answers"
    # Keys whose value is null are left out, as transformers leaves them out (templates test for presence).
    return [{key: value for key, value in message.items() if value is not None} for message in messages]


def tools_of(row: dict[str, Any]) -> list[dict[str, Any]] | None | str:
    """The tools a row offers (its `tools`: a list of JSON schemas), None when it offers none, or
    "malformed_messages"."""
    tools = row.get("tools")
    if tools is None or isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools):
        return tools or None
    return "malformed_messages"


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
            rendered = self.render(row, where)
            if rendered is not None:
                self.report.documents += 1
                yield ConversationRow(rendered, file, number)

    def render(self, row: Any, where: str) -> Rendered | None:
        """The row's conversation rendered, or None when it is none (its problem counted at `where`)."""
        messages = messages_of(row)
        tools = tools_of(row) if not isinstance(messages, str) else None
        if isinstance(messages, str) or isinstance(tools, str):
            self.report.count(messages if isinstance(messages, str) else tools, where)
            return None
        try:
            return self.chat.render(messages, tools)
        except ConversationRefused as err:
            self.report.count(err.problem, f"{where}: {err}")
            return None
