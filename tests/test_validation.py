"""Validation sized in held-out tokens: each token scored at most once a pass however long the sequences, the cost
said before the first pass, progress while it runs, the distinct tokens in the event and the summary, the sources
left out named; --val-sequences refused, naming --val-tokens."""

from __future__ import annotations

import io
import math
import random

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cli import app
from data import SequenceLoader, TokenStore, prepare
from tests.fixtures import events, make_text
from tests.test_instruction_training import chat_store  # noqa: F401 (a fixture)
from tests.test_tokenizers import refused
from trainer.config import TrainConfig, load_config, load_run_config, save_config
from trainer.metrics import Metrics

DEBUG = ["--model", "debug", "--steps", "1", "--precision", "fp32"]


def scored_once(split: TokenStore, seq_len: int, cp: int = 1) -> tuple[int, int]:
    """The labels a validation loader scores over its first epoch's sequences and two more (summed over `cp`
    ranks), and how many sequences that epoch takes."""
    total = 0
    for cp_rank in range(cp):
        loader = SequenceLoader(split, seq_len, 1, cp_rank=cp_rank, cp_size=cp, once=True,
                                reset_positions=split.is_conversations, long_conversations="split")
        total += sum(next(loader).num_tokens for _ in range(loader.first_epoch_sequences + 2))
    return total, loader.first_epoch_sequences


def test_a_validation_loader_scores_each_held_out_token_once_however_long_its_sequences(store, chat_store):  # noqa: F811
    val = TokenStore(store).split("val")
    stream = val.num_tokens + 2 * val.num_documents  # BOS + document + EOS each
    for seq_len, cp in ((128, 1), (256, 2), (8192, 2)):  # the last: one sequence longer than the whole split
        scored, sequences = scored_once(val, seq_len, cp)
        assert sequences == math.ceil((stream - 1) / seq_len)
        assert scored == val.num_tokens + val.num_documents  # every document token and its EOS, once: no BOS
    repeating = SequenceLoader(val, 8192, 1)  # training's loader goes on into the next epoch
    assert next(repeating).num_tokens > 2 * scored
    conversations = TokenStore(chat_store).split("val")
    scored, sequences = scored_once(conversations, 64)
    loader = SequenceLoader(conversations, 64, 1, reset_positions=True, long_conversations="split")
    assert scored == sum(next(loader).num_tokens for _ in range(sequences)) > 0  # the first epoch's answers only


@pytest.fixture(scope="module")
def unsplit_store(store, tmp_path_factory):  # noqa: F811
    """A store of the same tokenizer with no validation split."""
    root = tmp_path_factory.mktemp("unsplit")
    (root / "docs").mkdir()
    rng = random.Random(1)
    for i in range(6):
        (root / "docs" / f"doc{i}.py").write_text(make_text(rng, 150))
    prepare([root / "docs"], root / "store", tokenizer=store, val_fraction=0, progress=False)
    return root / "store"


def test_a_pass_longer_than_the_split_scores_it_whole_once_and_names_the_sources_left_out(store, unsplit_store,  # noqa: F811
                                                                                            tmp_path):
    out = tmp_path / "run"
    done = CliRunner().invoke(app, ["train", *DEBUG, "--data", f"main={store}:0.5", "--data",
                                    f"unsplit={unsplit_store}:0.5", "--seq-len", "2048", "--out", str(out)])
    assert done.exit_code == 0, done.output
    val = TokenStore(store).split("val")
    [plan] = events(out, "validation_plan")
    assert plan == {"event": "validation_plan", "sequences": 1, "seq_len": 2048, "val_tokens": 2 * 2048,
                    "forward_tokens": 2048, "step_tokens": 2048, "split_tokens": val.num_tokens,
                    "scored_tokens": val.num_tokens + val.num_documents, "whole_split": True, "left_out": ["unsplit"]}
    rows = events(out, "validation")
    assert [r["at_step"] for r in rows] == [0, 1]
    for row in rows:  # the old --val-sequences 8 scored 8 x 2048 tokens of a split of 1,313, over and over
        assert row["held_out_tokens"] == val.num_tokens + val.num_documents and row["sequences"] == 1
        assert row["left_out"] == ["unsplit"]
    output = " ".join(done.output.split())
    tokens = f"{val.num_tokens + val.num_documents:,}"  # issue 35, defect 4: the plan counted val.num_tokens
    assert (f"validation: {tokens} held-out tokens scored (all the validation split fills; it holds "
            f"{val.num_tokens:,}) per pass, 1 sequence of 2,048 tokens forward only: 100% of a step's tokens, about "
            f"33% of a step's time; left out, having no validation split: unsplit") in output
    assert output.index(f"validation: {tokens} held-out") < output.index("validation loss")
    assert f"at step 0 over {tokens} held-out tokens (1 sequence," in output
    assert f"(step 1) over {tokens} held-out tokens; training loss" in output


def test_the_plan_counts_the_tokens_each_pass_of_a_mixture_scores(store, tmp_path):  # noqa: F811
    """Issue 35, defect 4: with a mixture and --val-tokens above the splits, the plan said "the whole validation
    split (70,053 tokens)" while each pass scored 39,363 (a small split cannot fill its share of sequences)."""
    (tmp_path / "docs").mkdir()
    rng = random.Random(2)
    for i in range(4):
        (tmp_path / "docs" / f"doc{i}.py").write_text(make_text(rng, 40))
    prepare([tmp_path / "docs"], tmp_path / "small", tokenizer=store, val_fraction=0.5, progress=False)
    out = tmp_path / "run"
    done = CliRunner().invoke(app, ["train", *DEBUG, "--data", f"main={store}:0.2", "--data",
                                    f"small={tmp_path / 'small'}:0.8", "--seq-len", "128", "--val-tokens", "100000",
                                    "--out", str(out)])
    assert done.exit_code == 0, done.output
    [plan] = events(out, "validation_plan")
    passes = events(out, "validation")
    assert [row["held_out_tokens"] for row in passes] == [plan["scored_tokens"]] * 2 and plan["whole_split"]
    output = " ".join(done.output.split())
    assert f"validation: {plan['scored_tokens']:,} held-out tokens scored" in output
    assert f"over {plan['scored_tokens']:,} held-out tokens" in output


def test_a_budget_takes_whole_sequences_and_shows_progress_lines(store, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    done = CliRunner().invoke(app, ["train", *DEBUG, "--data", str(store), "--seq-len", "128", "--val-tokens", "300",
                                    "--out", str(out)])
    assert done.exit_code == 0, done.output
    [plan] = events(out, "validation_plan")
    assert plan["sequences"] == 3 and not plan["whole_split"] and plan["forward_tokens"] == 384
    [first, last] = events(out, "validation")
    assert 300 - 3 <= first["held_out_tokens"] == last["held_out_tokens"] == plan["scored_tokens"] <= 384
    output = " ".join(done.output.split())
    assert (f"validation: {first['held_out_tokens']} held-out tokens scored (--val-tokens 300; the validation split "
            f"holds") in output
    assert "3 sequences of 128 tokens forward only: 3.0 steps' tokens, about 100% of a step's time" in output
    lines = done.output.splitlines()
    # 3 sequences x 2 blocks of the debug model: a line at each quarter of the 6 blocks' forwards, in each pass
    assert [line.split()[:2] for line in lines if line.startswith("validation ") and " eta " in line] == \
        [["validation", "2/6"], ["validation", "3/6"], ["validation", "5/6"]] * 2
    assert f"over {first['held_out_tokens']} held-out tokens (3 sequences" in output


def test_progress_is_a_bar_on_a_terminal_and_quarter_lines_in_a_log(tmp_path, capsys):
    terminal = Metrics(tmp_path, 10, Console(file=io.StringIO(), force_terminal=True))
    for done in range(9):
        terminal.progress("validation", done, 8)
        assert len(terminal._progress.tasks) == (2 if done < 8 else 1)  # beside training's, removed at the end
    terminal.close()
    (tmp_path / "log").mkdir()
    log = Metrics(tmp_path / "log", 10, Console(file=io.StringIO()))
    for done in range(9):
        log.progress("validation", done, 8)
    log.close()
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == ["2/8", "4/8", "6/8"]


def test_val_sequences_is_refused_naming_val_tokens_and_an_old_run_resumes(tmp_path):
    refused(CliRunner().invoke(app, ["train", "--val-sequences", "8"]), 2,
            "--val-sequences was replaced by --val-tokens", "pass --val-tokens N (N sequences are N x --seq-len")
    settings = tmp_path / "run.toml"
    settings.write_text("val_sequences = 8\n")
    with pytest.raises(ValueError, match=f"val_sequences in {settings} was replaced by --val-tokens"):
        load_config(settings)
    old_run = tmp_path / "old"  # a run of before val_tokens: its config.toml recorded val_sequences, set or not
    old_run.mkdir()
    (old_run / "config.toml").write_text("seq_len = 131072\ncp = 2\nval_sequences = 8\n")
    assert load_run_config(old_run, {}).val_tokens == 2 * 131072
    assert load_run_config(old_run, {"val_tokens": 5000}).val_tokens == 5000  # --resume may change it


def test_the_default_budget_is_two_steps_tokens_and_is_recorded(tmp_path):
    assert TrainConfig().val_tokens == 2048  # seq_len 1024: two sequences, as many as two steps
    assert TrainConfig(seq_len=256).val_tokens == 2048  # short steps: at least 2,048 tokens
    long = TrainConfig(seq_len=131072, cp=2, dp=2, grad_accum=2)
    assert long.val_tokens == 2 * long.tokens_per_step == 1048576
    with pytest.raises(ValueError, match="--val-tokens -1 must not be negative"):
        TrainConfig(val_tokens=-1)
    path = tmp_path / "config.toml"
    save_config(long, path)
    assert "val_tokens = 1048576" in path.read_text() and load_config(path) == long
