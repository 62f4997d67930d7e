"""Bad input never costs data, never lies, never ends in a traceback: one test per case of issue 16.

Each test gives a command the bad input a careless user or an adversary would, and checks the exit
code, that the message names what is wrong and how to fix it, and that nothing was lost.
"""

import dataclasses
import gzip
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from cli import app
from data import TokenStore, prepare
from data.store import METADATA_FILE, OFFSETS_FILE
from models import ModelConfig, Transformer, save_model
from planner import RunShape, memory_estimate
from planner import fit as planner_fit
from planner.hardware import memory_only
from tests.test_data_prepare import tokenizer as tokenizer  # noqa: F401  (module-scoped fixtures)
from tests.test_data_prepare import write_corpus
from trainer import preflight
from trainer.config import TrainConfig


def invoke(*args) -> "CliRunner.invoke":
    return CliRunner().invoke(app, [str(a) for a in args])


def refused(result, *phrases: str, code: int = 2) -> str:
    """Assert that the command exited with `code`, with every phrase in its output and no traceback."""
    output = result.output
    assert result.exit_code == code, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in output
    for phrase in phrases:
        assert phrase in output, output
    return output


@pytest.fixture
def corpus(tmp_path) -> Path:
    write_corpus(tmp_path / "corpus")
    return tmp_path / "corpus"


@pytest.fixture
def small_store(tmp_path, corpus, tokenizer) -> Path:  # noqa: F811
    out = tmp_path / "store"
    prepare([corpus], out, tokenizer=tokenizer.path, val_fraction=0.2, progress=False)
    return out


# ---- burst prepare ---------------------------------------------------------------------------------------------

def test_prepare_force_does_not_delete_a_directory_that_is_not_a_token_store(tmp_path, corpus, tokenizer):  # noqa: F811
    out = tmp_path / "results"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    output = refused(invoke("prepare", corpus, "--out", out, "--tokenizer", tokenizer.path, "--force"),
                     "is a directory burst did not write", "it holds thesis.tex", "not a token store",
                     "so it will not delete")
    assert (out / "thesis.tex").read_text() == "years of work" and "force=True" not in output


def test_prepare_refuses_the_same_files_given_twice(tmp_path, corpus, tokenizer):  # noqa: F811
    refused(invoke("prepare", corpus, corpus, "--out", tmp_path / "a", "--tokenizer", tokenizer.path),
            "given twice", "pass each file or directory once")
    refused(invoke("prepare", corpus / "a.txt", corpus, "--out", tmp_path / "b", "--tokenizer", tokenizer.path),
            "given twice")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("case", ["empty directory", "jsonl without the field", "binary in a directory"])
def test_prepare_without_usable_text_says_what_to_pass_instead_of_a_sentencepiece_error(tmp_path, case):
    inputs = tmp_path / "in"
    inputs.mkdir()
    if case == "jsonl without the field":
        (inputs / "rows.jsonl").write_text(json.dumps({"body": "some text"}) + "\n")
    elif case == "binary in a directory":
        (inputs / "blob.bin").write_bytes(bytes(range(256)))
    output = refused(invoke("prepare", inputs, "--out", tmp_path / "store", "--vocab-size", 300), "no documents")
    assert ("--text-field" in output) == (case == "jsonl without the field")
    assert "sentences_" not in output and not (tmp_path / "store").exists()
    assert not list(tmp_path.glob("store.tmp-*"))


def test_prepare_refuses_a_tokenizer_that_is_not_a_sentencepiece_model(tmp_path, corpus):
    (tmp_path / "notes.model").write_text("not a model")
    refused(invoke("prepare", corpus, "--out", tmp_path / "store", "--tokenizer", tmp_path / "notes.model"),
            "is not a SentencePiece .model file")


def test_prepare_refuses_a_negative_seed(tmp_path, corpus, tokenizer):  # noqa: F811
    refused(invoke("prepare", corpus, "--out", tmp_path / "store", "--tokenizer", tokenizer.path, "--seed", "-1"),
            "--seed -1 must be between 0 and")


def test_prepare_refuses_a_vocabulary_no_tokenizer_has_and_reports_a_smaller_one(tmp_path, corpus):
    refused(invoke("prepare", corpus, "--out", tmp_path / "a", "--vocab-size", 10_000_000),
            "--vocab-size 10,000,000 must be between 300")
    done = invoke("prepare", corpus, "--out", tmp_path / "b", "--vocab-size", 5000)
    assert done.exit_code == 0, done.output
    got = TokenStore(tmp_path / "b").vocab_size
    assert got < 5000 and f"vocabulary of {got:,} tokens, not the 5,000 asked for" in done.output


def test_prepare_refuses_binary_files_named_on_the_command_line(tmp_path, corpus, tokenizer):  # noqa: F811
    (tmp_path / "model.bin").write_bytes(np.random.default_rng(0).bytes(4096))
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(b'{"text": "fine"}\n'))  # binary on disk, read as jsonl
    refused(invoke("prepare", corpus, tmp_path / "model.bin", "--out", tmp_path / "store", "--tokenizer",
                   tokenizer.path), "model.bin is not UTF-8 text")
    done = invoke("prepare", tmp_path / "rows.jsonl.gz", "--out", tmp_path / "store", "--tokenizer", tokenizer.path)
    assert done.exit_code == 0, done.output


def test_a_store_and_its_files_follow_the_umask(tmp_path, corpus, tokenizer):  # noqa: F811
    previous = os.umask(0o022)
    try:
        prepare([corpus], tmp_path / "store", tokenizer=tokenizer.path, progress=False)
    finally:
        os.umask(previous)
    for path in [tmp_path / "store", *(tmp_path / "store").iterdir()]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o044 == 0o044, f"{path} is {oct(mode)}: the rest of a team cannot read it"


# ---- the token store, checked on open --------------------------------------------------------------------------

def edit_metadata(store: Path, **changes) -> None:
    meta = json.loads((store / METADATA_FILE).read_text())
    for key, value in changes.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    (store / METADATA_FILE).write_text(json.dumps(meta))


def test_a_store_whose_metadata_lacks_the_tokenizer_is_refused_on_open(small_store):
    edit_metadata(small_store, tokenizer=None)
    with pytest.raises(ValueError, match="damaged token store: metadata.json lacks valid tokenizer.kind"):
        TokenStore(small_store)


def test_a_store_whose_vocabulary_is_below_its_token_ids_is_refused_on_open(small_store):
    meta = json.loads((small_store / METADATA_FILE).read_text())
    edit_metadata(small_store, tokenizer={**meta["tokenizer"], "vocab_size": 100})
    with pytest.raises(ValueError, match="holds token id .* but metadata.json gives a vocabulary of 100 tokens"):
        TokenStore(small_store)
    edit_metadata(small_store, tokenizer={**meta["tokenizer"], "vocab_size": 100}, max_token_id=None)  # older store
    with pytest.raises(ValueError, match="vocabulary of 100 tokens"):
        TokenStore(small_store)


def test_a_store_with_an_offset_past_its_tokens_is_refused_on_open(small_store):
    offsets = np.fromfile(small_store / OFFSETS_FILE, np.int64)
    offsets[3] = 10**12
    offsets.tofile(small_store / OFFSETS_FILE)
    with pytest.raises(ValueError, match="offsets.bin does not rise from 0 to num_tokens"):
        TokenStore(small_store)


# ---- burst convert-checkpoint ----------------------------------------------------------------------------------

@pytest.fixture
def native_model(tmp_path) -> Path:
    """A `debug` model saved natively inside a directory that also holds the user's other work."""
    model_dir = tmp_path / "project" / "model"
    save_model(Transformer(ModelConfig.from_name("debug")), ModelConfig.from_name("debug"), model_dir)
    (tmp_path / "project" / "notes.md").write_text("keep me")
    return model_dir


def test_convert_checkpoint_never_replaces_the_directory_that_holds_its_source(native_model):
    project = native_model.parent
    refused(invoke("convert-checkpoint", native_model, project, "--to", "hf", "--force"),
            "holds the source", "which --force would delete")
    assert (project / "notes.md").read_text() == "keep me" and (native_model / "config.json").is_file()


def test_exported_weights_follow_the_umask(native_model, tmp_path):
    previous = os.umask(0o022)
    try:
        assert invoke("convert-checkpoint", native_model, tmp_path / "hf", "--to", "hf").exit_code == 0
    finally:
        os.umask(previous)
    for path in [native_model / "model.safetensors", tmp_path / "hf" / "model.safetensors"]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o044 == 0o044, f"{path} is {oct(mode)}: the rest of a team cannot read it"


# ---- burst train -----------------------------------------------------------------------------------------------

def test_a_run_whose_weights_overflowed_saves_no_checkpoint_and_says_so(store, tmp_path, monkeypatch):
    """--lr inf used to apply step 1 with a finite loss, ruin the weights, then save them as 'the last good state'."""
    import trainer.trainer

    build_optimizer = trainer.trainer.build_optimizer

    def overflowing_optimizer(model, config):  # a step with a finite loss and gradient that overflows the weights
        optimizer = build_optimizer(model, config)
        optimizer.register_step_post_hook(lambda *_: next(model.parameters()).data.fill_(float("inf")))
        return optimizer

    monkeypatch.setattr(trainer.trainer, "build_optimizer", overflowing_optimizer)
    out = tmp_path / "run"
    output = refused(invoke("train", "--model", "debug", "--data", store, "--seq-len", 128, "--steps", 8,
                            "--precision", "fp32", "--out", out), "non-finite values", "no checkpoint is saved",
                     "--lr", code=1)
    assert "last good state" not in output and not list((out / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("lr, message", [("inf", "--lr inf must be a finite number"),
                                         ("nan", "--lr nan must be a finite number"),
                                         ("1e9", "--lr 1000000000.0 would wreck the weights")])
def test_a_learning_rate_that_cannot_train_is_refused_at_config_time(store, tmp_path, lr, message):
    refused(invoke("train", "--model", "debug", "--data", store, "--lr", lr, "--out", tmp_path / "run"), message)
    assert not (tmp_path / "run").exists()


def test_a_misspelt_data_option_is_named_not_taken_for_part_of_the_store_path(store, tmp_path):
    refused(invoke("train", "--model", "debug", "--data", f"sft={store}:1:mindoc=400", "--out", tmp_path / "run"),
            "unknown option mindoc (did you mean min_doc?)")
    assert not (tmp_path / "run").exists()


def test_resume_in_a_config_file_is_refused_and_the_run_is_untouched(store, tmp_path):
    out = tmp_path / "run"
    done = invoke("train", "--model", "debug", "--data", store, "--seq-len", 128, "--steps", 2, "--precision",
                  "fp32", "--out", out)
    assert done.exit_code == 0, done.output
    saved = (out / "config.toml").read_text()
    settings = tmp_path / "more.toml"
    settings.write_text(f'resume = true\nout = "{out}"\nsteps = 4\nlr = 0.5\n')
    refused(invoke("train", "--config", settings), "sets resume", "come from the command line", "--resume")
    assert (out / "config.toml").read_text() == saved and "lr = 0.5" not in saved


def test_stop_after_past_the_last_step_is_refused(store, tmp_path):
    refused(invoke("train", "--model", "debug", "--data", store, "--steps", 4, "--stop-after", 9, "--out",
                   tmp_path / "run"), "--stop-after 9 must be a step of the run, 1 to --steps 4")


def test_a_relative_data_path_is_saved_absolute_so_resume_works_from_another_directory(store, tmp_path,
                                                                                        monkeypatch):
    out = tmp_path / "run"
    monkeypatch.chdir(store.parent)
    done = invoke("train", "--model", "debug", "--data", store.name, "--seq-len", 128, "--steps", 2,
                  "--stop-after", 1, "--precision", "fp32", "--out", out)
    assert done.exit_code == 0, done.output
    assert f'={store}:1.0"]' in (out / "config.toml").read_text()  # data = ["NAME=/absolute/store:1.0"]
    monkeypatch.chdir(tmp_path)
    resumed = invoke("train", "--resume", "--out", out)
    assert resumed.exit_code == 0, resumed.output
    monkeypatch.chdir(store.parent)
    assert invoke("train", "--resume", "--data", store.name, "--out", out).exit_code == 2  # finished, not "different"


def test_train_help_shows_each_default():
    help_text = " ".join(CliRunner().invoke(app, ["train", "--help"]).output.split())
    for shown in ("[default: (1024)]", "[default: (the embedded stdlib corpus)]",
                  "[default: (tiny, or --init-from's model)]",
                  "130 after Ctrl-C, 143 after SIGTERM"):  # and the exit codes a scheduler sees
        assert shown in help_text


def test_setting_errors_name_the_flag_not_the_field(store, tmp_path):
    output = refused(invoke("train", "--model", "debug", "--data", store, "--seq-len", 0), "--seq-len 0 must be")
    assert "seq_len =" not in output


def test_ctrl_c_during_start_up_exits_130_and_a_rerun_may_use_the_directory(store, tmp_path, monkeypatch):
    import trainer.trainer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "run"
    common = ["--model", "debug", "--data", store, "--seq-len", 128, "--steps", 1, "--precision", "fp32", "--out", out]
    with monkeypatch.context() as patch:
        patch.setattr(trainer.trainer, "build_model", interrupted)
        refused(invoke("train", *common), "interrupted during start-up", "nothing was trained", code=130)
    done = invoke("train", *common)
    assert done.exit_code == 0, done.output


def test_a_sequence_longer_than_the_training_split_is_refused_before_any_work(small_store, tmp_path):
    refused(invoke("train", "--model", "debug", "--data", small_store, "--seq-len", 100_000_000, "--out",
                   tmp_path / "run"), "--seq-len 100,000,000 is longer than the training documents of --data")
    assert not (tmp_path / "run").exists()


def test_a_sequence_whose_activations_cannot_fit_is_refused_before_any_work(small_store, monkeypatch):
    config = TrainConfig(model="debug", data=str(small_store), seq_len=1024)
    monkeypatch.setattr(planner_fit, "available_memory_bytes", lambda: 2**30)  # a machine of 1 GiB: it fits
    preflight.check_run(config, world_size=1)
    monkeypatch.setattr(planner_fit, "available_memory_bytes", lambda: 2**28)  # 256 MiB: not even the process
    with pytest.raises(ValueError, match=r"1 local rank on this machine would need about 0.\d GiB \(per rank, "
                                         r"GiB: weights 0.00, .*activations 0.0\d, .*process 0.\d\d\) but 0.2 GiB"):
        preflight.check_run(config, world_size=1)


def test_activations_too_large_to_keep_are_refused_naming_the_recomputation_that_fits(monkeypatch):
    """burst train --seq-len 131072 --cp 2 kept ~14 GiB of activations a rank and was killed for memory on a
    24 GiB machine after its first validation pass (18 minutes); the estimate counted only each block's input."""
    tiny = ModelConfig.from_name("tiny")
    monkeypatch.setattr(planner_fit, "available_memory_bytes", lambda: 23 * 2**30)
    config = RunShape(seq_len=65536, cp=2)  # at 131,072 on 23 GiB nothing fits any more
    parts, _ = memory_estimate(config, tiny, memory_only("cpu", 23 * 2**30, 2), local_ranks=2)
    assert parts["activations"] >= 8 * 2**30  # fitted: 3.2 bytes a value of a block's width (plan_calibration.py)
    with pytest.raises(ValueError, match=r"2 local ranks on this machine would need about \d\d\.\d GiB .* use "
                                         r"--cp \d --dp \d --activation-checkpointing (selective|full) "
                                         r"\(about \d+\.\d GiB"):
        planner_fit.check_fits(config, tiny, 2)
    planner_fit.check_fits(dataclasses.replace(config, activation_checkpointing="full"), tiny, 2)  # fits
    nothing_fits = r"but 23\.0 GiB are available; lower --seq-len \(to \d+,\d+ as set\)"
    with pytest.raises(ValueError, match=nothing_fits):
        planner_fit.check_fits(dataclasses.replace(config, seq_len=1048576), tiny, 2)


def test_more_local_ranks_than_the_machine_can_hold_are_refused_before_any_process_starts(small_store, tmp_path):
    out = tmp_path / "run"
    output = refused(invoke("train", "--model", "debug", "--data", small_store, "--seq-len", 64, "--dp", 1000,
                            "--out", out), "1000 local ranks on this machine would need about", "GiB are available",
                     "spread the ranks over more machines with torchrun")
    assert "Traceback" not in output and not out.exists()


def test_a_truncated_model_is_refused_before_the_run_directory_is_made(store, tmp_path):
    config = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=TokenStore(store).vocab_size)
    broken = tmp_path / "model"
    save_model(Transformer(config), config, broken)
    (broken / "model.safetensors").write_bytes((broken / "model.safetensors").read_bytes()[:1000])
    out = tmp_path / "run"
    refused(invoke("train", "--model", broken, "--data", store, "--seq-len", 128, "--steps", 1, "--out", out),
            "model.safetensors")
    assert not out.exists()  # the file headers are read (and checked) before any work


def test_a_run_that_failed_during_start_up_does_not_block_a_rerun(store, tmp_path, monkeypatch):
    import trainer.trainer

    def failing_build_model(*args, **kwargs):
        raise ValueError("start-up failed while building the model")

    out = tmp_path / "run"
    common = ["--model", "debug", "--data", store, "--seq-len", 128, "--steps", 1, "--precision", "fp32",
              "--out", out]
    with monkeypatch.context() as patch:
        patch.setattr(trainer.trainer, "build_model", failing_build_model)
        refused(invoke("train", *common), "start-up failed while building the model")
    assert not out.exists()  # the run directory is written only once the model is built and checked
    done = invoke("train", *common)
    assert done.exit_code == 0, done.output
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]


# ---- burst eval ------------------------------------------------------------------------------------------------

@pytest.fixture
def model_for_store(store, tmp_path) -> Path:
    """A `debug` model with the vocabulary of the `store` fixture, saved natively (no tokenizer beside it)."""
    config = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=TokenStore(store).vocab_size)
    save_model(Transformer(config), config, tmp_path / "model")
    return tmp_path / "model"


def evaluate_args(checkpoint: Path, store: Path, *more) -> list:
    return ["eval", "--checkpoint", checkpoint, "--data", store, "--seq-len", 128, "--batches", 1, "--buckets", 2,
            "--passkey-trials", 0, *more]


def test_eval_of_a_run_on_data_of_another_tokenizer_is_refused(small_store, store, tmp_path):
    out = tmp_path / "run"
    done = invoke("train", "--model", "debug", "--data", small_store, "--seq-len", 64, "--steps", 1, "--precision",
                  "fp32", "--out", out)
    assert done.exit_code == 0, done.output
    refused(invoke(*evaluate_args(out, store)), "was prepared with another tokenizer than the model",
            f"--tokenizer {out} ")


@pytest.mark.parametrize("cp", [1, 2])
def test_eval_of_a_diverged_model_says_so_instead_of_printing_nan(model_for_store, store, cp):
    weights = load_file(model_for_store / "model.safetensors")
    weights["norm.weight"][0] = float("nan")
    save_file(weights, model_for_store / "model.safetensors", metadata={"format": "pt"})
    output = refused(invoke(*evaluate_args(model_for_store, store, "--cp", cp)), "holds non-finite weights",
                     "norm.weight", "evaluate an earlier checkpoint")
    assert "ChildFailedError" not in output


def test_eval_of_a_checkpoint_with_a_flipped_byte_says_so_instead_of_an_overflow_error(model_for_store, store):
    file = model_for_store / "model.safetensors"
    header = int.from_bytes(file.read_bytes()[:8], "little")
    start = json.loads(file.read_bytes()[8:8 + header])["output.weight"]["data_offsets"][0]
    data = bytearray(file.read_bytes())
    data[8 + header + start + 3] ^= 0x40  # the top exponent bit of the first float32 of output.weight: ~1e38
    file.write_bytes(bytes(data))
    output = refused(invoke(*evaluate_args(model_for_store, store)), "the model diverged or its weights are damaged",
                     code=1)
    assert "OverflowError" not in output


def test_eval_writes_its_results_to_stdout_and_progress_to_stderr(model_for_store, store):
    done = subprocess.run([sys.executable, "-m", "cli", *map(str, evaluate_args(model_for_store, store))],
                          capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=120)
    assert done.returncode == 0, done.stderr
    assert "perplexity" in done.stdout and "loss by position" in done.stdout
    assert "perplexity: 1 x 128 tokens" in done.stderr and "loss by position" not in done.stderr


def test_eval_json_refuses_to_overwrite_a_file_without_force(model_for_store, store, tmp_path):
    report = tmp_path / "results.json"
    report.write_text("last week's results")
    refused(invoke(*evaluate_args(model_for_store, store, "--json", report)), "already exists", "--force")
    assert report.read_text() == "last week's results"
    done = invoke(*evaluate_args(model_for_store, store, "--json", report, "--force"))
    assert done.exit_code == 0, done.output
    assert json.loads(report.read_text())["perplexity"] > 1


def test_eval_never_writes_its_json_and_its_plot_to_one_file(model_for_store, store, tmp_path):
    report = tmp_path / "res.png"
    refused(invoke(*evaluate_args(model_for_store, store, "--json", report)),
            f"--json {report} must end in .json: the plot is written beside it", f"--json {tmp_path / 'res.json'}")
    assert not report.exists()


def test_eval_passkey_lengths_that_do_not_split_suggest_one_that_does(model_for_store, store):
    refused(invoke(*evaluate_args(model_for_store, store, "--passkey-trials", 1, "--passkey-lengths", 0)),
            "--passkey-lengths: sequence length 0 must be a positive multiple of 2 x world size = 2", "use 2,")
    refused(invoke(*evaluate_args(model_for_store, store, "--passkey-trials", 1, "--passkey-lengths", 129)),
            "use 128 or 130,")


# ---- burst bench -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--heads", 0), ("--batch", 0), ("--head-dim", -4), ("--kv-heads", 0)])
def test_bench_attention_refuses_shapes_that_hold_nothing(flag, value):
    refused(invoke("bench", "attention", "--seq-len", 64, flag, value), f"{flag} {value} must be at least 1")


def test_a_model_config_with_no_kv_heads_is_refused_by_name_not_by_a_division_by_zero():
    with pytest.raises(ValueError, match="n_kv_heads = 0 must be at least 1"):
        ModelConfig(dim=64, n_heads=4, n_kv_heads=0)


@pytest.mark.parametrize("config, message", [
    ({"dim": None, "n_layers": 2}, "dim = None must be a whole number"),
    ({"model_type": "llama", "hidden_size": "64", "num_hidden_layers": 2, "num_attention_heads": 4,
      "vocab_size": 100, "intermediate_size": 128}, "hidden_size = '64' must be a whole number"),
])
def test_a_model_config_of_the_wrong_types_is_named_not_a_python_type_error(tmp_path, config, message):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    output = refused(invoke("convert-checkpoint", tmp_path / "model", tmp_path / "out", "--to", "burst"), message)
    assert "unsupported operand" not in output and "not supported between" not in output


# ---- burst prepare: rows that once cost their file or the whole prepare (issue 27) -------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("chat", [False, True])
def test_a_bom_a_lone_surrogate_and_deep_nesting_cost_one_row_each_and_no_traceback(tmp_path, chat):
    """Issue 27, defects 9 and 13: a UTF-8 BOM lost the first row as invalid JSON; a lone surrogate escape and
    100,000 nested brackets ended prepare in a traceback, in document and chat mode."""
    def row(text: str) -> str:
        return json.dumps({"messages": [{"role": "user", "content": "say it"}, {"role": "assistant", "content": text}]}
                          if chat else {"text": text})

    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b"\xef\xbb\xbf" + "\n".join([row("first row"), row("lone \ud800 surrogate").replace(
        "\\ud800", "\\uD800"), DEEP, row("last row")]).encode() + b"\n")
    tok = tmp_path / "tok"
    tok.mkdir()
    write_corpus(tok)
    tokenizer_args = ["--vocab-size", 300] if not chat else []
    if chat:
        prepare([tok], tmp_path / "text", vocab_size=300, progress=False)
        tokenizer_args = ["--tokenizer", tmp_path / "text"]
    result = invoke("prepare", rows, "--out", tmp_path / "store", *tokenizer_args, *(["--chat"] if chat else []),
                    "--val-fraction", 0)
    assert result.exit_code == 0, result.output
    store = TokenStore(tmp_path / "store")
    report = store.metadata["input_report"]
    assert report["documents"] == store.num_documents == 3 and report["invalid_json"] == 1
    assert report["invalid_utf8"] == 1
    text = [store.tokenizer().decode(store.document(i)) for i in range(3)]
    assert "first row" in text[0] and "lone \ufffd surrogate" in text[1] and "last row" in text[2]
    assert "rows.jsonl:3 (nested too deeply to read)" in result.output


def test_prepare_refuses_workers_below_one_and_an_out_under_a_file(tmp_path, corpus, tokenizer):  # noqa: F811
    """Issue 27, defects 18 and 19: --workers -1 was accepted without saying what it meant; --out a_file/store
    said only "File exists"."""
    refused(invoke("prepare", corpus, "--out", tmp_path / "store", "--tokenizer", tokenizer.path, "--workers", -1),
            "--workers -1 must be 1 or more", "leave it out to use every core")
    (tmp_path / "a_file").write_text("not a directory")
    refused(invoke("prepare", corpus, "--out", tmp_path / "a_file" / "store", "--tokenizer", tokenizer.path),
            f"{tmp_path / 'a_file'} is a file, not a directory")
    assert not (tmp_path / "store").exists() and (tmp_path / "a_file").read_text() == "not a directory"


def test_a_finished_run_is_extended_by_a_larger_steps_and_never_shortened(store, tmp_path):
    out = tmp_path / "run"
    done = invoke("train", "--model", "debug", "--data", store, "--seq-len", 128, "--steps", 2, "--precision",
                  "fp32", "--val-tokens", 0, "--out", out)
    assert done.exit_code == 0, done.output
    saved = (out / "config.toml").read_text()
    refused(invoke("train", "--resume", "--steps", 1, "--out", out), "--steps 1", "cannot be shortened",
            "--stop-after")
    assert (out / "config.toml").read_text() == saved
    extended = invoke("train", "--resume", "--steps", 3, "--out", out)
    assert extended.exit_code == 0, extended.output
    assert "extending the run from 2 to 3 steps" in " ".join(extended.output.split())
    steps = [json.loads(line).get("step") for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 3 in steps and "steps = 3" in (out / "config.toml").read_text()
