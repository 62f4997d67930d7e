"""The configuration's edges (issue 45): a refused invocation changes nothing, a run's config.toml reused as
--config asks only for what its run was asked for, a setting given that would never be read is refused, a stray
LOCAL_WORLD_SIZE outside torchrun is not read; `burst --version`, and `--help` that fits 80 columns."""

import importlib.metadata
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli import app
from evaluation.run import EvalConfig
from evaluation.run import ignored_settings as eval_ignored
from runtime.launch import local_world_size
from runtime.process import worker_device
from tests.test_bad_input import invoke, refused
from tests.test_instruction_training import chat_store as chat_store  # noqa: F401
from tests.test_preference import make_pair_store
from trainer.config import given_in_file, ignored_settings, load_config, save_config
from trainer.preflight import check_run

TINY_RUN = ("--model", "debug", "--seq-len", 128, "--precision", "fp32", "--val-tokens", 0)


def test_a_refused_resume_leaves_the_runs_config_as_it_was(store, tmp_path):
    out = tmp_path / "run"
    done = invoke("train", *TINY_RUN, "--data", store, "--steps", 2, "--stop-after", 1, "--out", out)
    assert done.exit_code == 0, done.output
    recorded = (out / "config.toml").read_bytes()
    refused(invoke("train", "--resume", "--out", out, "--attention-kernel", "flash"), "'flash' cannot run here")
    assert (out / "config.toml").read_bytes() == recorded
    resumed = invoke("train", "--resume", "--out", out)  # and the plain resume that follows still works
    assert resumed.exit_code == 0, resumed.output


def test_a_runs_config_reused_asks_for_neither_its_device_nor_its_directory_nor_its_cut_warmup(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    ran = load_config(None, {"model": "debug", "steps": 3, "device": "cpu", "out": str(out)})
    assert ran.warmup == 2  # the recipe's 5, cut to the 3-step run
    save_config(ran, out / "config.toml", notes="precision fp32: as requested\ndevice cpu: --device cpu")
    again = load_config(out / "config.toml", {"steps": 100})
    assert (again.device, again.out, again.warmup) == (None, None, 5)
    assert again.seq_len == ran.seq_len and again.lr == ran.lr  # what the run was asked for stays
    assert given_in_file(out / "config.toml") == set()  # recorded, not asked for: none of it counts as given
    mine = tmp_path / "mine.toml"  # a file the user wrote keeps every value as a request
    mine.write_text('device = "cpu"\nsteps = 3\nwarmup = 2\nmodel = "debug"\n')
    kept = load_config(mine, {"steps": 100})
    assert (kept.device, kept.warmup) == ("cpu", 2) and given_in_file(mine) == {"device", "steps", "warmup", "model"}


def test_a_config_files_preference_setting_with_nll_is_refused_naming_the_file(store, tmp_path):
    settings = tmp_path / "run.toml"
    settings.write_text("beta = 0.2\n")
    refused(invoke("train", "--config", settings, *TINY_RUN, "--data", store, "--out", tmp_path / "run"),
            f"beta in {settings} is a preference objective's", "drop it")
    assert not (tmp_path / "run").exists()
    settings.write_text("simpo_gamma = 1.0\n")
    refused(invoke("train", "--config", settings, *TINY_RUN, "--data", store, "--out", tmp_path / "run"),
            "simpo_gamma in")


@pytest.mark.parametrize(("flags", "setting", "why"), [
    ({"prefix_sharing": False}, "prefix_sharing", "the next-token loss has no pairs"),
    ({"val_tokens": 0, "val_every": 5}, "val_every", "--val-tokens 0 turns validation off"),
    ({"long_conversations": "truncate"}, "long_conversations", "no --data store holds conversations"),
    ({"lora_alpha": 32.0}, "lora_alpha", "shapes a LoRA adapter, which only --lora-rank N trains"),
    ({"lora_dropout": 0.1}, "lora_dropout", "without it the run trains every weight"),
    ({"lora_rank": 0, "lora_targets": "q,v"}, "lora_targets", "which only --lora-rank N trains"),
    ({"train_embeddings_and_norms": False}, "train_embeddings_and_norms", "which only --lora-rank N trains"),
])
def test_train_settings_given_that_the_run_never_reads_are_refused(store, flags, setting, why):
    config = load_config(None, {"model": "debug", "data": [str(store)], **flags})
    assert why in ignored_settings(config, set(flags))[setting]
    refused(invoke("train", *TINY_RUN, "--data", store, *_flags(flags)), why)


def test_lora_settings_are_read_with_a_rank_and_refused_beside_an_adapter_that_brings_its_own(store, tmp_path):
    """With --lora-rank they shape the adapter; with --init-adapter the adapter's adapter_config.json replaces them
    (its rank may be repeated); in a config file without a rank they are refused naming the file."""
    with_rank = load_config(None, {"model": "debug", "lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "q,v"})
    assert not {"lora_alpha", "lora_targets"} & set(ignored_settings(with_rank, {"lora_alpha", "lora_targets"}))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, '
                                                 '"target_modules": ["q_proj", "v_proj"]}')
    both = load_config(None, {"model": "debug", "init_adapter": str(adapter), "lora_rank": 4, "lora_alpha": 32.0})
    ignored = ignored_settings(both, {"init_adapter", "lora_rank", "lora_alpha"})
    assert "lora_rank" not in ignored and "init_adapter" not in ignored
    assert ignored["lora_alpha"].startswith("is the adapter's own with --init-adapter (its lora_alpha is 8.0")
    refused(invoke("train", *TINY_RUN, "--data", store, "--init-adapter", adapter, "--lora-alpha", 32),
            "--lora-alpha is the adapter's own with --init-adapter", "drop it")
    settings = tmp_path / "run.toml"
    settings.write_text("lora_dropout = 0.1\n")
    refused(invoke("train", "--config", settings, *TINY_RUN, "--data", store, "--out", tmp_path / "run"),
            f"lora_dropout in {settings} shapes a LoRA adapter, which only --lora-rank N trains", "drop it")
    assert not (tmp_path / "run").exists()


def _flags(settings: dict) -> list:
    """`settings` as the command line spells them."""
    line = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        line += [flag.replace("--", "--no-", 1)] if value is False else [flag] if value is True else [flag, value]
    return line


def test_long_conversations_on_instruction_and_preference_stores_is_read_not_refused(chat_store, tmp_path):
    for data, objective in ((chat_store, "nll"), (make_pair_store(tmp_path / "pairs"), "dpo")):
        config = load_config(None, {"model": "debug", "data": [str(data)], "objective": objective,
                                    "long_conversations": "truncate"})
        assert "long_conversations" not in ignored_settings(config, {"long_conversations"})


def test_eval_settings_given_that_it_never_reads_are_refused(store, tmp_path):
    text = load_store(store)
    no_passkeys = EvalConfig(checkpoint=Path("nowhere"), passkey_trials=0, device="cpu")
    assert "--passkey-trials 0 skips" in eval_ignored(no_passkeys, text)["passkey_lengths"]
    assert "passkey_lengths" not in eval_ignored(EvalConfig(checkpoint=Path("nowhere"), device="cpu"), text)
    assert "holds documents" in eval_ignored(no_passkeys, text)["qa_samples"]
    pairs = load_store(make_pair_store(tmp_path / "pairs"))
    assert "preference store's validation pairs" in eval_ignored(no_passkeys, pairs)["batches"]
    assert "batches" not in eval_ignored(no_passkeys, text)


def load_store(path: Path):
    from data import TokenStore

    return TokenStore(path)


@pytest.mark.parametrize("stray", ["0", "64", "two"])
def test_a_stray_local_world_size_outside_torchrun_is_not_read(tmp_path, monkeypatch, stray):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", stray)
    assert local_world_size(2) == 2
    threads = torch.get_num_threads()
    try:
        worker_device("cpu")  # at 0: was a ZeroDivisionError
    finally:
        torch.set_num_threads(threads)
    # at 64: was refused for 64 local ranks' memory (170 GiB), suggesting settings of 64 ranks that exceed it too
    config = load_config(None, {"model": "tiny", "seq_len": 4096, "precision": "fp32", "out": str(tmp_path / "run")})
    assert check_run(config, 1).device.kind == "cpu"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # under torchrun it is the launcher's word, checked
    if stray == "64":
        assert local_world_size(2) == 64
    else:
        with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE='{stray}', set by the launcher"):
            local_world_size(2)


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"burst {importlib.metadata.version('burst-attention')}\n"


@pytest.mark.parametrize("command", [[], ["train"], ["eval"], ["plan"], ["prepare"], ["convert-checkpoint"],
                                     ["bench", "attention"]])
def test_help_fits_80_columns_with_nothing_cut_off(command):
    text = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80"}, terminal_width=80).output
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text, text
    assert "--help" in text and len(text.splitlines()) < 300  # train's was 493 lines in rich's boxes
