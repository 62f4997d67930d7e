"""DPO of a windowed model: a Mistral whose every layer slides a window shorter than its pairs' sequences, trained
on packed preference pairs (with and without prefix sharing) at cp 1 and cp 2, gives TRL's loss and gradient norm
as transformers' MistralForCausalLM computes them on each pair unpacked (prompt + chosen, prompt + rejected)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from torch.distributed.device_mesh import init_device_mesh

from data import SequenceLoader, TokenStore
from data.preference_packing import PreferenceStream
from models.convert import NATIVE_TO_HF, rename
from models.hf_config import config_to_hf
from tests.distributed import run_on_ranks
from tests.test_instruction_training import model_config
from tests.test_preference import make_pair_store, reference_logps, transformers_pair_logps, trl_losses
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.parallelize import build_model
from trainer.preference import Reference
from trainer.step import train_step

SEQ_LEN, SEQUENCES, WINDOW = 384, 1, 16  # a pair packed: 130-200 tokens, many windows long
SHARING = (False, True)


def windowed_config(store: TokenStore):
    return dataclasses.replace(model_config(store), family="mistral", sliding_window=WINDOW, max_seq_len=SEQ_LEN)


def train_config(cp: int, sharing: bool) -> TrainConfig:
    return TrainConfig(model="debug", seq_len=SEQ_LEN, cp=cp, batch_size=SEQUENCES, precision="fp32",
                       max_grad_norm=0.0, doc_mask=True, seed=3, objective="dpo", beta=0.3, prefix_sharing=sharing)


@pytest.fixture(scope="module")
def pair_store(tmp_path_factory) -> Path:
    return make_pair_store(tmp_path_factory.mktemp("windowed-preferences"))


def transformers_dpo(store_dir: Path, sharing: bool) -> tuple[float, float]:
    """Step 1's DPO loss and gradient norm as transformers' Mistral (sliding window) computes them, pair by pair."""
    store = TokenStore(store_dir).split("train")
    config = windowed_config(store)
    model = build_model(config, None, train_config(1, sharing), torch.device("cpu"))
    hf = transformers.MistralForCausalLM(transformers.MistralConfig.from_dict(
        config_to_hf(config, torch.float32), attn_implementation="eager"))
    assert hf.config.sliding_window == WINDOW
    hf.load_state_dict({rename(name, NATIVE_TO_HF): t for name, t in model.state_dict().items()}, strict=False)
    stream = PreferenceStream(store, SEQ_LEN, 3, prefix_sharing=sharing)
    documents = np.concatenate([stream.sequence(k).documents for k in range(SEQUENCES)])
    logps, tokens = transformers_pair_logps(hf, store, documents, shortest=2 * WINDOW)  # the window cuts every pair
    reference = torch.from_numpy(reference_logps(store))[documents]
    loss = trl_losses("dpo", logps[:, 0], logps[:, 1], tokens[:, 0], tokens[:, 1], reference).mean()
    loss.backward()
    return loss.item(), torch.nn.utils.clip_grad_norm_(hf.parameters(), float("inf")).item()


@pytest.fixture(scope="module")
def expected(pair_store) -> dict:
    return {sharing: transformers_dpo(pair_store, sharing) for sharing in SHARING}


def _dpo_step(rank, world_size, store_dir, expected):
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp")) if world_size > 1 else None
    env = Distributed(rank, world_size, torch.device("cpu"), mesh)
    store = TokenStore(store_dir).split("train")
    reference = Reference(reference_logps(store))
    for sharing in SHARING:
        config, model_config_ = train_config(world_size, sharing), windowed_config(store)
        model = build_model(model_config_, mesh, config, torch.device("cpu"))
        loader = SequenceLoader(store, SEQ_LEN, config.batch_size, cp_rank=env.cp_rank, cp_size=world_size,
                                seed=config.seed, reset_positions=True, cp_layout=config.sequence_layout,
                                prefix_sharing=sharing, layout_windows=model_config_.windows)
        result = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [reference.attach(next(loader))],
                            config, env)
        loss, grad_norm = expected[sharing]
        assert abs(result.loss - loss) <= 1e-5, (sharing, world_size, result.loss, loss)
        assert result.grad_norm == pytest.approx(grad_norm, rel=1e-4), (sharing, world_size, result.grad_norm)


@pytest.mark.parametrize("cp", [1, 2])
def test_dpo_of_a_windowed_model_is_transformers_at_cp1_and_cp2(pair_store, expected, cp):
    if cp == 1:
        _dpo_step(0, 1, pair_store, expected)
    else:
        run_on_ranks(_dpo_step, 2, args=(pair_store, expected), timeout_s=300)
