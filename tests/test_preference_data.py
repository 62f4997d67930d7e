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
    with pytest.raises(ValueError, match="split would part answers from their prompt"):
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
                                "--doc-mask"]), 2, "--beta 0.0 must be a finite number, above 0")
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
