"""The fast path: selective checkpointing keeps attention, compiled blocks match eager, rank checks only when asked."""

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import burst
import burst.operator
from data.loader import Batch
from models import ModelConfig
from tests.distributed import run_on_ranks
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.parallelize import build_model
from trainer.step import checks_ranks, forward_backward, train_step

SEQ_LEN, ROWS = 64, 2
MODEL = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=256)
# documents per row, different at every step: compiled graphs must not depend on their number
DOCUMENTS = [[[0, 20, 45, 64], [0, 64]], [[0, 10, 64], [0, 30, 50, 60, 64]], [[0, 64], [0, 5, 64]],
             [[0, 33, 64], [0, 12, 24, 36, 48, 64]], [[0, 40, 64], [0, 64]]]


def batch_for(step: int, cp_rank: int, cp: int) -> Batch:
    g = torch.Generator().manual_seed(step)
    tokens, labels = (torch.randint(0, MODEL.vocab_size, (ROWS, SEQ_LEN), generator=g) for _ in range(2))
    positions = torch.arange(SEQ_LEN).expand(ROWS, SEQ_LEN)
    documents = burst.Documents.of(DOCUMENTS[step % len(DOCUMENTS)], SEQ_LEN, cp, "balanced")  # --doc-mask's
    shards = [documents.shard(t, cp_rank) for t in (tokens, labels, positions)]
    return Batch(*shards, documents=documents,
                 num_tokens=shards[1].numel(), rope_length=SEQ_LEN)


def config_for(**settings) -> TrainConfig:
    return TrainConfig(model="debug", seq_len=SEQ_LEN, batch_size=ROWS, precision="fp32", max_grad_norm=0.0,
                       **settings)


def loss_grads_and_ring_forwards(mode: str, doc_mask: bool, monkeypatch) -> tuple[float, dict, int]:
    """One forward and backward with --activation-checkpointing `mode` on one process: the loss, the gradients
    and the ring forwards run (BurstAttention with doc_mask; LocalAttention's burst.local_attn without)."""
    config = config_for(doc_mask=doc_mask, activation_checkpointing=mode)
    model = build_model(MODEL, None, config, torch.device("cpu"))
    ring_forwards = []
    real_ring_forward = burst.operator.ring_forward
    monkeypatch.setattr(burst.operator, "ring_forward", lambda *a: ring_forwards.append(1) or real_ring_forward(*a))
    loss = forward_backward(model, batch_for(0, 0, 1), torch.tensor(float(ROWS * SEQ_LEN)), config,
                            torch.device("cpu"))
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return loss.item(), grads, len(ring_forwards)


@pytest.mark.parametrize("doc_mask", [True, False], ids=["burst-attention", "local-attention"])
def test_selective_checkpointing_keeps_attention_and_changes_no_result(doc_mask, monkeypatch):
    loss, grads, ring_forwards = loss_grads_and_ring_forwards("none", doc_mask, monkeypatch)
    assert ring_forwards == MODEL.n_layers
    for mode, recomputed in (("full", MODEL.n_layers), ("selective", 0)):
        got_loss, got_grads, got_ring_forwards = loss_grads_and_ring_forwards(mode, doc_mask, monkeypatch)
        assert got_ring_forwards == ring_forwards + recomputed, mode
        assert got_loss == pytest.approx(loss, rel=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-7, msg=f"{mode}: {name}")


def test_ranks_are_checked_on_the_first_step_and_every_n():
    assert [s for s in range(5, 12) if checks_ranks(s, first_step=5, every=4)] == [5, 8]


def _count_checks(rank, world_size, steps, every):
    """All-gathers and host reads (Tensor.tolist) per training step, on 2 cp ranks."""
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp"))
    env = Distributed(rank, world_size, torch.device("cpu"), mesh)
    config = config_for(cp=world_size, doc_mask=True, check_ranks_every=every)
    model = build_model(MODEL, mesh, config, env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = {"all_gather": 0, "tolist": 0}
    real_all_gather, real_tolist = dist.all_gather, torch.Tensor.tolist

    def all_gather(*args, **kwargs):
        counts["all_gather"] += 1
        return real_all_gather(*args, **kwargs)

    def tolist(self):
        counts["tolist"] += 1
        return real_tolist(self)

    dist.all_gather, torch.Tensor.tolist = all_gather, tolist
    per_step = []
    try:
        for step in range(1, steps + 1):
            counts.update(all_gather=0, tolist=0)
            train_step(model, optimizer, [batch_for(step, rank, world_size)], config, env,
                       checks_ranks(step, 1, every))
            per_step.append(dict(counts))
    finally:
        dist.all_gather, torch.Tensor.tolist = real_all_gather, real_tolist
    boundary_reads = 2 * MODEL.n_layers  # the op reads the (CPU) document offsets in forward and in backward
    for step, counted in enumerate(per_step, 1):
        checked = step in (1, every)
        assert counted["all_gather"] == (MODEL.n_layers if checked else 0), (step, counted)
        check_reads = MODEL.n_layers  # the gathered signatures (the offsets they fingerprint are host values)
        assert counted["tolist"] == boundary_reads + (check_reads if checked else 0), (step, counted)


def test_agreement_check_runs_only_on_the_steps_meant_to():
    run_on_ranks(_count_checks, 2, args=(4, 3))


def five_steps(compile: bool, cp: int, rank: int, mesh) -> list[float]:
    """Losses of 5 training steps with document masking; ranks checked on the first step only."""
    env = Distributed(rank, cp, torch.device("cpu"), mesh)
    config = config_for(cp=cp, doc_mask=True, compile=compile, check_ranks_every=1000)
    model = build_model(MODEL, mesh, config, env.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return [train_step(model, optimizer, [batch_for(step, rank, cp)], config, env, checks_ranks(step, 1, 1000)).loss
            for step in range(1, 6)]


def _compiled_matches_eager(rank, world_size):
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp")) if world_size > 1 else None
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graphs counted by tests that ran before in this process
    eager = five_steps(False, world_size, rank, mesh)
    started = time.perf_counter()
    compiled = five_steps(True, world_size, rank, mesh)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"cp {world_size}: 5 compiled steps in {time.perf_counter() - started:.1f} s, {graphs} graphs")
    assert compiled == pytest.approx(eager, rel=1e-4)
    # one graph for the blocks (at cp 2 step 1 runs eagerly: it checks the ranks), whatever the documents per row
    assert graphs == 1


def test_compiled_blocks_match_eager_with_document_masking_cp1():
    _compiled_matches_eager(0, 1)


def test_compiled_blocks_match_eager_with_document_masking_cp2():
    run_on_ranks(_compiled_matches_eager, 2, timeout_s=300, fresh=True)  # compiles: torch's caches must start empty
