"""Sharded start-up: fresh weights drawn per shard equal one process's for the same seed on any layout, and
checkpoints (native and Hugging Face) read slice by slice give every rank exactly the rows it keeps."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import models.init
from models import ModelConfig, init_model, save_model
from models.convert import read_checkpoint
from models.init import initial_rows
from tests.distributed import run_on_ranks
from tests.test_convert import save_hf_model
from trainer.config import TrainConfig
from trainer.parallelize import build_model, model_name

MODEL = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=300)
# Small pieces, so that parameters span many and shard boundaries fall inside pieces (the real size is 2^20).
SMALL_PIECE = 1000


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(models.init, "PIECE", SMALL_PIECE)


def test_any_rows_drawn_alone_equal_those_rows_of_the_whole_parameter(small_pieces):
    shape = (37, 64)  # 2368 elements: 3 pieces, none aligned with a row
    whole = initial_rows(MODEL, "layers.0.attention.wq.weight", shape, seed=3, rows=range(37))
    for rows in (range(0, 1), range(5, 20), range(15, 16), range(36, 37), range(20, 20)):
        assert torch.equal(initial_rows(MODEL, "layers.0.attention.wq.weight", shape, 3, rows), whole[rows.start:
                                                                                                      rows.stop])
    assert not torch.equal(initial_rows(MODEL, "layers.0.attention.wq.weight", shape, 4, range(37)), whole)
    assert not torch.equal(initial_rows(MODEL, "layers.0.attention.wk.weight", shape, 3, range(37)), whole)
    # The model's rule: normal(0, init_std), output projections scaled by 1 / sqrt(2 n_layers), norms at 1.
    big = (512, 512)
    assert initial_rows(MODEL, "tok_embeddings.weight", big, 0, range(512)).std().item() == \
        pytest.approx(MODEL.init_std, rel=0.02)
    assert initial_rows(MODEL, "layers.1.feed_forward.w2.weight", big, 0, range(512)).std().item() == \
        pytest.approx(MODEL.init_std / math.sqrt(2 * MODEL.n_layers), rel=0.02)
    assert torch.equal(initial_rows(MODEL, "norm.weight", (64,), 0, range(10, 30)), torch.ones(20))


def _gather_weights(rank, world_size, cp, dp, sources, results):
    models.init.PIECE = SMALL_PIECE  # this process imported models.init afresh
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    config = TrainConfig(model="debug", seq_len=64, cp=cp, dp=dp, seed=7)
    weights = []
    for model_config, checkpoint in sources:
        model = build_model(model_config, mesh, config, torch.device("cpu"), checkpoint)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert all(p.to_local().numel() < p.numel() or p.shape[0] < world_size for p in model.parameters())
        weights.append({model_name(n): p.full_tensor() for n, p in model.named_parameters()})
    if rank == 0:
        torch.save(weights, results)


def gathered(tmp_path, cp: int, dp: int, checkpoints=()) -> list[dict[str, torch.Tensor]]:
    """The full weights build_model gives on cp x dp ranks: fresh from seed 7, then each of `checkpoints`'."""
    results = tmp_path / f"weights-cp{cp}-dp{dp}.pt"
    sources = [(MODEL, None)] + [(read_checkpoint(path).config, path) for path in checkpoints]
    run_on_ranks(_gather_weights, world_size=cp * dp, args=(cp, dp, sources, results))
    return torch.load(results)


def assert_same_weights(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        assert found[name].dtype == torch.float32 and torch.equal(found[name], tensor.float()), name


def test_fresh_and_loaded_weights_are_the_same_at_cp1_cp2_dp2_and_an_uneven_dp3(tmp_path, small_pieces):
    one_process = build_model(MODEL, None, TrainConfig(model="debug", seq_len=64, seed=7), torch.device("cpu"))
    expected = init_model(MODEL, seed=7).state_dict()
    assert_same_weights(dict(one_process.named_parameters()), expected)
    native = tmp_path / "native"
    save_model(init_model(MODEL, seed=1), MODEL, native, max_shard_bytes=100_000)  # several files and an index
    save_hf_model(tmp_path / "hf", "mha-tied-theta", max_shard_size="100KB")
    checkpoints = (native, tmp_path / "hf")
    fresh, *loaded = gathered(tmp_path, cp=2, dp=1, checkpoints=checkpoints)
    assert_same_weights(fresh, expected)
    for path, weights in zip(checkpoints, loaded, strict=True):  # each rank read only its rows
        assert_same_weights(weights, dict(read_checkpoint(path).tensors()))
    for cp, dp in ((1, 2), (1, 3)):  # dp 3 splits 300 rows and 64-wide norms unevenly
        assert_same_weights(gathered(tmp_path, cp, dp)[0], expected)
