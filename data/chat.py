"""Conversations rendered into token ids, and which of those tokens are scored: the assistant's answers.

A conversation is a list of messages {"role": ..., "content": ...} (the OpenAI and Hugging Face chat format).
With a tokenizer that has a chat template (data/tokenizer_hf.py finds it where transformers does), it is
rendered as `AutoTokenizer.apply_chat_template(messages, tokenize=True)` renders it, so the ids are those the
model meets at inference: the template runs in a jinja2 sandbox set up as transformers sets up its own
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, a `tojson` that does not escape HTML,
`strftime_now`, restricted `dict` and `namespace`, `{% generation %}` blocks), given the messages,
`add_generation_prompt` (False: training rows end with their last message) and the tokenizer's named special
tokens as strings; the text is then encoded whole, the special tokens it holds recognised by the `tokenizers`
library as AutoTokenizer recognises them.

Without a template (the SentencePiece tokenizers burst trains, a tokenizer.json published without one)
conversations take PLAIN_TEMPLATE: BOS, then each message as "Role:\\n" + content + "\\n\\n", an assistant's
content followed by EOS, which ends each answer. Its BOS and EOS are written as their ids, never as text, and
its text is encoded in pieces cut at the answers' edges, each piece after the first encoded as it continues the
text before it (after a newline whose ids are dropped, so that SentencePiece adds no space at its start), with
special tokens split (`Tokenizer.encode_as_text`): a literal "<|end_of_text|>" in a conversation is text, never
the EOS id, with a tokenizer.json as with SentencePiece. (A template of the model's own is encoded as
apply_chat_template encodes it: there such a literal is the special token, in transformers and here alike.)
At inference, `ChatFormat.prompt_ids` renders the conversation so far with `add_generation_prompt=True` (which ends
in "Assistant:\\n") and encodes it as training did; generate until EOS.

The scored tokens are each assistant turn's answer and its end-of-turn token: where the template marks them with
`{% generation %}` blocks (PLAIN_TEMPLATE does), the characters of those blocks, which is what transformers'
`return_assistant_tokens_mask` scores; otherwise, from the end of the conversation rendered up to that turn with
the generation prompt to the end of the conversation rendered through that turn, trailing whitespace left out.
A token is scored when its characters overlap an answer's. A template that renders the start of an ordinary
conversation otherwise than the whole conversation's start (so the answers cannot be placed) is refused when it
is loaded (TemplateNotIncremental); one row it does that to (an assistant turn first, earlier reasoning dropped)
is that row's problem, as is anything the template raises on it: ConversationRefused names the kind.
Placing each answer that way renders the conversation twice per answer, quadratic in the turns; past
EXACT_RENDERS the answers are placed from one rendering instead (_spans_from_reads), checked against the
one-by-one placement on the first and last answers and one answer of each context.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import jinja2
import numpy as np

from data.chat_sandbox import OUTPUT, Output, ReadMessage, environment
from data.tokenizer import Tokenizer

PLAIN = "plain"  # the name of PLAIN_TEMPLATE where a store records which template rendered it
PLAIN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize + ':\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{{ '\\n\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:\\n' }}{% endif %}"
)
# PLAIN_TEMPLATE's BOS and EOS while it renders: private-use characters, turned into the ids afterwards, so a
# conversation's own text never becomes a special token. A conversation holding them is refused.
MARKERS = {"bos_token": "\ue000", "eos_token": "\ue001"}
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers gives a template all three
# A conversation without {% generation %} blocks whose answers, placed one by one, would take more than this many
# messages rendered (about 10 ms) has them placed from one rendering, checked one by one on a few (_spans_from_reads).
EXACT_RENDERS = 10_000
MAX_CHECKED_ANSWERS = 16  # more kinds of answer in one conversation than this: placed one by one
# Rendered when a template is loaded, so one that cannot place answers is refused before any data is read.
PROBE = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
         {"role": "assistant", "content": "6"}]


class ConversationRefused(ValueError):
    """One conversation cannot be stored: `problem` names the kind (an InputReport field) its row is counted as."""

    problem = "template_errors"


class ChatTemplateError(ConversationRefused):
    """The template refused to render one conversation (its raise_exception, or any error inside it: a division by
    zero, a sandbox limit, nesting too deep): that row is counted as bad input, as transformers would have raised
    for it."""


class UnplacedAnswers(ConversationRefused):
    """The template renders this conversation's start otherwise than the whole conversation's (an assistant turn
    first, earlier reasoning dropped): its answers cannot be located, so the row is counted and left out."""

    problem = "unplaced_answers"


class EmptyAnswers(ConversationRefused):
    """The template renders no answer of this conversation, or only whitespace: nothing in it would be scored."""

    problem = "empty_answers"


class NoAnswer(ConversationRefused):
    """The template renders no assistant turn of this conversation as an answer."""

    problem = "no_answer"


class ToolCallsUnsupported(ConversationRefused):
    """The conversation holds tool calls, and the template does not render them."""

    problem = "unsupported_tool_calls"


class TemplateNotIncremental(ValueError):
    """The template renders a conversation's start otherwise than the whole conversation's: its answers cannot
    be located, so the template is refused."""


@dataclass
class Rendered:
    """A conversation rendered to text, with the character spans [start, end) of its scored answers."""

    text: str
    spans: list[tuple[int, int]]


def _with_reasoning_aliases(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's reasoning under each name templates read it by, as transformers passes it."""
    aliased = []
    for message in messages:
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        aliased.append(message if reasoning is None else {"thinking": reasoning, **message,
                                                          "reasoning_content": reasoning})
    return aliased


# -- rendering and encoding -------------------------------------------------------------------------------------

class ChatFormat:
    """How conversations become ids for `tokenizer`: its own chat template, or PLAIN_TEMPLATE without one."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.template_file = tokenizer.chat_template_file or PLAIN
        self.template = tokenizer.chat_template if tokenizer.chat_template is not None else PLAIN_TEMPLATE
        self.is_plain = tokenizer.chat_template is None
        self.special_tokens = MARKERS if self.is_plain else dict(tokenizer.special_tokens)
        try:
            self._compiled = environment().from_string(self.template)
        except jinja2.TemplateError as err:
            raise ValueError(f"the chat template in {self.where} is not a template jinja2 can read ({err}); "
                             f"restore it from the model it came with") from None
        self.marks_answers = re.search(r"\{%-?\s*generation\s*-?%\}", self.template) is not None
        self.renders_tool_calls = "tool_calls" in self.template  # a template that never reads them drops them
        self._marker_ids = {MARKERS["bos_token"]: tokenizer.bos_id, MARKERS["eos_token"]: tokenizer.eos_id}
        self._newline_ids = tokenizer.encode("\n")
        try:
            self.render(PROBE)  # refused here, before any data is read, when it cannot place an ordinary row's answers
        except UnplacedAnswers as err:
            raise TemplateNotIncremental(
                f"the chat template in {self.where} {str(err).removeprefix('the chat template ')}; mark the answers in "
                f"the template with {{% generation %}}...{{% endgeneration %}} (transformers' assistant mask), or use "
                f"a template that renders each turn the same way wherever it stands") from None
        except ConversationRefused:
            pass  # a template may refuse this conversation (no system turn, say); each row is tried as it comes

    @property
    def where(self) -> str:
        """The template's file, or "plain"."""
        return PLAIN if self.is_plain else str(self.tokenizer.files[self.template_file])

    def metadata(self) -> dict[str, Any]:
        """What a store records of the template that rendered it."""
        return {"template": self.template_file, "sha256": hashlib.sha256(self.template.encode()).hexdigest(),
                "generation_blocks": self.marks_answers}

    def render_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    tools: list[dict[str, Any]] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The template's text for `messages` (and the `tools` offered, as transformers passes them) and the spans
        of its `{% generation %}` blocks. Whatever the template raises on them is a ChatTemplateError."""
        text, output = self._render(messages, add_generation_prompt, tools)
        return text, output.spans

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                tools: list[dict[str, Any]] | None = None, note_reads: bool = False) -> tuple[str, Output]:
        """render_text(), noting with `note_reads` where in the output each message's keys were read."""
        output = Output(reads=[] if note_reads else None)
        aliased = _with_reasoning_aliases(messages)
        if note_reads:
            aliased = [ReadMessage(message, i, output) for i, message in enumerate(aliased)]
        blocks: list[str] = []
        token = OUTPUT.set(output)
        try:
            for block in self._compiled.generate(messages=aliased, tools=tools, documents=None,
                                                 add_generation_prompt=add_generation_prompt, **self.special_tokens):
                blocks.append(block)
                output.length += len(block)
        except Exception as err:  # a template is code: any error of its own (1 // 0, a sandbox limit) is this row's
            raise ChatTemplateError(f"the chat template raised {type(err).__name__}: {err}") from None
        finally:
            OUTPUT.reset(token)
        return "".join(blocks), output

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Rendered:
        """The conversation as training sees it (no generation prompt) and its answers' character spans; a
        ConversationRefused, naming the kind of problem, when it cannot be stored."""
        if self.is_plain and any(marker in json.dumps(messages, ensure_ascii=False) for marker in MARKERS.values()):
            raise ChatTemplateError("it holds U+E000 or U+E001, which the plain template keeps for BOS and EOS")
        if not self.renders_tool_calls and any(message.get("tool_calls") for message in messages):
            raise ToolCallsUnsupported(f"it holds tool calls, which the chat template in {self.where} does not render "
                                       f"(it never reads `tool_calls`)")
        answers = [i for i, message in enumerate(messages) if message.get("role") == "assistant"]
        one_by_one = self.marks_answers or sum(2 * i + 1 for i in answers) <= EXACT_RENDERS
        text, output = self._render(messages, tools=tools, note_reads=not one_by_one)
        if self.marks_answers:
            spans = output.spans
        elif one_by_one:
            spans = [self._answer_span(messages, text, tools, i) for i in answers]
        else:
            spans = self._spans_from_reads(messages, text, tools, answers, output.reads)
        if not spans:
            raise NoAnswer("the chat template renders none of its assistant turns as an answer")
        if all(not text[start:end].strip() for start, end in spans):
            raise EmptyAnswers("the chat template renders its answers empty")
        return Rendered(text, spans)

    def _answer_span(self, messages: list[dict[str, Any]], text: str, tools: list[dict[str, Any]] | None,
                     i: int) -> tuple[int, int]:
        """Assistant turn i's span in `text`, from renderings of the conversation up to it (UnplacedAnswers when they
        are not where the whole rendering has them)."""
        try:
            before, _ = self.render_text(messages[:i], add_generation_prompt=True, tools=tools)
            through, _ = self.render_text(messages[:i + 1], tools=tools)
        except ChatTemplateError as err:
            raise UnplacedAnswers(f"{err}, rendering the conversation up to its answer {i} (message {i} of "
                                  f"{len(messages)}), so the answer's tokens cannot be located") from None
        end = len(through.rstrip())
        if not (text.startswith(before) and text.startswith(through) and len(before) < end):
            raise UnplacedAnswers(
                f"the chat template renders the conversation up to its answer {i} (message {i} of "
                f"{len(messages)}) otherwise than the start of the whole conversation, so the answer's tokens "
                f"cannot be located")
        return len(before), end

    def _spans_from_reads(self, messages: list[dict[str, Any]], text: str, tools: list[dict[str, Any]] | None,
                          answers: list[int], reads: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The answers' spans of a long conversation, in time linear in its turns: each turn starts where the one
        rendering first read its message after the last read of the message before; an answer runs from its
        turn's start plus the generation prompt (as the first answer, placed one by one, has it) to the next
        turn's start, trailing whitespace left out. The first and the last answer, and one answer of each
        context (the roles and keys of it and the messages on either side), are placed one by one too; when
        one differs, or a turn does not start with the generation prompt, every answer is placed one by one."""
        starts = _turn_starts(reads, len(messages), len(text))
        first_start, first_end = self._answer_span(messages, text, tools, answers[0])
        prompt = text[starts[answers[0]]:first_start] if starts is not None else None
        spans: list[tuple[int, int]] = []
        for i in answers if prompt is not None else ():
            start, end = starts[i] + len(prompt), starts[i + 1]
            while end > start and text[end - 1].isspace():
                end -= 1
            if not (text.startswith(prompt, starts[i]) and start < end):
                break
            spans.append((start, end))
        examples = {}
        for n, i in enumerate(answers):
            examples.setdefault(_context(messages, i), n)
        checked = sorted({0, len(answers) - 1, *examples.values()})
        if len(spans) == len(answers) and len(checked) <= MAX_CHECKED_ANSWERS and spans[0] == (first_start, first_end) \
                and all(self._answer_span(messages, text, tools, answers[n]) == spans[n] for n in checked[1:]):
            return spans
        return [self._answer_span(messages, text, tools, i) for i in answers]

    def prompt_ids(self, messages: list[dict[str, Any]]) -> np.ndarray:
        """The ids a model is given at inference to answer `messages`: rendered with the generation prompt, encoded
        as training encoded them (for the conversation with its answer, these are its first ids)."""
        text, spans = self.render_text(messages, add_generation_prompt=True)
        return self.encode([Rendered(text, spans)])[0][0]

    def encode(self, rendered: list[Rendered]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids int64 [n], scored bool [n]) of each rendered conversation; a template's texts in one batch."""
        if self.is_plain:
            return [self._encode_plain(r) for r in rendered]
        out = []
        for r, (ids, offsets) in zip(rendered, self.tokenizer.encode_with_offsets([r.text for r in rendered]),
                                     strict=True):
            out.append((np.asarray(ids, np.int64), _overlapping(np.asarray(offsets, np.int64).reshape(-1, 2),
                                                                r.spans)))
        return out

    def _encode_plain(self, rendered: Rendered) -> tuple[np.ndarray, np.ndarray]:
        """PLAIN_TEMPLATE's ids: BOS and EOS markers as ids, the text in pieces cut at the answers' edges."""
        text = rendered.text
        cuts = sorted({0, len(text), *(edge for span in rendered.spans for edge in span)})
        ids: list[int] = []
        scored: list[bool] = []
        split = re.compile(f"([{''.join(MARKERS.values())}])")
        for start, end in zip(cuts[:-1], cuts[1:], strict=True):
            inside = any(a <= start and end <= b for a, b in rendered.spans)
            for part in split.split(text[start:end]):
                if not part:
                    continue
                part_ids = [self._marker_ids[part]] if part in self._marker_ids else \
                    self.tokenizer.encode_as_text(part) if not ids else self._continued(part)
                ids += part_ids
                scored += [inside] * len(part_ids)
        return np.asarray(ids, np.int64), np.asarray(scored, bool)

    def _continued(self, text: str) -> list[int]:
        """The ids of `text` where it continues a conversation: encoded after a newline whose ids are then dropped,
        so that a tokenizer adding a space at the start of a text (SentencePiece's dummy prefix) adds none here."""
        ids = self.tokenizer.encode_as_text("\n" + text)
        if ids[:len(self._newline_ids)] == self._newline_ids:
            return ids[len(self._newline_ids):]
        return self.tokenizer.encode_as_text(text)


def _turn_starts(reads: list[tuple[int, int]], count: int, length: int) -> list[int] | None:
    """Where each of `count` messages' turns starts in a rendering of `length` characters, from its reads (message
    index, output length) in order: the first read of a message at or after the last read of the message before
    (a template may read every message before its turns, or look back at the previous one); then `length`.
    None when a message is never read."""
    by_message: list[list[int]] = [[] for _ in range(count)]
    for index, at in reads:
        by_message[index].append(at)  # in the order read: output lengths only grow
    starts, after = [], 0
    for positions in by_message:
        at = next((at for at in positions if at >= after), None)
        if at is None:
            return None
        starts.append(at)
        after = positions[-1]
    return starts + [length]


def _context(messages: list[dict[str, Any]], i: int) -> tuple:
    """What a template may render an answer differently by: the roles and keys (and whether the content is blank)
    of message i and the messages on either side."""
    def shape(message: dict[str, Any]) -> tuple:
        return message.get("role"), tuple(sorted(message)), not str(message.get("content") or "").strip()

    return tuple(shape(messages[j]) if 0 <= j < len(messages) else None for j in (i - 1, i, i + 1))


def _overlapping(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """bool [tokens]: whether each token's characters offsets[t] = [start, end) overlap one of the sorted,
    disjoint `spans`."""
    if not spans or not len(offsets):
        return np.zeros(len(offsets), bool)
    starts, ends = (np.asarray(edge, np.int64) for edge in zip(*spans, strict=True))
    first_after = np.searchsorted(ends, offsets[:, 0], side="right")  # the first span ending after the token starts
    held = first_after < len(spans)
    return held & (starts[np.minimum(first_after, len(spans) - 1)] < offsets[:, 1])
