"""Hugging Face <-> native conversion: parity with transformers' LlamaForCausalLM, bit-exact round trips, refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from checkpoints.sources import convert_checkpoint as convert_checkpoint_any
from cli import app
from data import load_tokenizer, train_tokenizer
from models import ModelConfig, convert_checkpoint, load_model
from models.convert import config_from_hf
from models.llama import rope_frequencies
from tests.fixtures import burst_train
from tests.hf_forms import transformers4_form, transformers5_form

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
HF_CONFIGS = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    # RoPE as transformers 4.x takes it, which 5.x takes too (5.x's rope_parameters is lost on 4.x)
    "mha-tied-theta": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=1234.0),
    "gqa-llama3-scaling": dict(num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
                               rope_scaling=LLAMA3_ROPE),
}
FORMS = {"4.x": transformers4_form, "5.x": transformers5_form}
SEQ_LEN = 48  # past original_max_position_embeddings, so the llama3 scaling matters


def save_hf_model(path, name: str, form: str | None = None, **save_kwargs) -> LlamaForCausalLM:
    """A small random LlamaForCausalLM saved with save_pretrained; its config.json in the `form` of transformers
    "4.x" or "5.x" (None: as the installed release writes it)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=300,
                         max_position_embeddings=256, rms_norm_eps=1e-5, **HF_CONFIGS[name])
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, **save_kwargs)
    if form is not None:
        fields = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(FORMS[form](fields)))
    return model


def hf_logits(model: LlamaForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def hf_tensors(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_to_burst_to_hf(tmp_path, name):
    hf_model = save_hf_model(tmp_path / "hf", name)
    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(200)]
    tokenizer = train_tokenizer(texts, tmp_path / "hf" / "tokenizer.model", vocab_size=300)
    tokens = torch.randint(0, 300, (2, SEQ_LEN))

    convert_checkpoint(tmp_path / "hf", tmp_path / "burst", to="burst")
    model = load_model(tmp_path / "burst")
    with torch.no_grad():
        diff = (model(tokens) - hf_logits(hf_model, tokens)).abs().max().item()
    print(f"{name}: max |logit diff| burst vs transformers = {diff:.3e}")
    assert diff <= 1e-4
    assert load_tokenizer(tmp_path / "burst" / "tokenizer.model").fingerprint == tokenizer.fingerprint

    convert_checkpoint(tmp_path / "burst", tmp_path / "hf2", to="hf")
    source, round_trip = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "hf2")
    assert source.keys() == round_trip.keys()
    assert all(torch.equal(source[k], round_trip[k]) and source[k].dtype == round_trip[k].dtype for k in source)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    assert torch.equal(hf_logits(reloaded, tokens), hf_logits(hf_model, tokens))
    assert load_tokenizer(tmp_path / "hf2" / "tokenizer.model").fingerprint == tokenizer.fingerprint


@pytest.mark.parametrize("form", list(FORMS))
def test_either_transformers_config_form_and_llama3_scaling(tmp_path, form):
    hf_model = save_hf_model(tmp_path / "hf", "gqa-llama3-scaling", form=form)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert ("rope_parameters" in written) == (form == "5.x") and ("rope_scaling" in written) == (form == "4.x")
    convert_checkpoint(tmp_path / "hf", tmp_path / "burst", to="burst")
    model = load_model(tmp_path / "burst")
    assert model.config.rope_theta == 500000.0 and model.config.rope_scaling.original_max_position_embeddings == 16
    tokens = torch.randint(0, 300, (1, SEQ_LEN))
    with torch.no_grad():
        assert (model(tokens) - hf_logits(hf_model, tokens)).abs().max() <= 1e-4
    # The scaling changes the frequencies, so a converter that dropped it would fail the parity above.
    assert not torch.equal(rope_frequencies(model.config)[0],
                           rope_frequencies(dataclasses.replace(model.config, rope_scaling=None))[0])


def test_sharded_checkpoints(tmp_path):
    hf_model = save_hf_model(tmp_path / "hf", "gqa", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    convert_checkpoint(tmp_path / "hf", tmp_path / "burst", to="burst", max_shard_bytes=60_000)
    index = json.loads((tmp_path / "burst" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / "burst" / "model.safetensors").exists()
    tokens = torch.randint(0, 300, (1, SEQ_LEN))
    with torch.no_grad():
        assert (load_model(tmp_path / "burst")(tokens) - hf_logits(hf_model, tokens)).abs().max() <= 1e-4
    convert_checkpoint(tmp_path / "burst", tmp_path / "hf2", to="hf", max_shard_bytes=60_000)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    assert torch.equal(hf_logits(reloaded, tokens), hf_logits(hf_model, tokens))


# The model-defining fields of the published config.json of meta-llama/Llama-3.2-1B and -3B.
LLAMA32_COMMON = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                      intermediate_size=8192, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      max_position_embeddings=131072, tie_word_embeddings=True, hidden_act="silu",
                      attention_bias=False, mlp_bias=False, initializer_range=0.02)
LLAMA32 = {"llama3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64),
           "llama3.2-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128)}


@pytest.mark.parametrize("name", list(LLAMA32))
def test_llama32_presets_are_the_published_models_and_match_transformers(tmp_path, name):
    published = {**LLAMA32_COMMON, **LLAMA32[name]}
    assert config_from_hf(published, name) == ModelConfig.from_name(name)
    # A scaled-down copy with the same structure: tied embeddings, the heads per kv head, the 32-fold
    # llama3 scaling (from 16 positions, so SEQ_LEN reaches past it).
    heads_per_kv = published["num_attention_heads"] // published["num_key_value_heads"]
    small = {**published, "hidden_size": 32 * heads_per_kv, "num_attention_heads": 2 * heads_per_kv,
             "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "intermediate_size": 96,
             "vocab_size": 300, "rope_scaling": {**published["rope_scaling"], "original_max_position_embeddings": 16}}
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(**small)).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "burst", to="burst")
    model = load_model(tmp_path / "burst")
    assert model.output is None and model.config.rope_scaling.factor == 32.0
    tokens = torch.randint(0, 300, (2, SEQ_LEN))
    with torch.no_grad():
        assert (model(tokens) - hf_logits(hf_model, tokens)).abs().max() <= 1e-4


def edit_weights(path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_bad_sources_are_refused_and_leave_nothing(tmp_path):
    src, dst = tmp_path / "hf", tmp_path / "out"
    save_hf_model(src, "gqa")
    config = json.loads((src / "config.json").read_text())

    def refused(match: str) -> None:
        with pytest.raises(ValueError, match=match):
            convert_checkpoint(src, dst, to="burst")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no DST, no temporary directory

    (src / "config.json").write_text(json.dumps({**config, "model_type": "phi3",
                                                 "architectures": ["Phi3ForCausalLM"]}))
    refused(r"model_type 'phi3' \['Phi3ForCausalLM'\], which burst does not read; it accepts LLaMA "
            r"\(LlamaForCausalLM, model_type 'llama'\), Qwen2 / Qwen2.5 .* Gemma 3 \(text\)")
    (src / "config.json").write_text(json.dumps({**config, "vocab_size": 500}))
    refused(r"'model.embed_tokens.weight' has shape \[300, 64\] but the config implies \[500, 64\]")
    (src / "config.json").write_text(json.dumps(config))

    original = (src / "model.safetensors").read_bytes()
    edit_weights(src, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    refused(r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]")
    (src / "model.safetensors").write_bytes(original)
    edit_weights(src, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    refused(r"unexpected tensors \['model.layers.0.self_attn.q_proj.bias'\]")
    (src / "model.safetensors").write_bytes(original[: len(original) // 2])
    refused(r"hf/model.safetensors is not a readable safetensors file .* truncated or corrupt")
    (src / "model.safetensors").write_bytes(b"\xff" * 64 + original[64:])
    refused(r"hf/model.safetensors is not a readable safetensors file")
    (src / "model.safetensors").unlink()
    refused(r"holds neither model.safetensors nor model.safetensors.index.json")
    (src / "config.json").unlink()
    refused(r"is not a recognised checkpoint")


@pytest.mark.parametrize("edit, message", [
    (lambda index: ["not", "an", "object"], "holds a JSON list, not an object"),
    (lambda index: {"metadata": index["metadata"]}, "has no 'weight_map' object"),
    (lambda index: {**index, "weight_map": {}}, "'weight_map' lists no tensors"),
    (lambda index: {**index, "weight_map": {**index["weight_map"], "model.norm.weight": 7}},
     "'weight_map' maps 'model.norm.weight' to 7, not to a file name"),
    (lambda index: {**index, "weight_map": {**index["weight_map"], "model.norm.weight": "../x.safetensors"}},
     "maps 'model.norm.weight' to '../x.safetensors', which is not the name of a .safetensors file beside"),
    (lambda index: {**index, "weight_map": {**index["weight_map"], "model.norm.weight": "pytorch_model.bin"}},
     "to 'pytorch_model.bin', which is not the name of a .safetensors file"),
    (lambda index: {**index, "metadata": {"total_size": "12345"}}, "'metadata.total_size' = '12345' is not a whole"),
    (lambda index: {**index, "metadata": {"total_size": True}}, "'metadata.total_size' = True is not a whole"),
    (lambda index: {**index, "metadata": [1]}, "'metadata' is a list, not an object"),
])
def test_every_field_of_an_index_file_is_checked_and_named(tmp_path, edit, message):
    save_hf_model(tmp_path / "hf", "gqa", max_shard_size="100KB")
    index_file = tmp_path / "hf" / "model.safetensors.index.json"
    index_file.write_text(json.dumps(edit(json.loads(index_file.read_text()))))
    result = CliRunner().invoke(app, ["convert-checkpoint", str(tmp_path / "hf"), str(tmp_path / "out"), "--to",
                                      "burst"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"{index_file}" in result.output and message in result.output and "re-download" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_failure_while_writing_leaves_no_destination(tmp_path, monkeypatch):
    save_hf_model(tmp_path / "hf", "gqa")

    def write_then_fail(tensors, directory, max_shard_bytes):
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr("models.convert.write_tensors", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "out", to="burst")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_existing_destination_needs_force_and_force_replaces_only_an_export(tmp_path):
    save_hf_model(tmp_path / "hf", "gqa")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    for force in (False, True):
        with pytest.raises(ValueError, match="out already exists and is a directory burst did not write .*keep.txt"):
            convert_checkpoint(tmp_path / "hf", tmp_path / "out", to="burst", force=force)
        assert (tmp_path / "out" / "keep.txt").read_text() == "precious"
    convert_checkpoint(tmp_path / "hf", tmp_path / "export", to="burst")
    with pytest.raises(ValueError, match="export already exists .*; choose another destination, or pass --force"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "export", to="hf")
    assert load_model(tmp_path / "export").config.dim == 64  # untouched
    convert_checkpoint(tmp_path / "hf", tmp_path / "export", to="hf", force=True)  # an export of burst's: replaced
    assert LlamaForCausalLM.from_pretrained(tmp_path / "export").config.hidden_size == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "hf", "out"]
    with pytest.raises(ValueError, match="unknown target format 'gguf'; choose one of hf, burst"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "x", to="gguf")


def test_unsupported_llama_variants_are_named():
    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 300, "intermediate_size": 96}
    with pytest.raises(ValueError, match="mlp_bias=true is not supported"):
        config_from_hf({**base, "mlp_bias": True}, "config.json")
    with pytest.raises(ValueError, match="hidden_act = 'gelu' is not supported"):
        config_from_hf({**base, "hidden_act": "gelu"}, "config.json")
    with pytest.raises(ValueError, match="unknown rope type 'proportional'; the types transformers' LLaMA implements "
                                         "are default, linear, dynamic, yarn, longrope, llama3"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "config.json")


def test_cli(tmp_path):
    save_hf_model(tmp_path / "hf", "gqa")
    runner = CliRunner()
    args = ["convert-checkpoint", str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "burst"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "already exists" in result.output and "Traceback" not in result.output
    assert runner.invoke(app, [*args, "--force"]).exit_code == 0


def test_tensors_derived_from_others_are_skipped(tmp_path):
    # Older transformers stored rotary inverse frequencies, and tied checkpoints may repeat the embedding as lm_head.
    hf_model = save_hf_model(tmp_path / "hf", "mha-tied-theta")
    assert "lm_head.weight" not in hf_tensors(tmp_path / "hf")
    edit_weights(tmp_path / "hf", lambda t: t.update({
        "lm_head.weight": t["model.embed_tokens.weight"].clone(),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    convert_checkpoint(tmp_path / "hf", tmp_path / "burst", to="burst")
    tokens = torch.randint(0, 300, (1, SEQ_LEN))
    with torch.no_grad():
        assert (load_model(tmp_path / "burst")(tokens) - hf_logits(hf_model, tokens)).abs().max() <= 1e-4


@pytest.mark.parametrize("field, value, message", [
    ("tie_word_embeddings", "false", "tie_word_embeddings = 'false' must be true or false"),
    ("rms_norm_eps", "1e-5", "rms_norm_eps = '1e-5' must be a number"),
    ("num_key_value_heads", 2.0, "num_key_value_heads = 2.0 must be a whole number (or null)"),
    ("max_position_embeddings", True, "max_position_embeddings = True must be a whole number"),
    ("eos_token_id", "2", "eos_token_id = '2' must be a token id or a list of them (or null)"),
    ("rope_scaling", {"rope_type": "linear", "factor": "4"}, "rope scaling 'linear': factor = '4' must be a number"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope type 'llama3' needs low_freq_factor, "
                                                              "high_freq_factor"),
    ("rope_scaling", "yarn", "rope_scaling = 'yarn' must be a JSON object (or null)"),
])
def test_a_config_json_field_of_the_wrong_type_is_named_with_the_file_and_nothing_is_written(tmp_path, field, value,
                                                                                              message):
    """A string "false" would drop lm_head.weight and a string rope factor would crash training: refused, exit 2."""
    save_hf_model(tmp_path / "hf", "gqa")
    config = transformers4_form(json.loads((tmp_path / "hf" / "config.json").read_text()))  # no rope_parameters
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, field: value}))
    for command in (["convert-checkpoint", str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "burst"],
                    ["train", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]):
        result = CliRunner().invoke(app, command)
        output = " ".join(result.output.split())
        assert result.exit_code == 2 and "Traceback" not in output, result.output
        assert f"{tmp_path / 'hf' / 'config.json'}: " in output and message in output, result.output
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no export, no run, no temporary


def test_an_export_keeps_pad_and_unk_and_writes_a_generation_config(tmp_path):
    """Issue 35, defect 9: an exported config.json dropped pad_token_id and unk_token_id; a run's Hugging Face
    export had no generation_config.json, while convert-checkpoint of a Hugging Face directory kept it."""
    save_hf_model(tmp_path / "hf", "gqa-llama3-scaling")
    fields = json.loads((tmp_path / "hf" / "config.json").read_text())
    fields.update(bos_token_id=1, eos_token_id=2, pad_token_id=3, unk_token_id=0)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(fields))
    (tmp_path / "hf" / "generation_config.json").unlink(missing_ok=True)  # as a run directory has none
    convert_checkpoint(tmp_path / "hf", tmp_path / "burst", to="burst")
    convert_checkpoint(tmp_path / "burst", tmp_path / "hf2", to="hf")
    exported = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert {key: exported.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")} == \
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "unk_token_id": 0}
    generation = GenerationConfig.from_pretrained(tmp_path / "hf2")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 3)


def test_a_run_fine_tuned_from_a_hugging_face_directory_exports_its_sampling_settings(tmp_path, store):
    """Issue 45, defect 15: a run started from a Hugging Face directory exported a generation_config.json of its
    special ids only, without the temperature and top_p the model was published with."""
    save_hf_model(tmp_path / "hf", "gqa")
    fields = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**fields, "vocab_size": 320}))
    edit_weights(tmp_path / "hf", lambda t: t.update({name: t[name][:1].repeat(320, 1) for name in
                                                      ("model.embed_tokens.weight", "lm_head.weight")}))
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=2).save_pretrained(tmp_path / "hf")
    done = burst_train("--model", tmp_path / "hf", "--data", store, "--seq-len", 64, "--steps", 1, "--precision",
                       "fp32", "--val-tokens", 0, "--out", tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    convert_checkpoint_any(tmp_path / "run", tmp_path / "export", to="hf")
    generation = GenerationConfig.from_pretrained(tmp_path / "export")
    assert (generation.do_sample, generation.temperature, generation.top_p) == (True, 0.6, 0.9)
