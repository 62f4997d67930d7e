"""Defaults by preset: each preset's training recipe fills the optimizer settings a flag or the config file leaves
unset (fine-tuning's for --model DIR and --init-from), a warmup longer than the run is cut and said, the settings
table says where each value came from, a resume keeps its recorded values; and preference and instruction stores
turn the document mask on by themselves."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

from models.config import FINE_TUNING, PRESETS, TrainingRecipe
from tests.fixtures import burst_train
from tests.test_preference import SEQ_LEN, make_pair_store
from trainer.config import RECIPE_FIELDS, load_config, load_run_config, recipe_origin, save_config, warmup_note
from trainer.preflight import check_run

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
FILE_VALUES = {"lr": 1e-4, "warmup": 7, "min_lr_ratio": 0.2, "weight_decay": 0.05, "beta1": 0.8, "beta2": 0.9,
               "max_grad_norm": 2.0}
FLAG_VALUES = {"lr": 5e-5, "warmup": 3, "min_lr_ratio": 0.3, "weight_decay": 0.01, "beta1": 0.85, "beta2": 0.99,
               "max_grad_norm": 0.5}


def test_every_preset_has_a_recipe_with_its_source_and_the_small_ones_keep_todays():
    RECIPES = {name: preset.recipe for name, preset in PRESETS.items()}
    for name, recipe in RECIPES.items():
        assert isinstance(recipe, TrainingRecipe) and len(recipe.source) > 40, name
    for name in ("debug", "tiny"):
        assert dataclasses.astuple(RECIPES[name])[:7] == (2e-3, 5, 0.1, 0.1, 0.9, 0.95, 1.0)
    for name in ("llama2-7b", "llama2-13b"):
        assert (RECIPES[name].lr, RECIPES[name].warmup, RECIPES[name].min_lr_ratio) == (3e-4, 2000, 0.1)
        assert "2307.09288" in RECIPES[name].source
    for name in ("llama3-8b", "llama3.1-8b", "llama3.2-1b", "llama3.2-3b"):
        assert (RECIPES[name].lr, RECIPES[name].warmup, RECIPES[name].min_lr_ratio) == (3e-4, 8000, 0.01)
        assert "2407.21783" in RECIPES[name].source
    assert "no pretraining recipe for Llama 3.2" in RECIPES["llama3.2-1b"].source


@pytest.mark.parametrize("name", RECIPE_FIELDS)
def test_each_setting_comes_from_the_flag_then_the_config_file_then_the_recipe(name, tmp_path):
    recipe = PRESETS["llama3.2-3b"].recipe
    file = tmp_path / "run.toml"
    file.write_text(f'model = "llama3.2-3b"\nsteps = 100\n{name} = {FILE_VALUES[name]!r}\n')
    preset = load_config(None, {"model": "llama3.2-3b", "steps": 100})
    expected = 99 if name == "warmup" else getattr(recipe, name)  # 8,000 steps cut to the run
    assert getattr(preset, name) == expected and recipe_origin(preset, name) == "preset llama3.2-3b recipe"
    from_file = load_config(file)
    assert getattr(from_file, name) == FILE_VALUES[name]
    assert recipe_origin(from_file, name) == "flag or --config file"
    assert getattr(load_config(file, {name: FLAG_VALUES[name]}), name) == FLAG_VALUES[name]
    others = [other for other in RECIPE_FIELDS if other not in (name, "warmup")]
    assert all(getattr(from_file, other) == getattr(recipe, other) for other in others)  # still the recipe's


def test_a_trained_model_takes_the_fine_tuning_recipe(tmp_path):
    for settings in ({"model": str(tmp_path)}, {"init_from": str(tmp_path)}):
        config = load_config(None, {**settings, "steps": 200})
        assert (config.lr, config.warmup, config.min_lr_ratio) == (2e-5, math.ceil(0.03 * 200), 0.0)
        assert config.recipe is FINE_TUNING and recipe_origin(config, "lr") == "fine-tuning recipe"
    assert load_config(None, {"model": str(tmp_path), "lr": 1e-4}).lr == 1e-4
    assert load_config(None, {}).lr == 2e-3 and load_config(None, {}).recipe_name == "preset tiny recipe"


def test_a_warmup_longer_than_the_run_is_cut_and_said_in_one_line():
    config = load_config(None, {"model": "llama3.2-1b", "steps": 10})
    assert config.warmup == 9
    assert warmup_note(config) == ("warmup 8000 steps of the preset llama3.2-1b recipe is longer than this 10-step "
                                   "run: warming up over 9 steps (--warmup sets it)")
    assert warmup_note(load_config(None, {"model": "llama2-7b", "steps": 3000})) is None  # 2,000 fits
    assert warmup_note(load_config(None, {"model": "llama3.2-1b", "steps": 10, "warmup": 4})) is None  # set
    with pytest.raises(ValueError, match="--warmup 10 is not below --steps 10"):  # set, too long: refused as before
        load_config(None, {"model": "llama3.2-1b", "steps": 10, "warmup": 10})


def test_a_resume_keeps_the_recorded_values_when_the_recipe_changed(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    first = load_config(None, {"model": "debug", "steps": 20, "out": str(out)})
    save_config(first, out / "config.toml")
    debug = PRESETS["debug"]
    monkeypatch.setitem(PRESETS, "debug", dataclasses.replace(debug, recipe=dataclasses.replace(
        debug.recipe, lr=1e-4, warmup=2, beta2=0.99)))
    resumed = load_run_config(out, {"resume": True, "out": str(out)})
    assert all(getattr(resumed, name) == getattr(first, name) for name in RECIPE_FIELDS)
    assert resumed.lr == 2e-3 and recipe_origin(resumed, "lr") == "the run's config.toml"


def test_the_settings_table_says_where_each_value_came_from(store, tmp_path):
    done = burst_train("--model", "debug", "--data", store, "--seq-len", 256, "--steps", 3, "--lr", 0.01,
                       "--precision", "fp32", "--val-tokens", 0, "--out", tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    table = " ".join(done.stdout.split())
    assert "lr │ 0.01 (flag or --config file)" in table, table
    assert "beta2 │ 0.95 (preset debug recipe)" in table and "doc_mask │ off" in table
    assert "recipe │ preset debug recipe: burst's own for quick CPU" in table
    assert ("note: warmup 5 steps of the preset debug recipe is longer than this 3-step run: warming up over 2 "
            "steps") in table


@pytest.fixture(scope="module")
def pair_store(tmp_path_factory) -> Path:
    return make_pair_store(tmp_path_factory.mktemp("preferences"))


def test_a_preference_store_turns_the_document_mask_on_and_refuses_it_off(pair_store, store, tmp_path):
    settings = {"model": "debug", "data": [str(pair_store)], "seq_len": SEQ_LEN, "batch_size": 2, "steps": 2,
                "objective": "dpo", "precision": "fp32"}
    plan = check_run(load_config(None, {**settings, "out": str(tmp_path / "a")}), 1)
    assert plan.config.doc_mask is True and plan.config.sequence_layout == "balanced"
    with pytest.raises(ValueError, match="--no-doc-mask is refused for --data .*drop --no-doc-mask"):
        check_run(load_config(None, {**settings, "doc_mask": False, "out": str(tmp_path / "b")}), 1)
    documents = check_run(load_config(None, {"model": "debug", "data": [str(store)], "seq_len": 256,
                                            "out": str(tmp_path / "c")}), 1)
    assert documents.config.doc_mask is False  # a stream of documents trains across their boundaries
    done = burst_train("--data", pair_store, "--model", "debug", "--seq-len", SEQ_LEN, "--batch-size", 2, "--steps",
                       1, "--objective", "dpo", "--precision", "fp32", "--out", tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "doc_mask │ on (preference store: required)" in " ".join(done.stdout.split())
    assert "doc_mask = true" in (tmp_path / "run" / "config.toml").read_text()  # recorded, so a resume keeps it


def test_a_shrunk_large_preset_does_not_blow_up_in_its_first_steps(tmp_path):
    from preset_stability import parameters, run, shrunk

    assert parameters(PRESETS["llama3.2-1b"].model) == pytest.approx(1.236e9, rel=0.01)  # its published size
    name = shrunk("llama3.2-1b", dim=64, layers=2)
    try:
        model = PRESETS[name].model
        assert model.n_heads // model.n_kv_heads == 4 and model.tie_embeddings
        rows = run(name, steps=4, seq_len=128, batch_size=1, out=tmp_path / "run")
    finally:
        del PRESETS[name]
    losses = [row["loss"] for row in rows]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert max(losses[1:]) < losses[0] + 0.1 and rows[-1]["lr"] == pytest.approx(3e-4)
