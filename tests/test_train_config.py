"""TrainConfig: defaults < TOML file < flags, refusals that name the bad setting, the LR schedule, decay groups."""

import dataclasses
import json
import math
import re

import pytest
import torch

from models import ModelConfig, Transformer
from trainer.config import TrainConfig, load_config, load_run_config, save_config, to_toml
from trainer.optim import build_optimizer, lr_factor


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "debug"\nsteps = 7\nlr = 1\nactivation_checkpointing = true\n')
    config = load_config(path, {"steps": 3, "cp": 2})
    assert (config.model, config.steps, config.cp, config.lr) == ("debug", 3, 2, 1.0)
    assert config.activation_checkpointing == "selective"  # a file from before the modes: true is selective
    assert config.seq_len == TrainConfig().seq_len  # untouched: the default


def test_the_saved_toml_reads_back_to_the_same_config(tmp_path):
    config = TrainConfig(model="debug", data='a "quoted" dir', seq_len=512, lr=3e-5, out="runs/x")
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config))
    assert load_config(path) == config
    assert "data" not in to_toml(TrainConfig())  # None: left out, the default again on reading
    save_config(config, path, notes="precision bf16: auto: this CPU computes in bf16 natively\nsecond line")
    assert path.read_text().startswith("# precision bf16: auto:") and load_config(path, recorded=True) == config
    assert load_config(path).out is None  # a run's record as --config: a new run, in a directory of its own


@pytest.mark.parametrize("text, overrides, message", [
    ("stepz = 3\n", {}, "unknown setting 'stepz' in"),
    ("", {"learning_rate": 1.0}, "unknown setting 'learning_rate' in the command line"),
    ('steps = "ten"\n', {}, "setting 'steps' in"),
    ("seq_len = 1004\ncp = 4\n", {}, "--seq-len 1004 does not split over --cp 4"),
    ('precision = "fp16"\n', {}, "--precision 'fp16' is not one of auto, bf16, fp32"),
    ('cp_topology = "mesh"\n', {}, "unknown --cp-topology 'mesh'; choose one of auto, flat, two-level, ulysses"),
    ('cp_layout = "striped"\n', {}, "unknown --cp-layout 'striped'; choose one of zigzag, balanced"),
    ('cp_layout = "balanced"\n', {}, "--cp-layout balanced is chosen from each sequence's documents, which "
                                     "attention sees only with --doc-mask"),
    ("steps = [\n", {}, "cannot read the config file"),
    ("steps = 40\n", {"warmup": 40}, "--warmup 40 is not below --steps 40: the whole run would stay in warmup"),
    ("", {"seed": -1}, "--seed -1 must be between 0 and 2^63 - 1"),
    ("", {"timeout": 1e300}, "--timeout 1e+300 minutes must be between 0.1"),
    ("", {"timeout": 1e-5}, "--timeout 1e-05 minutes must be between 0.1"),
    # Decoupled AdamW multiplies each decayed weight by 1 - lr x weight decay: at 1 or above it zeroes or flips them.
    ("", {"weight_decay": 1000.0}, "--weight-decay 1000 with --lr 0.002: decoupled AdamW multiplies each decayed "
                                   "weight by 1 - lr x weight decay = -1 every step"),
    ("lr = 0.01\n", {"weight_decay": 100.0}, "1 - lr x weight decay = 0 every step"),
    ("", {"weight_decay": -0.1}, "--weight-decay -0.1 must not be negative"),
    ("", {"max_grad_norm": -1.0}, "--max-grad-norm -1.0 must not be negative"),
    ("", {"beta2": 1.0}, "--beta2 1.0 must be in [0, 1)"),
    ("", {"lr": math.nan}, "--lr nan must be a finite number"),
    # Both layouts are made of 2 x cp chunks: the message names neither, and suggests two lengths.
    ("cp = 3\ndoc_mask = true\n", {}, "sequence length 1024 must be a positive multiple of 2 x world size = 6, the "
                                       "chunks the ranks' layouts are made of; use 1020 or 1026"),
])
def test_bad_settings_are_refused_with_the_setting_named(tmp_path, text, overrides, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(path, overrides)


def test_the_default_warmup_stays_below_short_runs():
    assert [TrainConfig(steps=steps).warmup for steps in (1, 3, 6, 40)] == [0, 2, 5, 5]
    assert load_config(None, {"steps": 3, "warmup": 1}).warmup == 1


def test_the_balanced_layout_is_the_default_with_doc_mask_and_reaches_attention():
    from trainer.parallelize import parallelize

    assert TrainConfig().sequence_layout == "zigzag"
    assert TrainConfig(doc_mask=True).sequence_layout == "balanced"
    assert TrainConfig(doc_mask=True, cp_layout="zigzag").sequence_layout == "zigzag"  # today's, on request
    # BurstAttention (cp > 1) takes the layout from the config; one process keeps LocalAttention, whose one chunk
    # has no layout: tests/test_doc_mask.py and tests/test_train.py check that the ranks cut sequences by it.
    for config in (TrainConfig(doc_mask=True), TrainConfig(doc_mask=True, cp_layout="zigzag")):
        with torch.device("meta"):
            model = parallelize(Transformer(ModelConfig.from_name("debug")), None, config)
        assert {type(block.attention.core_attention).__name__ for block in model.layers} == {"LocalAttention"}


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    factors = [lr_factor(step, warmup=4, steps=15, min_ratio=0.1) for step in range(15)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and math.isclose(factors[-1], 0.1)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:], strict=False))
    assert math.isclose(factors[9], 0.55)  # half way through the cosine: half way to the floor


def test_weight_decay_skips_norms_and_embeddings():
    model = Transformer(dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=64))
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert "output.weight" in decayed and "layers.0.attention.wq.weight" in decayed
    assert not any("norm" in n or "tok_embeddings" in n for n in decayed)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
    assert isinstance(optimizer, torch.optim.AdamW)


def test_every_setting_is_a_burst_train_option_with_its_help_and_default():
    import typer.main

    from cli import app

    options = {p.name: p for p in typer.main.get_command(app).commands["train"].params}
    for setting in dataclasses.fields(TrainConfig):
        option = options[setting.name]
        assert option.opts[0] == "--" + setting.name.replace("_", "-")
        assert option.help == setting.metadata["help"] and option.help.endswith(".")
        assert option.default is None  # an unset flag leaves the config file's value
        default = str(setting.default).lower() if isinstance(setting.default, bool) else str(setting.default)
        assert option.show_default == (setting.metadata["shown"] or default)
    # and --val-sequences, hidden: refused, naming --val-tokens
    assert set(options) == {field.name for field in dataclasses.fields(TrainConfig)} | {"config", "val_sequences"}


def test_a_resume_that_changes_the_rope_names_the_value_the_run_used(tmp_path):
    """A run that left --rope-theta unset used its model's: the refusal gives that value, not None."""
    out = tmp_path / "run"
    out.mkdir()
    save_config(TrainConfig(model="debug"), out / "config.toml")
    with pytest.raises(ValueError, match=re.escape("--rope-theta 50000.0 differs from the run's (unset: the model's "
                                                   "own rope_theta, 10000.0)")):
        load_run_config(out, {"rope_theta": 50000.0})
    checkpoint = out / "checkpoints" / "step-000002"  # once the run has a checkpoint, its model says
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text(json.dumps({"step": 2}))
    model = dataclasses.replace(ModelConfig.from_name("debug"), rope_theta=70000.0)
    (checkpoint / "config.json").write_text(json.dumps(model.to_dict()))
    with pytest.raises(ValueError, match=re.escape("--rope-theta 50000.0 differs from the run's (unset: the model's "
                                                   "own rope_theta, 70000.0)")):
        load_run_config(out, {"rope_theta": 50000.0})
    with pytest.raises(ValueError, match=re.escape("--rope-scaling linear:factor=2 differs from the run's (unset: the "
                                                   "model's own rope_scaling, none)")):
        load_run_config(out, {"rope_scaling": "linear:factor=2"})
