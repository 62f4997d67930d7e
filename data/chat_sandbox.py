"""The jinja2 sandbox chat templates run in, set up as transformers sets up its own: trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, a `tojson` that does not escape HTML, `strftime_now`, restricted `dict` and
`namespace`, and `{% generation %}` blocks, whose spans a render records in its `Output` (data/chat.py renders).
"""

from __future__ import annotations

import contextvars
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


@dataclass
class Output:
    """What one render has yielded so far: its length, the spans of its `{% generation %}` blocks, and, when
    `reads` is a list, each read of a message's key as (message index, output length at the read)."""

    length: int = 0
    spans: list[tuple[int, int]] = field(default_factory=list)
    reads: list[tuple[int, int]] | None = None


OUTPUT: contextvars.ContextVar[Output | None] = contextvars.ContextVar("chat_output", default=None)


class ReadMessage(dict):
    """A message that notes each read of one of its keys (`message.role`, `message['content']`, `'tool_calls' in
    message`, `message.get(...)`) in the render's output, with how much the render had output by then."""

    __slots__ = ("_index", "_output")

    def __init__(self, message: dict[str, Any], index: int, output: Output) -> None:
        super().__init__(message)
        self._index, self._output = index, output

    def _note(self) -> None:
        self._output.reads.append((self._index, self._output.length))

    def __getitem__(self, key: Any) -> Any:
        self._note()
        return dict.__getitem__(self, key)

    def __contains__(self, key: Any) -> bool:
        self._note()
        return dict.__contains__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._note()
        return dict.get(self, key, default)


class GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and records the characters it fills in the output
    rendered so far (the blocks `generate()` has yielded), as transformers' AssistantTracker does."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_record", []), [], [], body).set_lineno(lineno)

    def _record(self, caller: Any) -> str:
        text = caller()
        output = OUTPUT.get()
        if output is not None:
            output.spans.append((output.length, output.length + len(text)))
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """jinja2's own tojson escapes HTML characters; chat templates expect plain JSON."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore attributes (a way out of the sandbox)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature: `self` may be an attribute name too
        self, attributes = args[0], dict(*args[1:], **kwargs)
        for name in attributes:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r}")


def environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlocks, "jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                               namespace=_TemplateNamespace)
    return environment
