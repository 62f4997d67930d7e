"""RoPE scaling types: parity with transformers' LlamaForCausalLM past the original context, for each type in
both config forms (4.x rope_scaling, 5.x rope_parameters), round trips, the sequence length under cp, refusals."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

import burst
from cli import app
from data import TokenStore
from models import ModelConfig, convert_checkpoint, init_model, load_model, save_model
from models.convert import config_from_hf, config_to_hf
from models.rope import (
    DynamicRope,
    LinearRope,
    Llama3Rope,
    LongRope,
    YarnRope,
    parse_rope_scaling,
    rope_frequencies,
    rope_scaling_from_dict,
)
from tests.hf_forms import rope_of, transformers4_form, transformers5_form
from trainer.config import TrainConfig, load_run_config, save_config
from trainer.preflight import model_and_store

ORIGINAL = 16  # the "pretraining" context of the tiny models; the parity tests run to LONG positions
LONG = 48
HEAD_DIM = 16
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-all-parameters": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL,
                            "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                            "truncate": False},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL, "factor": 4.0,
                 "short_factor": [1.0 + i / 16 for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + i for i in range(HEAD_DIM // 2)]},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
}


def hf_model(rope: dict) -> LlamaForCausalLM:
    """A tiny random LlamaForCausalLM (float32) with `rope`, theta 500; max_position_embeddings is ORIGINAL for
    dynamic (its growth starts there), 4 x ORIGINAL for the others. RoPE is given as 4.x takes it, as 5.x does too
    (4.x would ignore 5.x's rope_parameters). A longrope's original length also stands beside it, the one place 4.x
    reads it (Phi-3's form; 4.x then sets factor to max_position_embeddings / it, here the factor given)."""
    torch.manual_seed(0)
    max_length = ORIGINAL if rope["rope_type"] == "dynamic" else 4 * ORIGINAL
    beside = {"original_max_position_embeddings": ORIGINAL} if rope["rope_type"] == "longrope" else {}
    config = LlamaConfig(hidden_size=4 * HEAD_DIM, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=max_length, rope_theta=500.0,
                         rope_scaling=None if rope["rope_type"] == "default" else rope, **beside)
    return LlamaForCausalLM(config).eval()


def logits_diff(hf: LlamaForCausalLM, model, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(tokens) - hf(tokens).logits).abs().max().item()


@pytest.mark.parametrize("name", list(ROPES))
def test_each_rope_type_matches_transformers_past_the_original_context(tmp_path, name):
    hf = hf_model(ROPES[name])
    hf.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "burst", to="burst")
    model = load_model(tmp_path / "burst")
    assert model.config.rope_theta == 500.0
    assert (model.config.rope_scaling is None) == (name == "default")
    tokens = torch.randint(0, 300, (2, LONG))
    assert logits_diff(hf, model, tokens) <= 1e-4
    if name in ("dynamic", "longrope"):  # the length-dependent ones, below the original length too
        assert logits_diff(hf_model(ROPES[name]), model, tokens[:, :ORIGINAL - 4]) <= 1e-4
    if name != "default":  # the scaling matters at these positions: without it the logits differ
        plain = dataclasses.replace(model.config, rope_scaling=None)
        unscaled = init_model(plain)
        unscaled.load_state_dict(model.state_dict())
        assert logits_diff(hf, unscaled, tokens) > 1e-3

    # Back to Hugging Face (the 4.x form): the same config, and transformers computes the same logits.
    convert_checkpoint(tmp_path / "burst", tmp_path / "hf2", to="hf")
    exported = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert config_from_hf(exported, "hf2") == model.config
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    assert rope_of(reloaded.config) == {**ROPES[name], "rope_theta": 500.0}
    with torch.no_grad():
        assert torch.allclose(reloaded(tokens).logits, hf(tokens).logits, atol=1e-5)


@pytest.mark.parametrize("name", ["linear", "dynamic", "yarn", "longrope", "llama3"])
def test_the_transformers4_and_5_forms_read_the_same(tmp_path, name):
    fields = hf_model(ROPES[name]).config.to_dict()  # as the installed release writes it
    four, five = transformers4_form(fields), transformers5_form(fields)
    assert four["rope_theta"] == 500.0 and four["rope_scaling"]["rope_type"] == name and "rope_parameters" not in four
    assert five["rope_parameters"]["rope_theta"] == 500.0 and "rope_scaling" not in five and "rope_theta" not in five
    model = config_from_hf(four, "config.json")
    assert model == config_from_hf(five, "config.json") == config_from_hf(fields, "config.json")
    assert model.rope_theta == 500.0 and model.rope_scaling.to_dict()["rope_type"] == name


def test_yarn_and_longrope_without_factor_take_transformers_default():
    base = transformers5_form(hf_model(ROPES["llama3"]).config.to_dict())  # max_position_embeddings 4 x ORIGINAL
    yarn = config_from_hf({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": None,
                                                       "original_max_position_embeddings": ORIGINAL}}, "c")
    assert yarn.rope_scaling == YarnRope(factor=4.0, original_max_position_embeddings=ORIGINAL)
    longrope = {**ROPES["longrope"], "rope_theta": 500.0}
    del longrope["factor"]
    assert config_from_hf({**base, "rope_parameters": longrope}, "c").rope_scaling.factor == 4.0


def test_native_round_trip_keeps_every_type():
    for name, rope in ROPES.items():
        config = config_from_hf(hf_model(rope).config.to_dict(), name)
        assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
        assert config_from_hf(json.loads(json.dumps(config_to_hf(config, torch.float32))), name) == config


def test_length_dependent_scalings_rotate_a_shard_by_the_whole_sequence_length(monkeypatch):
    """Under cp a rank holds a zigzag shard: told the whole length (rope_length), it rotates its tokens exactly as
    the whole sequence does; left to its own positions, a rank without the last position would not."""
    import models.llama

    rotations = []
    original_cos_sin = models.llama.rotary_cos_sin
    monkeypatch.setattr(models.llama, "rotary_cos_sin",
                        lambda *args: rotations.append(original_cos_sin(*args)) or rotations[-1])
    for rope in (DynamicRope(factor=3.0, original_max_position_embeddings=ORIGINAL),
                 LongRope(short_factor=ROPES["longrope"]["short_factor"], long_factor=ROPES["longrope"]["long_factor"],
                          original_max_position_embeddings=ORIGINAL, factor=3.0)):
        config = dataclasses.replace(ModelConfig.from_name("debug"), dim=64, n_heads=4, rope_scaling=rope)
        model = init_model(config).eval()
        tokens = torch.randint(0, config.vocab_size, (1, LONG))
        with torch.no_grad():
            model.hidden_states(tokens)
            whole_cos, whole_sin = rotations[-1]  # [LONG, 1, head_dim // 2]
            for rank in range(3):
                positions = burst.zigzag_positions(LONG, rank, 3)
                model.hidden_states(burst.shard_for_rank(tokens, rank, 3), positions, rope_length=LONG)
                assert torch.equal(rotations[-1][0], whole_cos[positions])
                assert torch.equal(rotations[-1][1], whole_sin[positions])
            if isinstance(rope, DynamicRope):  # its base follows the exact length (longrope: only past ORIGINAL)
                positions = burst.zigzag_positions(LONG, 1, 3)  # chunks 1 and 4 of 6: up to position 39
                model.hidden_states(burst.shard_for_rank(tokens, 1, 3), positions)
                assert not torch.equal(rotations[-1][0], whole_cos[positions])


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "su", "factor": 2.0}, "unknown rope type 'su'; the types transformers' LLaMA implements are "
                                         "default, linear, dynamic, yarn, longrope, llama3"),
    ({"rope_type": "yarn", "factor": 2.0}, None),  # original_max_position_embeddings from max_position_embeddings
    ({"rope_type": "linear"}, "rope type 'linear' needs factor"),
    ({"rope_type": "linear", "factor": "4"}, r"rope scaling 'linear': factor = '4' must be a number"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1, "high_freq_factor": True,
      "original_max_position_embeddings": 8}, "high_freq_factor = True must be a number"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8.5},
     "original_max_position_embeddings = 8.5 must be a whole number"),
    ({"rope_type": "linear", "factor": 0.5}, "factor = 0.5 must be at least 1"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, "rope type 'linear' has no parameter beta_fast"),
    ({"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0], "long_factor": [1.0],
      "original_max_position_embeddings": 8}, "short_factor = '\\[1 numbers\\]' must hold head_dim / 2 = 8 numbers"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
     "rope type 'linear' has no parameter partial_rotary_factor"),
    # Values of the right type that would divide by zero, take the logarithm of a negative or flip cos/sin:
    ({**ROPES["llama3"], "low_freq_factor": 0}, "low_freq_factor = 0.0 must be positive"),
    ({**ROPES["llama3"], "low_freq_factor": -1}, "low_freq_factor = -1.0 must be positive"),
    ({**ROPES["yarn"], "beta_slow": -5}, "beta_slow = -5.0 must be positive"),
    ({**ROPES["yarn"], "beta_fast": 0}, "beta_fast = 0.0 must be positive"),
    ({**ROPES["yarn"], "mscale": -50, "mscale_all_dim": 1}, "mscale = -50.0 must be positive"),
    ({**ROPES["yarn"], "original_max_position_embeddings": 1}, "original_max_position_embeddings = 1 must be at "
                                                               "least 2"),
    ({**ROPES["yarn"], "type": "linear"}, "rope_type 'yarn' and type 'linear' name different rope types"),
])
def test_bad_rope_parameters_are_refused_naming_the_field(rope, message):
    hf = {**hf_model(ROPES["default"]).config.to_dict(), "rope_parameters": None, "rope_scaling": rope}
    if message is None:
        assert config_from_hf(hf, "config.json").rope_scaling.original_max_position_embeddings == 4 * ORIGINAL
        return
    with pytest.raises(ValueError, match=f"config.json: .*{message}"):
        config_from_hf(hf, "config.json")


def test_native_config_with_a_string_factor_is_refused():
    fields = ModelConfig.from_name("llama3.2-1b").to_dict()
    fields["rope_scaling"] = {**fields["rope_scaling"], "factor": "32"}
    with pytest.raises(ValueError, match="factor = '32' must be a number"):
        ModelConfig.from_dict(fields)
    fields["rope_scaling"] = {k: v for k, v in fields["rope_scaling"].items() if k != "rope_type"}  # older files
    fields["rope_scaling"]["factor"] = 32.0
    assert ModelConfig.from_dict(fields) == ModelConfig.from_name("llama3.2-1b")


@pytest.mark.parametrize("spec, expected", [
    ("none", None),
    ("linear:factor=4", {"rope_type": "linear", "factor": 4.0}),
    ("dynamic:factor=2", {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 1024}),
    ("yarn:factor=8,original_max_position_embeddings=512,truncate=false,beta_fast=16",
     {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "truncate": False,
      "beta_fast": 16.0}),
    ("longrope:short_factor=1,1,long_factor=2,3.5,factor=4",
     {"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [2.0, 3.5], "factor": 4.0,
      "original_max_position_embeddings": 1024}),
    ("llama3:factor=32,low_freq_factor=1,high_freq_factor=4",
     {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 1024}),
])
def test_the_flag_syntax(spec, expected):
    scaling = parse_rope_scaling(spec, "--rope-scaling", original_length=1024)
    assert (scaling and scaling.to_dict()) == expected
    if scaling is not None:
        assert rope_scaling_from_dict(scaling.to_dict(), "again") == scaling


@pytest.mark.parametrize("spec, message", [
    ("ntk:factor=2", "unknown rope type 'ntk'"),
    ("yarn:factor=abc,original_max_position_embeddings=8", "factor = 'abc' must be a number"),
    ("linear:4", "'4' is not key=value"),
    ("linear", "rope type 'linear' needs factor"),
    ("llama3:factor=32", "rope type 'llama3' needs low_freq_factor, high_freq_factor"),
    ("yarn:factor=2,rope_type=linear", "'rope_type=linear': the rope type is the word before the colon"),
    ("yarn:factor=2,type=linear", "'type=linear': the rope type is the word before the colon"),
    ("yarn:factor=2,factor=4", "factor is given twice"),
    ("llama3:factor=8,low_freq_factor=0,high_freq_factor=4", "low_freq_factor = 0.0 must be positive"),
    ("yarn:factor=8,beta_slow=-5", "beta_slow = -5.0 must be positive"),
    ("yarn:factor=8,mscale=-50,mscale_all_dim=1", "mscale = -50.0 must be positive"),
])
def test_bad_flags_are_refused(spec, message):
    with pytest.raises(ValueError, match=f"--rope-scaling: .*{message}"):
        parse_rope_scaling(spec, "--rope-scaling", original_length=64)


def test_every_accepted_rope_gives_finite_positive_frequencies():
    """Each type's parameters over their edges (zero, negative, tiny, huge): what construction accepts computes
    frequencies and a cos/sin scale that are finite and positive, at any base it accepts and any length."""
    edges = [-50.0, -1.0, 0.0, 1e-9, 0.5, 1.0, 2.0, 1e9]
    for name, rope in ROPES.items():
        if name == "default":
            continue
        numbers = [key for key, value in rope.items() if isinstance(value, float) or key.startswith("original")]
        extra = {"yarn": ["attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"],
                 "longrope": ["attention_factor"]}.get(rope["rope_type"], [])
        for key in [*numbers, *extra]:
            for edge in edges:
                value = int(edge) if key.startswith("original") else edge
                fields = {**rope, key: value, **({"mscale_all_dim": 1.0} if key == "mscale" else {})}
                try:
                    scaling = rope_scaling_from_dict(fields, name)
                except ValueError:
                    continue
                for theta in (1.0001, 500.0, 1e9):
                    for length in (None, 2, ORIGINAL, 10**7):
                        inv_freq, scale = rope_frequencies(theta, HEAD_DIM, scaling, length)
                        assert torch.isfinite(inv_freq).all() and (inv_freq > 0).all(), (fields, theta, length)
                        assert math.isfinite(scale) and scale > 0, (fields, theta, length)
    with pytest.raises(ValueError, match="rope_theta = 1 must be a number above 1"):
        ModelConfig(rope_theta=1.0, rope_scaling=YarnRope(factor=2.0, original_max_position_embeddings=ORIGINAL))


def test_rope_flags_change_a_checkpoints_rope_and_a_resume_may_not(tmp_path, store):
    vocab = TokenStore(store).vocab_size
    config = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=vocab, max_seq_len=512)
    save_model(init_model(config), config, tmp_path / "model")
    for flags, theta, scaling in [
        ({}, 10000.0, None),
        ({"rope_theta": 8e6}, 8e6, None),
        ({"rope_scaling": "dynamic:factor=2"}, 10000.0, DynamicRope(factor=2.0, original_max_position_embeddings=512)),
        ({"rope_theta": 5e5, "rope_scaling": "linear:factor=4"}, 5e5, LinearRope(factor=4.0)),
    ]:
        train = TrainConfig(model=str(tmp_path / "model"), data=str(store), seq_len=64, **flags)
        resolved, checkpoint = model_and_store(train, TokenStore(store))
        assert (resolved.rope_theta, resolved.rope_scaling, checkpoint) == (theta, scaling, tmp_path / "model")
    (tmp_path / "run").mkdir()
    save_config(TrainConfig(data=str(store), rope_theta=8e6), tmp_path / "run" / "config.toml")
    assert load_run_config(tmp_path / "run", {}).rope_theta == 8e6
    with pytest.raises(ValueError, match="--rope-theta 1000000.0 differs from the run's 8000000.0"):
        load_run_config(tmp_path / "run", {"rope_theta": 1e6})


def test_a_new_scaling_of_a_scaled_model_extends_the_same_original_context(tmp_path, store):
    """A LLaMA-3.1-style model (llama3 scaling from 64 positions, max_seq_len 512): --rope-scaling yarn interpolates
    from its original 64, the context it was pretrained at, not from the 512 its scaling reaches."""
    vocab = TokenStore(store).vocab_size
    llama3 = Llama3Rope(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    config = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=vocab, max_seq_len=512, rope_scaling=llama3)
    save_model(init_model(config), config, tmp_path / "model")
    train = TrainConfig(model=str(tmp_path / "model"), data=str(store), seq_len=64, rope_scaling="yarn:factor=16")
    resolved, _ = model_and_store(train, TokenStore(store))
    assert resolved.rope_scaling == YarnRope(factor=16.0, original_max_position_embeddings=64)


@pytest.mark.parametrize("flags, message", [
    (["--rope-theta", "-1"], "--rope-theta -1 must be a number above 1"),
    (["--rope-theta", "inf"], "--rope-theta inf must be a number above 1"),
    (["--rope-theta", "1", "--rope-scaling", "yarn:factor=2"], "--rope-theta 1 must be a number above 1"),
    (["--rope-scaling", "llama3:factor=8,low_freq_factor=0,high_freq_factor=4"], "low_freq_factor = 0.0 must be "
                                                                                 "positive"),
    (["--rope-scaling", "yarn:factor=2,rope_type=linear"], "the rope type is the word before the colon"),
    (["--rope-scaling", "yarn:factor=abc"], "--rope-scaling: rope scaling 'yarn': factor = 'abc' must be a number"),
    (["--rope-scaling", "su:factor=2"], "--rope-scaling: unknown rope type 'su'"),
    (["--rope-scaling", "linear:factor=2,beta_fast=3"], "rope type 'linear' has no parameter beta_fast"),
    (["--rope-scaling", "longrope:short_factor=1,long_factor=1,factor=2"], "short_factor = 1 must be a list"),
    (["--rope-scaling", "longrope:short_factor=1,1,long_factor=1,1,factor=2"],  # checked against the model's heads
     "short_factor = '[2 numbers]' must hold head_dim / 2 = 8 numbers"),
])
def test_bad_rope_flags_exit_2_before_any_work(tmp_path, store, flags, message):
    result = CliRunner().invoke(app, ["train", "--model", "debug", "--data", str(store), "--seq-len", "64",
                                      "--out", str(tmp_path / "run"), *flags])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_apply_rotary_rounds_as_transformers_rotation_in_float32(dtype, grad):
    """burst rotates in float32 and rounds once to the input's dtype, with or without a gradient (generation writes
    each half in place; training keeps the autograd-friendly form): bit-equal to transformers' rotate-half formula on
    the float32 input, rounded."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from models.llama import apply_rotary, rotary_cos_sin

    torch.manual_seed(0)
    x = (torch.randn(2, 40, 3, HEAD_DIM) * 4).to(dtype).requires_grad_(grad)
    cos, sin = rotary_cos_sin(torch.arange(40), 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    full_cos, full_sin = (torch.cat([c, c], -1)[:, 0][None] for c in (cos, sin))  # [1, 40, head_dim]
    heads_first = x.detach().float().transpose(1, 2)  # transformers' [batch, heads, seq, head_dim]
    expected, _ = apply_rotary_pos_emb(heads_first, heads_first, full_cos, full_sin, unsqueeze_dim=1)
    got = apply_rotary(x, cos, sin)
    assert got.dtype == dtype and got.requires_grad == grad
    assert torch.equal(got.detach(), expected.transpose(1, 2).to(dtype))
