"""The model family: presets, meta-device build and init, explicit positions, document masking, checkpoints."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from burst import shard_for_rank, zigzag_positions
from models import PRESETS, LocalAttention, ModelConfig, init_model, load_model, save_model
from models.checkpoint import expected_shapes


def count_params(config: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in expected_shapes(config).values())


def test_preset_sizes_and_real_hyperparameters():
    assert 2e5 < count_params(ModelConfig.from_name("debug")) < 1e6
    assert 1e7 < count_params(ModelConfig.from_name("tiny")) < 1e8
    # Published parameter counts and FFN widths of the real checkpoints.
    assert count_params(ModelConfig.from_name("llama2-7b")) == 6_738_415_616
    assert count_params(ModelConfig.from_name("llama2-13b")) == 13_015_864_320
    assert count_params(ModelConfig.from_name("llama3-8b")) == 8_030_261_248
    assert count_params(ModelConfig.from_name("llama3.2-1b")) == 1_235_814_400  # tied: one [vocab, dim] matrix
    assert count_params(ModelConfig.from_name("llama3.2-3b")) == 3_212_749_824
    assert [ModelConfig.from_name(n).ffn_hidden_dim for n in ("llama2-7b", "llama2-13b", "llama3.1-8b")] == \
        [11008, 13824, 14336]
    assert ModelConfig.from_name("llama3.1-8b").rope_scaling.factor == 8.0
    assert ModelConfig.from_name("debug").n_kv_heads < ModelConfig.from_name("debug").n_heads


def test_config_errors_and_round_trip():
    with pytest.raises(ValueError, match="unknown model preset 'nope'; valid presets: debug, tiny, llama2-7b"):
        ModelConfig.from_name("nope")
    config = ModelConfig.from_name("llama3.1-8b")
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match=r"unknown model config keys \['n_layer'\]"):
        ModelConfig.from_dict({**config.to_dict(), "n_layer": 3})
    with pytest.raises(ValueError, match="not a multiple of n_kv_heads"):
        ModelConfig(dim=64, n_heads=4, n_kv_heads=3)
    # The trainer swaps in the tokenizer's vocabulary; the preset itself stays untouched.
    assert dataclasses.replace(ModelConfig.from_name("tiny"), vocab_size=32000).vocab_size == 32000
    assert PRESETS["tiny"].model.vocab_size == 4096


def test_meta_build_and_documented_init():
    config = dataclasses.replace(ModelConfig.from_name("tiny"), n_layers=2, init_std=0.05)
    model = init_model(config)
    assert all(not p.is_meta for p in model.parameters())
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.05, rel=0.02)
    assert model.layers[0].attention.wq.weight.std().item() == pytest.approx(0.05, rel=0.02)
    assert model.layers[1].feed_forward.w2.weight.std().item() == pytest.approx(0.05 / math.sqrt(4), rel=0.02)
    assert torch.equal(model.layers[0].ffn_norm.weight, torch.ones(config.dim))
    logits = model(torch.randint(0, config.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, config.vocab_size) and torch.isfinite(logits).all()


def test_tied_embeddings_share_one_matrix():
    model = init_model(dataclasses.replace(ModelConfig.from_name("debug"), tie_embeddings=True))
    assert model.output is None and model.output_weight is model.tok_embeddings.weight
    assert "output.weight" not in model.state_dict()


class RecordingAttention(nn.Module):
    """Stands in for core_attention the way the trainer's distributed module does; keeps q and k."""

    def __init__(self):
        super().__init__()
        self.inner = LocalAttention()

    def forward(self, q, k, v, doc_boundaries=None):
        self.q, self.k = q, k
        return self.inner(q, k, v, doc_boundaries)


def test_zigzag_shard_gets_the_rotation_of_its_global_positions():
    model = init_model(dataclasses.replace(ModelConfig.from_name("debug"), rope_theta=500.0))
    model.layers[0].attention.core_attention = recorder = RecordingAttention()
    seq_len, world_size = 32, 4
    tokens = torch.randint(0, 4096, (2, seq_len))
    with torch.no_grad():
        model(tokens)
        full_q, full_k = recorder.q, recorder.k
        for rank in range(world_size):
            positions = zigzag_positions(seq_len, rank, world_size)
            for batched_positions in (positions, positions.expand(2, -1)):
                model(shard_for_rank(tokens, rank, world_size), positions=batched_positions)
                torch.testing.assert_close(recorder.q, shard_for_rank(full_q, rank, world_size), rtol=0, atol=1e-6)
                torch.testing.assert_close(recorder.k, shard_for_rank(full_k, rank, world_size), rtol=0, atol=1e-6)
    # Without the positions the shard would be rotated as if it started at 0: the test can fail.
    model(shard_for_rank(tokens, 1, world_size))
    assert not torch.allclose(recorder.q, shard_for_rank(full_q, 1, world_size), atol=1e-3)


def test_document_mask_equals_running_each_document_alone():
    torch.manual_seed(0)
    seq_len, n_heads, n_kv_heads, head_dim = 24, 4, 2, 8
    q = torch.randn(2, seq_len, n_heads, head_dim)
    k, v = torch.randn(2, 2, seq_len, n_kv_heads, head_dim).unbind(0)
    boundaries = [torch.tensor([0, 5, 17, 24]), torch.tensor([0, 24])]
    out = LocalAttention()(q, k, v, doc_boundaries=boundaries)
    for row, row_boundaries in enumerate(boundaries):
        for start, end in zip(row_boundaries[:-1].tolist(), row_boundaries[1:].tolist(), strict=True):
            alone = LocalAttention()(q[row:row + 1, start:end], k[row:row + 1, start:end], v[row:row + 1, start:end])
            torch.testing.assert_close(out[row:row + 1, start:end], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1:], LocalAttention()(q[1:], k[1:], v[1:]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="doc_boundaries has 1 rows but the batch has 2"):
        LocalAttention()(q, k, v, doc_boundaries=boundaries[:1])


def test_loss_is_cross_entropy_of_the_logits():
    model = init_model(ModelConfig.from_name("debug"))
    tokens = torch.randint(0, 4096, (2, 20))
    labels = torch.randint(0, 4096, (2, 20))
    labels[0, :7] = -100
    loss_sum, count = model.loss(tokens, labels, chunk_size=8)
    expected = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="sum")
    assert count.item() == 33 and count.dtype == torch.int64
    torch.testing.assert_close(loss_sum, expected, rtol=1e-5, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_sum, _ = model.loss(tokens, labels, chunk_size=8)
    bf16_sum.backward()
    assert bf16_sum.dtype == torch.float32 and torch.isfinite(model.tok_embeddings.weight.grad).all()


@pytest.mark.parametrize("max_shard_bytes", [2**30, 100_000])
def test_native_checkpoint_round_trip(tmp_path, max_shard_bytes):
    config = ModelConfig.from_name("debug")
    model = init_model(config)
    save_model(model, config, tmp_path / "ckpt", max_shard_bytes=max_shard_bytes)
    sharded = (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_bytes < 2**30)
    loaded = load_model(tmp_path / "ckpt")
    tokens = torch.randint(0, 4096, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    assert load_model(tmp_path / "ckpt", dtype=torch.bfloat16).norm.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="already exists"):
        save_model(model, config, tmp_path / "ckpt")


def test_native_checkpoint_errors(tmp_path):
    config = ModelConfig.from_name("debug")
    state_dict = init_model(config).state_dict()
    with pytest.raises(ValueError, match=r"missing tensors \['norm.weight'\]"):
        save_model({k: v for k, v in state_dict.items() if k != "norm.weight"}, config, tmp_path / "a")
    with pytest.raises(ValueError, match=r"unexpected tensors \['extra.weight'\]"):
        save_model({**state_dict, "extra.weight": torch.zeros(1)}, config, tmp_path / "a")
    assert not (tmp_path / "a").exists()

    save_model(state_dict, config, tmp_path / "a")
    wrong = dataclasses.replace(config, vocab_size=1000)
    (tmp_path / "a" / "config.json").write_text(json.dumps(wrong.to_dict()))
    shape_error = r"'tok_embeddings.weight' has shape \[4096, 64\] but the config implies \[1000, 64\]"
    with pytest.raises(ValueError, match=shape_error):
        load_model(tmp_path / "a")
    (tmp_path / "a" / "config.json").write_text(json.dumps({**config.to_dict(), "heads": 2}))
    with pytest.raises(ValueError, match=r"config.json: unknown model config keys \['heads'\]"):
        load_model(tmp_path / "a")

    (tmp_path / "a" / "config.json").write_text(json.dumps(config.to_dict()))
    weights = tmp_path / "a" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        load_model(tmp_path / "a")


def test_non_finite_names_each_tensor_holding_a_nan_or_an_infinity_and_no_other():
    """The check of every start, save and evaluation reads each tensor's extremes: a NaN or an infinity anywhere,
    in any dtype, is found; the largest finite values and an empty shard (FSDP2 gives some ranks one) are not."""
    from models.checkpoint import non_finite

    big = torch.finfo(torch.float32).max
    tensors = {"fine": torch.randn(64, 8), "empty": torch.empty(0, 8), "largest": torch.tensor([big, -big]),
               "nan": torch.randn(1000).index_fill_(0, torch.tensor([777]), float("nan")),
               "plus_inf_bf16": torch.randn(3, 5).bfloat16().index_fill_(1, torch.tensor([2]), float("inf")),
               "minus_inf": torch.tensor([[1.0], [-float("inf")]]), "nan_and_inf": torch.tensor([float("nan"),
                                                                                               float("inf")])}
    assert non_finite(tensors.items()) == ["nan", "plus_inf_bf16", "minus_inf", "nan_and_inf"]
    assert non_finite([]) == []
    for name, tensor in tensors.items():  # the same verdict as the elementwise check, tensor by tensor
        assert (non_finite([(name, tensor)]) == []) == bool(torch.isfinite(tensor).all())
