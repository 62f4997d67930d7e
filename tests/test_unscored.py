"""Sequences that score no token (an instruction store's prompt-only pieces): a training step of them is skipped,
no weight nor optimizer state moved, logged with its reason and left out of the losses; `burst eval` of them says
so and how to fix it, instead of calling the model diverged."""

from __future__ import annotations

import dataclasses

import torch
from typer.testing import CliRunner

from cli import app
from data import SequenceLoader, TokenStore
from tests.fixtures import events, metrics
from tests.test_instruction_eval import checkpoint  # noqa: F401 (a fixture)
from tests.test_instruction_training import chat_store, model_config  # noqa: F401 (a fixture)
from tests.test_tokenizers import refused
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.optim import build_optimizer
from trainer.parallelize import build_model
from trainer.step import NO_SCORED_TOKENS, train_step

SPLIT = ["--seq-len", "32", "--long-conversations", "split"]  # the first pieces of a conversation: its prompt


def prompt_only_batches(store_dir, split: str = "train") -> tuple[SequenceLoader, list[int]]:
    """The chat store cut into 32-token pieces, and the scored tokens of its first sequences (seed 0)."""
    store = TokenStore(store_dir).split(split)
    counting = SequenceLoader(store, 32, 1, reset_positions=True, long_conversations="split")
    scored = [next(counting).num_tokens for _ in range(4)]
    return SequenceLoader(store, 32, 1, reset_positions=True, long_conversations="split"), scored


def test_a_step_that_scores_no_token_moves_no_weight_nor_optimizer_state(chat_store):  # noqa: F811
    loader, scored = prompt_only_batches(chat_store)
    assert scored[:4] == [0, 0, 5, 6]
    config = TrainConfig(model="debug", seq_len=32, doc_mask=True, precision="fp32", weight_decay=0.1,
                         long_conversations="split")
    model = build_model(model_config(TokenStore(chat_store)), None, config, torch.device("cpu"))
    optimizer = build_optimizer(model, config)
    env = Distributed(0, 1, torch.device("cpu"), None)
    batches = [next(loader) for _ in range(4)]
    applied = train_step(model, optimizer, [batches[2]], config, env)  # AdamW's moments and step count now set
    assert applied.applied and applied.scored_tokens == 5 and applied.loss > 0
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()}
    skipped = train_step(model, optimizer, [batches[0]], config, env)
    assert dataclasses.astuple(skipped) == (None, None, False, 0, NO_SCORED_TOKENS, {})
    for name, p in model.named_parameters():  # before: moved by momentum and weight decay, with loss 0
        assert torch.equal(p, weights[name]), name
        assert all(torch.equal(v, state[name][k]) for k, v in optimizer.state[p].items()), name
        assert p.grad is None


def test_steps_that_score_no_token_are_logged_skipped_and_left_out_of_the_losses(chat_store, tmp_path,  # noqa: F811
                                                                                  monkeypatch):
    import trainer.trainer

    checked, step = [], trainer.trainer.train_step

    def recording(*args, **kwargs):
        checked.append(args[-1])  # check_ranks
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer.trainer, "train_step", recording)
    out = tmp_path / "run"
    done = CliRunner().invoke(app, ["train", "--model", "debug", "--data", str(chat_store), "--doc-mask", *SPLIT,
                                    "--steps", "4", "--precision", "fp32", "--out", str(out)])
    assert done.exit_code == 0, done.output
    rows = metrics(out)
    assert [(r["skipped"], r["skip_reason"], r["scored_tokens"]) for r in rows] == \
        [(True, NO_SCORED_TOKENS, 0)] * 2 + [(False, None, 5), (False, None, 6)]
    assert rows[0]["loss"] is None and rows[0]["grad_norm"] is None and rows[2]["loss"] > 0
    output = " ".join(done.output.split())
    assert f"step 1/4 loss - lr {rows[0]['lr']:.2e} grad norm -" in output
    assert f"[skipped: {NO_SCORED_TOKENS}]" in output
    mean = (rows[2]["loss"] + rows[3]["loss"]) / 2
    assert f"training loss {mean:.4f} (mean of the last 2 steps); 2 steps scored no token (skipped, left out of " \
           f"the losses)" in output
    assert events(out, "validation")[0]["held_out_tokens"] > 0
    assert checked == [True, True, True, False]  # the first step that runs attention checks the cp ranks' inputs


def test_eval_of_sequences_without_an_answer_says_so_and_how_to_fix_it(chat_store, checkpoint, tmp_path):  # noqa: F811
    _, scored = prompt_only_batches(chat_store, "val")
    assert scored[:2] == [0, 0]
    output = refused(CliRunner().invoke(app, ["eval", "--checkpoint", str(checkpoint), "--data", str(chat_store),
                                              *SPLIT, "--batches", "2", "--passkey-trials", "0"]), 2,
                     "the 2 validation sequences of 32 tokens of", "that --batches 2 scores hold no answer token",
                     "--long-conversations split cuts conversations into pieces",
                     "raise --seq-len or --batches, use --long-conversations truncate")
    assert "diverged" not in output
