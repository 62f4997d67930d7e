"""--compile: the first training step compiles, no later step does (with and without documents, whose count
per row changes from batch to batch), and compiled steps give eager's losses."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from data.loader import Batch
from models import ModelConfig
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.parallelize import build_model
from trainer.step import checks_ranks, train_step

SEQ_LEN, ROWS, STEPS = 64, 2, 4
MODEL = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=256)
# documents per row, different at every step (a row of one document too)
DOCUMENTS = [[[0, 20, 45, 64], [0, 64]], [[0, 10, 64], [0, 30, 50, 60, 64]], [[0, 64], [0, 5, 64]],
             [[0, 33, 64], [0, 12, 24, 36, 48, 64]]]


def batch_for(step: int) -> Batch:
    g = torch.Generator().manual_seed(step)
    tokens, labels = (torch.randint(0, MODEL.vocab_size, (ROWS, SEQ_LEN), generator=g) for _ in range(2))
    return Batch(tokens, labels, torch.arange(SEQ_LEN).expand(ROWS, SEQ_LEN),
                 doc_boundaries=[torch.tensor(d) for d in DOCUMENTS[step % len(DOCUMENTS)]],
                 num_tokens=labels.numel(), rope_length=SEQ_LEN)


def compiles_per_step(compile: bool, doc_mask: bool, activation_checkpointing: str) -> tuple[list[float], list[int]]:
    """Losses of STEPS training steps on one process (ranks checked on the first, as the trainer does) and the
    graphs dynamo compiled during each."""
    torch._dynamo.reset()
    counters.clear()
    config = TrainConfig(model="debug", seq_len=SEQ_LEN, batch_size=ROWS, precision="fp32", max_grad_norm=1.0,
                         doc_mask=doc_mask, compile=compile, activation_checkpointing=activation_checkpointing)
    env = Distributed(0, 1, torch.device("cpu"), None)
    model = build_model(MODEL, None, config, env.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, compiled = [], []
    for step in range(1, STEPS + 1):
        before = counters["stats"]["unique_graphs"]
        losses.append(train_step(model, optimizer, [batch_for(step)], config, env,
                                 checks_ranks(step, 1, config.check_ranks_every)).loss)
        compiled.append(counters["stats"]["unique_graphs"] - before)
    return losses, compiled


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
@pytest.mark.parametrize("doc_mask", [False, True], ids=["causal", "documents"])
def test_only_the_first_step_compiles(doc_mask, checkpointing):
    eager, _ = compiles_per_step(False, doc_mask, checkpointing)
    losses, compiled = compiles_per_step(True, doc_mask, checkpointing)
    assert compiled[0] >= 1 and compiled[1:] == [0] * (STEPS - 1), compiled
    assert losses == pytest.approx(eager, rel=1e-4)
