"""Preference pairs: `burst prepare --preference` keeps each pair's prompt, chosen and rejected ids and counts every
row it leaves out by kind; packing lays a pair out with or without a shared prompt, never cut across sequences;
what cannot train is refused before any work with a one-line error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cli import app
from data import SequenceLoader, TokenStore, load_tokenizer, prepare
from data.chat import ChatFormat
from data.preference_packing import PreferenceStream
from tests.test_chat import (
    CHATML_SPECIALS,
    CHATML_TEMPLATE,
    LLAMA3_TEMPLATE,
    LLAMA_SPECIALS,
    chat_tokenizer,
    write_rows,
)
from tests.test_preference import make_pair_store, preference_rows
from tests.test_tokenizers import refused


@pytest.fixture(scope="module")
def pair_store(tmp_path_factory):
    return make_pair_store(tmp_path_factory.mktemp("preferences"))


BAD_ROWS = [
    {"prompt": "no answers"},  # missing_fields
    {"prompt": "x", "chosen": ["not", "messages"], "rejected": "y"},  # malformed_messages
    {"prompt": "x", "chosen": [{"role": "user", "content": "no assistant"}], "rejected": "y"},  # malformed_messages
    {"prompt": "x", "chosen": "  ", "rejected": "y"},  # empty_answers
    {"prompt": "x", "chosen": "the same", "rejected": "the same"},  # identical_answers
    "{not json",  # invalid_json
]


def test_prepare_keeps_each_pair_and_counts_what_it_leaves_out(tmp_path):
    directory = chat_tokenizer(tmp_path / "tok", CHATML_SPECIALS, CHATML_TEMPLATE)
    good = preference_rows(6)
    rows = write_rows(tmp_path / "pairs.jsonl", good + BAD_ROWS)
    summary = prepare([rows], tmp_path / "store", tokenizer=directory, val_fraction=0, preference=True,
                      progress=False)
    store = TokenStore(tmp_path / "store")
    assert store.is_preferences and not store.is_conversations and summary.num_documents == len(good)
    problems = store.metadata["input_report"]
    assert {k: problems[k] for k in ("missing_fields", "malformed_messages", "empty_answers", "identical_answers",
                                     "invalid_json", "split_prompts")} == {
        "missing_fields": 1, "malformed_messages": 2, "empty_answers": 1, "identical_answers": 1, "invalid_json": 1,
        "split_prompts": 0}
    chat = ChatFormat(load_tokenizer(directory))
    tokenizer = load_tokenizer(directory)
    for i, row in enumerate(good):
        prompt = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        answer = row["chosen"] if isinstance(row["chosen"], list) else [{"role": "assistant", "content": row["chosen"]}]
        p, c, r = store.pair_lengths_of(i)
        ids = store.document(i)
        assert ids[:p].tolist() == chat.prompt_ids(prompt).tolist()  # what a model is given at inference
        assert tokenizer.decode(ids[p:p + c]) == answer[0]["content"] + "<|im_end|>"  # the answer and its end
        assert store.place(i) == f"{rows}:{i + 1}"
    assert (store.pair_lengths == np.array([store.pair_lengths_of(i) for i in range(len(good))])).all()


def test_a_template_whose_tokens_cross_the_prompts_end_is_refused_by_row(tmp_path):
    # LLaMA-3's "\n\n" after the assistant header merges with nothing alone, but this byte-level BPE splits it
    # otherwise before an answer: the prompt's ids are not the start of prompt + answer.
    directory = chat_tokenizer(tmp_path / "tok", LLAMA_SPECIALS, LLAMA3_TEMPLATE)
    rows = write_rows(tmp_path / "pairs.jsonl", preference_rows(3))
    runner = CliRunner()
    result = runner.invoke(app, ["prepare", str(rows), "--preference", "--tokenizer", str(directory), "--out",
                                 str(tmp_path / "store")])
    refused(result, 2, "3 split prompts", "prompt's ids are not the start of prompt + answer's ids")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("sharing", [True, False])
def test_pairs_are_packed_whole_each_answer_tagged_and_positioned_as_after_its_prompt(pair_store, sharing):
    store = TokenStore(pair_store).split("train")
    stream = PreferenceStream(store, 384, seed=5, prefix_sharing=sharing)
    seen = []
    for k in range(stream.sequences_in_epoch(0)):
        packed = stream.sequence(k)
        starts = np.flatnonzero(packed.is_start)
        seen += packed.documents.tolist()
        for pair, document in enumerate(packed.documents.tolist()):
            p, c, r = store.pair_lengths_of(document)
            ids = store.document(document)
            for side, answer in enumerate((ids[p:p + c], ids[p + c:])):
                where = np.flatnonzero(packed.answer == 2 * pair + side)
                assert packed.tokens[where].tolist() == answer.tolist()  # whole, in one sequence
                assert packed.positions[where].tolist() == list(range(p, p + len(answer)))  # as after the prompt
                before = where[0] - 1  # the position that predicts the answer's first token: the prompt's last
                assert packed.tokens[before] == ids[p - 1] and packed.positions[before] == p - 1
        if sharing:  # three documents a pair: the answers see the prompt, not each other
            backs = packed.sees_back[starts]
            assert backs[:3 * len(packed.documents)].tolist() == [0, 1, 2] * len(packed.documents)
        else:
            assert not packed.sees_back.any()
    assert sorted(seen) == list(range(store.num_documents))  # an epoch holds every pair once
    assert stream.sequence(3).tokens.tolist() == PreferenceStream(store, 384, seed=5, prefix_sharing=sharing
                                                                  ).sequence(3).tokens.tolist()  # (seed, k)
    loader = SequenceLoader(store, 384, 2, cp_size=2, cp_rank=1, seed=5, reset_positions=True, cp_layout="balanced",
                            prefix_sharing=sharing)
    batch = next(loader)
    assert batch.num_pairs == len(batch.pair_documents) > 2 and (batch.doc_sees is not None) == sharing
    assert batch.answers.shape == batch.labels.shape and ((batch.answers >= 0) == (batch.labels != -100)).all()
    if sharing:
        assert batch.doc_sees[0][:3].tolist() == [-1, 0, 0]


def test_a_pair_longer_than_a_sequence_is_refused_or_its_prompt_truncated(pair_store):
    store = TokenStore(pair_store).split("train")
    longest = int(store.pair_lengths.sum(1).max())
    with pytest.raises(ValueError, match="set --long-conversations truncate"):
        PreferenceStream(store, 64, 0, policy="refuse")
    with pytest.raises(ValueError, match="a preference pair is scored whole"):
        PreferenceStream(store, 64, 0, policy="split")
    with pytest.raises(ValueError, match="even with their prompts cut to one token their answers do not fit"):
        PreferenceStream(store, 16, 0, policy="truncate")
    stream = PreferenceStream(store, 64, 0, policy="truncate")
    assert stream.long.count > 0 and stream.long.truncated_tokens > 0 and longest > 64
    for k in range(stream.sequences_in_epoch(0)):
        packed = stream.sequence(k)
        for pair, document in enumerate(packed.documents.tolist()):
            p, c, r = store.pair_lengths_of(document)
            ids = store.document(document)
            assert packed.tokens[packed.answer == 2 * pair].tolist() == ids[p:p + c].tolist()
            assert packed.tokens[packed.answer == 2 * pair + 1].tolist() == ids[p + c:].tolist()


def test_what_cannot_train_on_preferences_is_refused_before_any_work(pair_store, tmp_path):
    runner = CliRunner()
    out = tmp_path / "run"
    common = ["train", "--model", "debug", "--seq-len", "384", "--steps", "1", "--out", str(out)]
    refused(runner.invoke(app, [*common, "--data", str(pair_store), "--doc-mask"]), 2,
            "is a preference store (`burst prepare --preference`)", "--objective dpo | ipo | simpo | orpo")
    refused(runner.invoke(app, [*common, "--data", str(pair_store), "--objective", "dpo", "--no-doc-mask"]), 2,
            "--no-doc-mask is refused for --data", "must not attend to other pairs'", "drop --no-doc-mask")
    refused(runner.invoke(app, [*common, "--data", str(pair_store), "--objective", "kto", "--doc-mask"]), 2,
            "--objective 'kto' is not one of nll, dpo, ipo, simpo, orpo")
    refused(runner.invoke(app, [*common, "--data", str(pair_store), "--objective", "dpo", "--beta", "0",
                                "--doc-mask"]), 2, "--beta 0 must be a finite number above 0")
    documents = tmp_path / "documents"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("plain text, line after line\n" * 200)
    prepare([tmp_path / "docs"], documents, tokenizer=pair_store, val_fraction=0, progress=False)
    refused(runner.invoke(app, [*common, "--data", str(documents), "--objective", "dpo", "--doc-mask"]), 2,
            "--objective dpo trains on one preference store", "a store of documents")
    assert not out.exists()
    assert json.loads((pair_store / "metadata.json").read_text())["content"] == "preferences"
    refused(runner.invoke(app, ["prepare", str(tmp_path / "docs" / "a.txt"), "--preference", "--tokenizer",
                                str(pair_store), "--out", str(tmp_path / "x")]), 2, "is not JSON Lines or Parquet")
    refused(runner.invoke(app, ["prepare", str(tmp_path / "docs"), "--preference", "--out", str(tmp_path / "x")]), 2,
            "--preference renders preference pairs for the model", "--tokenizer")


def test_the_sequence_is_the_same_torch_tensor_on_every_cp_rank(pair_store):
    store = TokenStore(pair_store).split("train")
    shards = [next(SequenceLoader(store, 384, 1, cp_size=2, cp_rank=rank, seed=1, reset_positions=True,
                                  cp_layout="balanced")) for rank in (0, 1)]
    assert torch.equal(shards[0].pair_documents, shards[1].pair_documents)
    tags = torch.cat([s.answers.flatten() for s in shards])
    assert set(tags[tags >= 0].tolist()) == set(range(2 * shards[0].num_pairs))


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "What is the weather?",
      "chosen": [{"role": "assistant", "content": "Let me look.",
                  "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {}}}]}],
      "rejected": "It rains."}, "unsupported_tool_calls"),
    ({"prompt": [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"}],
      "chosen": "Good.", "rejected": "Bad."}, "unplaced_answers"),
], ids=["tool_calls_the_template_never_reads", "assistant_first_under_a_default_system_prompt"])
def test_one_pair_the_template_cannot_render_is_counted_and_the_read_goes_on(tmp_path, row, problem):
    """Issue 35, defect 1: such a row ended its file's read, every later pair dropped, the file counted unreadable."""
    directory = chat_tokenizer(tmp_path / "tok", CHATML_SPECIALS, CHATML_TEMPLATE)
    good = preference_rows(4)
    first = write_rows(tmp_path / "good_bad_good.jsonl", [good[0], row, good[1]])
    more = write_rows(tmp_path / "more.jsonl", good[2:])
    summary = prepare([first, more], tmp_path / "store", tokenizer=directory, val_fraction=0, preference=True,
                      progress=False)
    assert {name: count for name, count in summary.report.problems().items() if count} == {problem: 1}
    assert summary.report.examples[problem][0].startswith(f"{first}:2: ")
    store = TokenStore(tmp_path / "store")
    assert [store.place(i) for i in range(store.num_documents)] == [f"{first}:1", f"{first}:3", f"{more}:1",
                                                                    f"{more}:2"]
    assert store.metadata["input_report"][problem] == 1


def test_a_pair_that_is_not_utf8_is_left_out_whole(tmp_path):
    """Issue 35, defect 2: such a row was counted as invalid UTF-8 and also stored, with U+FFFD in its text."""
    directory = chat_tokenizer(tmp_path / "tok", CHATML_SPECIALS, CHATML_TEMPLATE)
    good = preference_rows(3)
    path = tmp_path / "pairs.jsonl"
    with open(path, "wb") as f:
        f.write(json.dumps(good[0]).encode() + b"\n")
        f.write(b'{"prompt": "caf\xe9?", "chosen": "Yes.", "rejected": "No."}\n')  # Latin-1, not UTF-8
        f.write(json.dumps(good[1]).encode() + b"\n")
        f.write(b'{"prompt": "half \\ud800 a pair", "chosen": "Yes.", "rejected": "No."}\n')  # a lone surrogate
        f.write(json.dumps(good[2]).encode() + b"\n")
    summary = prepare([path], tmp_path / "store", tokenizer=directory, val_fraction=0, preference=True,
                      progress=False)
    problems = {name: count for name, count in summary.report.problems().items() if count}
    assert problems == {"invalid_utf8": 2}
    assert summary.num_documents + sum(problems.values()) == 5  # every row read is a pair or a problem
    store = TokenStore(tmp_path / "store")
    assert [store.place(i) for i in range(store.num_documents)] == [f"{path}:1", f"{path}:3", f"{path}:5"]
    tokenizer = load_tokenizer(directory)
    assert not any("\ufffd" in tokenizer.decode(store.document(i)) for i in range(store.num_documents))


@pytest.mark.parametrize("flags, message", [
    (["--objective", "dpo", "--val-tokens", "1000"], "--val-tokens is for a validation loss; a preference run's"),
    (["--objective", "simpo", "--val-every", "5"], "--val-every is for a validation loss"),
    (["--objective", "dpo", "--simpo-gamma", "0.3"], "--simpo-gamma is SimPO's target margin; --objective dpo does "
                                                     "not use it"),
    (["--objective", "simpo", "--orpo-lambda", "0.3"], "--orpo-lambda is ORPO's odds-ratio weight; --objective simpo"),
])
def test_a_flag_a_preference_run_would_ignore_is_refused(pair_store, tmp_path, flags, message):
    """Issue 35, defect 9: these were accepted and ignored without a word."""
    out = tmp_path / "run"
    done = CliRunner().invoke(app, ["train", "--model", "debug", "--seq-len", "384", "--steps", "1", "--doc-mask",
                                    "--data", str(pair_store), *flags, "--out", str(out)])
    refused(done, 2, message, "drop it")
    assert not out.exists()


def test_split_is_refused_for_pairs_with_its_own_reason(pair_store):
    """Issue 35, defect 9: --long-conversations split on preference data got refuse's message."""
    with pytest.raises(ValueError) as refused_split:
        PreferenceStream(TokenStore(pair_store), 384, 0, policy="split")
    message = str(refused_split.value)
    assert "--long-conversations split" in message and "scored whole" in message and "truncate" in message


@pytest.mark.parametrize("split_prompts", [False, True])
def test_no_pairs_to_store_explains_split_prompts_only_when_there_were_some(tmp_path, split_prompts):
    """Issue 35, defect 9: "no documents to store" always explained split prompts, even with none."""
    directory = chat_tokenizer(tmp_path / "tok", *((LLAMA_SPECIALS, LLAMA3_TEMPLATE) if split_prompts else
                                                   (CHATML_SPECIALS, CHATML_TEMPLATE)))
    rows = write_rows(tmp_path / "pairs.jsonl", preference_rows(2) if split_prompts else BAD_ROWS)
    done = CliRunner().invoke(app, ["prepare", str(rows), "--preference", "--tokenizer", str(directory), "--out",
                                    str(tmp_path / "store")])
    output = " ".join(done.output.split())
    assert done.exit_code == 2 and "no documents to store" in output, output
    assert ("split prompts are rows whose prompt's ids" in output) == split_prompts
