"""`burst eval` on an instruction store: the answers' loss as transformers computes it, question answering by depth
(a perfect reader answers all, a shifted one none), two cp ranks giving one process's figures, the CLI's JSON and
its refusals."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from cli import app
from data import TokenStore
from evaluation import EvalConfig, evaluate, load_for_eval
from evaluation.distributed import use_burst_attention
from evaluation.qa import DEPTH_BUCKETS, answer_depth, evaluate_qa
from models import ModelConfig, init_model, save_model
from tests.distributed import run_on_ranks
from tests.test_eval import NextTokenOracle
from tests.test_instruction_training import SEQ_LEN, chat_store, hf_model, transformers_loss  # noqa: F401
from tests.test_tokenizers import refused


@pytest.fixture(scope="module")
def checkpoint(chat_store, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    """A fresh `debug` model over the store's vocabulary: what matters is that the figures are computed right."""
    config = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=TokenStore(chat_store).vocab_size)
    path = tmp_path_factory.mktemp("model") / "model"
    save_model(init_model(config, seed=5), config, path)
    return path


def eval_config(checkpoint, store_dir, cp: int = 1, **overrides) -> EvalConfig:
    settings = dict(seq_len=SEQ_LEN, batches=2, buckets=4, passkey_trials=0, qa_samples=4)
    return EvalConfig(checkpoint=checkpoint, data=store_dir, cp=cp, **{**settings, **overrides})


def test_the_answers_loss_is_transformers(chat_store, checkpoint):  # noqa: F811
    result = evaluate(eval_config(checkpoint, chat_store, qa_samples=0))
    ppl = result.perplexity
    assert ppl.answers_only and ppl.positions == "packed" and result.qa is None
    hf = hf_model(load_for_eval(checkpoint).model(), load_for_eval(checkpoint).config)
    with torch.no_grad():
        loss, count = transformers_loss(hf, TokenStore(chat_store).split("val"), 0, ppl.sequences)
    assert ppl.tokens == count and abs(ppl.loss - loss.item()) <= 1e-5
    assert sum(b.tokens for b in ppl.loss_by_position) == count  # by depth into the conversations


def test_question_answering_scores_the_last_answer_by_its_depth_in_the_prompt(chat_store):  # noqa: F811
    store = TokenStore(chat_store)
    tokenizer, val = store.tokenizer(), store.split("val")
    perfect = evaluate_qa(NextTokenOracle(tokenizer.vocab_size), val, tokenizer, SEQ_LEN, 100)
    assert perfect.samples == val.num_documents - perfect.skipped_long and perfect.accuracy == 1.0
    assert len(perfect.by_depth) == DEPTH_BUCKETS
    assert sum(b.samples for b in [*perfect.by_depth, perfect.not_in_prompt]) == perfect.samples
    shifted = evaluate_qa(NextTokenOracle(tokenizer.vocab_size, shift=0), val, tokenizer, SEQ_LEN, 100)
    assert shifted.samples == perfect.samples and shifted.correct == 0
    short = evaluate_qa(NextTokenOracle(tokenizer.vocab_size), val, tokenizer, 96, 100)
    assert short.skipped_long == sum(int(n > 96) for n in val.document_lengths)
    text = "def f(x):\n    return x * 2\n\nWhat does f return?"
    prompt = tokenizer.encode(text)
    assert answer_depth(tokenizer, prompt, tokenizer.encode("x * 2")) == text.index("x * 2") / (len(text) - 5) == 0.5
    assert answer_depth(tokenizer, prompt, tokenizer.encode("y + 1")) is None


def _evaluate_on_ranks(rank, world_size, checkpoint, store_dir, expected):
    result = evaluate(eval_config(checkpoint, store_dir, cp=world_size))
    assert result.perplexity.tokens == expected["tokens"]
    assert abs(result.perplexity.loss - expected["loss"]) < 1e-5
    for bucket, loss in zip(result.perplexity.loss_by_position, expected["buckets"], strict=True):
        assert math.isnan(loss) and math.isnan(bucket.mean_loss) or abs(bucket.mean_loss - loss) < 1e-4
    model = load_for_eval(checkpoint).model()
    use_burst_attention(model, dist.group.WORLD)
    store = TokenStore(store_dir)
    qa = evaluate_qa(model, store.split("val"), store.tokenizer(), SEQ_LEN, 4, dist.group.WORLD)
    assert [b.correct for b in [*qa.by_depth, qa.not_in_prompt]] == expected["qa"]
    assert qa.samples == result.qa.samples == 4


def test_two_context_parallel_ranks_give_the_single_process_figures(chat_store, checkpoint):  # noqa: F811
    single = evaluate(eval_config(checkpoint, chat_store))
    store = TokenStore(chat_store)
    oracle = evaluate_qa(NextTokenOracle(store.vocab_size), store.split("val"), store.tokenizer(), SEQ_LEN, 4)
    assert oracle.correct == 4  # the samples can be answered; the fresh model answers as it answers
    expected = {"tokens": single.perplexity.tokens, "loss": single.perplexity.loss,
                "buckets": [b.mean_loss for b in single.perplexity.loss_by_position],
                "qa": [b.correct for b in [*single.qa.by_depth, single.qa.not_in_prompt]]}
    run_on_ranks(_evaluate_on_ranks, world_size=2, args=(checkpoint, chat_store, expected))


def test_question_answering_says_how_far_it_is_on_stderr(chat_store, checkpoint, capsys):  # noqa: F811
    evaluate(eval_config(checkpoint, chat_store, qa_samples=3))
    out, err = capsys.readouterr()
    said = [line.split(" (")[0] for line in err.splitlines() if "samples answered" in line]
    assert said == ["question answering: 1/3 samples answered", "question answering: 3/3 samples answered"], err
    assert "samples answered" not in out and "question answering by depth" in out


def test_the_cli_writes_the_answers_loss_and_question_answering(chat_store, checkpoint, tmp_path):  # noqa: F811
    runner = CliRunner()
    common = ["eval", "--checkpoint", str(checkpoint), "--data", str(chat_store), "--seq-len", str(SEQ_LEN),
              "--passkey-trials", "0"]
    done = runner.invoke(app, [*common, "--qa-samples", "3", "--json", str(tmp_path / "eval.json")])
    assert done.exit_code == 0, done.output
    figures = json.loads((tmp_path / "eval.json").read_text())
    assert figures["scored"] == "answers" and figures["qa"]["samples"] == 3
    assert [b["depth_start"] for b in figures["qa"]["by_depth"]] == pytest.approx([0, 0.2, 0.4, 0.6, 0.8])
    assert "question answering by depth" in done.output and "loss (nats/token) (answers)" in done.output
    refused(runner.invoke(app, [*common, "--positions", "document"]), 2, "is an instruction store, scored on its "
                                                                          "answers: use --positions packed")
    refused(runner.invoke(app, [*common, "--qa-samples", "-1"]), 2, "--qa-samples -1 must be >= 0")
    refused(runner.invoke(app, [*common, "--seq-len", "64"]), 2, "are longer than a sequence of --seq-len 64",
            "set --long-conversations truncate")
