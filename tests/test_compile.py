"""--compile: the first training step compiles, no later step does (with and without documents, whose count
per row changes from batch to batch), and compiled steps give eager's losses."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

import burst
from data.loader import Batch
from models import ModelConfig
from tests.distributed import run_on_ranks
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.parallelize import build_model
from trainer.step import checks_ranks, train_step

SEQ_LEN, ROWS, STEPS = 64, 2, 4
MODEL = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=256)
# documents per row, different at every step (a row of one document too)
DOCUMENTS = [[[0, 20, 45, 64], [0, 64]], [[0, 10, 64], [0, 30, 50, 60, 64]], [[0, 64], [0, 5, 64]],
             [[0, 33, 64], [0, 12, 24, 36, 48, 64]]]


def batch_for(step: int, cp_rank: int = 0, cp: int = 1) -> Batch:
    g = torch.Generator().manual_seed(step)
    tokens, labels = (torch.randint(0, MODEL.vocab_size, (ROWS, SEQ_LEN), generator=g) for _ in range(2))
    positions = torch.arange(SEQ_LEN).expand(ROWS, SEQ_LEN)
    documents = burst.Documents.of(DOCUMENTS[step % len(DOCUMENTS)], SEQ_LEN, cp, "balanced")  # --doc-mask's
    shards = [documents.shard(t, cp_rank) for t in (tokens, labels, positions)]
    return Batch(*shards, documents=documents,
                 num_tokens=shards[1].numel(), rope_length=SEQ_LEN)


def compiles_per_step(compile: bool, doc_mask: bool, activation_checkpointing: str, rank: int = 0, cp: int = 1,
                      check_every: int = 100) -> tuple[list[float], list[int]]:
    """Losses of STEPS training steps (ranks checked on the first and every `check_every`, as the trainer does)
    and the graphs dynamo compiled during each."""
    torch._dynamo.reset()
    counters.clear()
    config = TrainConfig(model="debug", seq_len=SEQ_LEN, batch_size=ROWS, precision="fp32", max_grad_norm=1.0,
                         doc_mask=doc_mask, compile=compile, activation_checkpointing=activation_checkpointing,
                         cp=cp, check_ranks_every=check_every)
    mesh = init_device_mesh("cpu", (1, cp), mesh_dim_names=("dp", "cp")) if cp > 1 else None
    env = Distributed(rank, cp, torch.device("cpu"), mesh)
    model = build_model(MODEL, mesh, config, env.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, compiled = [], []
    for step in range(1, STEPS + 1):
        before = counters["stats"]["unique_graphs"]
        losses.append(train_step(model, optimizer, [batch_for(step, rank, cp)], config, env,
                                 checks_ranks(step, 1, check_every)).loss)
        compiled.append(counters["stats"]["unique_graphs"] - before)
    return losses, compiled


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
@pytest.mark.parametrize("doc_mask", [False, True], ids=["causal", "documents"])
def test_only_the_first_step_compiles(doc_mask, checkpointing):
    eager, _ = compiles_per_step(False, doc_mask, checkpointing)
    losses, compiled = compiles_per_step(True, doc_mask, checkpointing)
    assert compiled[0] >= 1 and compiled[1:] == [0] * (STEPS - 1), compiled
    assert losses == pytest.approx(eager, rel=1e-4)


def _cp2_compiles_only_in_the_first_step(rank, world_size):
    eager, _ = compiles_per_step(False, True, "none", rank, world_size, check_every=3)
    losses, compiled = compiles_per_step(True, True, "none", rank, world_size, check_every=3)
    assert compiled[0] >= 1 and compiled[1:] == [0] * (STEPS - 1), compiled
    assert losses == pytest.approx(eager, rel=1e-4)


def test_at_cp2_the_rank_checks_cause_no_compile_after_the_first_step():
    """At cp 2 steps 1 and 3 compare the ranks (in an eager forward before the step); the compiled graphs are
    still made in step 1 only, and the losses are eager's."""
    # fresh: it counts compilations, and torch's caches must start empty
    run_on_ranks(_cp2_compiles_only_in_the_first_step, 2, timeout_s=300, fresh=True)
