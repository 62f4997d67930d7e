"""parallelize + train_step on gloo ranks against one process: same initial weights, same loss, same update."""

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import burst
from data.loader import IGNORE_INDEX, Batch
from models import ModelConfig, Transformer
from tests.distributed import run_on_ranks
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.parallelize import build_model
from trainer.step import train_step

SEQ_LEN, ROWS = 64, 2
MODEL = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=256)


def full_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, labels [ROWS, SEQ_LEN], with some labels ignored (uneven token counts across shards)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL.vocab_size, (ROWS, SEQ_LEN), generator=g)
    labels = torch.randint(0, MODEL.vocab_size, (ROWS, SEQ_LEN), generator=g)
    labels[0, 3:20] = IGNORE_INDEX
    labels[1, -5:] = IGNORE_INDEX
    return tokens, labels


def rank_batches(dp_rank: int, dp: int, cp_rank: int, cp: int, grad_accum: int) -> list[Batch]:
    """This rank's micro-batches: rows split over dp ranks and micro-batches, sequences over cp ranks."""
    tokens, labels = full_batch()
    rows_per_rank = ROWS // dp
    mine = slice(dp_rank * rows_per_rank, (dp_rank + 1) * rows_per_rank)
    positions = torch.arange(SEQ_LEN).expand(ROWS, SEQ_LEN)
    shards = [burst.shard_for_rank(t[mine], cp_rank, cp) for t in (tokens, labels, positions)]
    batches = []
    for micro in range(grad_accum):
        rows = slice(micro * rows_per_rank // grad_accum, (micro + 1) * rows_per_rank // grad_accum)
        t, lab, pos = (s[rows] for s in shards)
        batches.append(Batch(t, lab, pos, documents=None, num_tokens=int((lab != IGNORE_INDEX).sum()),
                             rope_length=SEQ_LEN))
    return batches


def config_for(cp: int, dp: int, grad_accum: int = 1, activation_checkpointing: str = "none") -> TrainConfig:
    # max_grad_norm 0: no clipping, so the step applies the raw gradient.
    return TrainConfig(model="debug", seq_len=SEQ_LEN, cp=cp, dp=dp, batch_size=ROWS // dp // grad_accum,
                       grad_accum=grad_accum, precision="fp32", max_grad_norm=0.0,
                       activation_checkpointing=activation_checkpointing)


def step_once(config: TrainConfig, env: Distributed, dp_rank: int, cp_rank: int):
    """Loss, grad norm and the full weights after one SGD step (weights - gradient) on this rank's share."""
    model = build_model(MODEL, env.mesh, config, env.device)
    initial = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
               for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    result = train_step(model, optimizer, rank_batches(dp_rank, config.dp, cp_rank, config.cp, config.grad_accum),
                        config, env)
    after = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    gradients = {n.replace("_checkpoint_wrapped_module.", ""): initial[n] - after[n] for n in initial}
    initial = {n.replace("_checkpoint_wrapped_module.", ""): t for n, t in initial.items()}
    return model, result, initial, gradients


def reference():
    config = config_for(cp=1, dp=1)
    _, result, initial, gradients = step_once(config, Distributed(0, 1, torch.device("cpu"), None), 0, 0)
    return result, initial, gradients


def _check_ranks(rank, world_size, cp, dp, grad_accum, activation_checkpointing, expected):
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    env = Distributed(rank, world_size, torch.device("cpu"), mesh)
    config = config_for(cp, dp, grad_accum, activation_checkpointing)
    model, result, initial, gradients = step_once(config, env, mesh["dp"].get_local_rank(),
                                                  mesh["cp"].get_local_rank())
    want_result, want_initial, want_gradients = expected

    blocks = [getattr(b, "_checkpoint_wrapped_module", b) for b in model.layers]
    assert all(isinstance(b.attention.core_attention, burst.BurstAttention) == (cp > 1) for b in blocks)
    assert all(hasattr(b, "_checkpoint_wrapped_module") == (activation_checkpointing != "none") for b in model.layers)
    assert all(isinstance(p, DTensor) for p in model.parameters())  # FSDP2 over all ranks
    for name, weights in want_initial.items():  # same seed, same weights, whatever the layout
        assert torch.equal(initial[name], weights), name
    assert result.loss == pytest.approx(want_result.loss, rel=1e-5)
    assert result.grad_norm == pytest.approx(want_result.grad_norm, rel=1e-5)
    for name, grad in want_gradients.items():  # d(global mean loss): not averaged, not cp times too small
        torch.testing.assert_close(gradients[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("cp, dp, grad_accum, activation_checkpointing", [
    (2, 1, 1, "none"),  # sequence parallel
    (1, 2, 1, "full"),  # data parallel
    (2, 1, 2, "selective"),  # sequence parallel with accumulation and selective activation checkpointing
    (2, 2, 1, "none"),  # both, 4 ranks
])
def test_parallel_step_matches_one_process(cp, dp, grad_accum, activation_checkpointing):
    run_on_ranks(_check_ranks, world_size=cp * dp, args=(cp, dp, grad_accum, activation_checkpointing, reference()))


def test_one_process_step_is_the_mean_token_loss_gradient():
    """The single-process reference itself: loss and gradient of F.cross_entropy's mean over scored tokens."""
    result, initial, gradients = reference()
    model = Transformer(MODEL)
    model.load_state_dict(initial)
    tokens, labels = full_batch()
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(gradients[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
