"""trainer/memory.py: the tiled MLP and loss give the loss and gradients of the whole-sequence computation (1e-6,
float32), against a float64 reference too; offloaded block inputs give exactly the loss and gradients of the
recomputation without them, LoRA's adapters included."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from data.loader import IGNORE_INDEX, Batch
from models import ModelConfig, Transformer
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.memory import HostCopy, offloading_checkpoint
from trainer.parallelize import build_model, model_name
from trainer.step import train_step

MODEL = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=256)
SEQ_LEN = 96


def batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL.vocab_size, (1, SEQ_LEN), generator=g)
    labels = torch.randint(0, MODEL.vocab_size, (1, SEQ_LEN), generator=g)
    labels[0, :7] = IGNORE_INDEX
    return Batch(tokens, labels, torch.arange(SEQ_LEN)[None], documents=None,
                 num_tokens=int((labels != IGNORE_INDEX).sum()), rope_length=SEQ_LEN)


def step(**settings) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One step's loss, each trainable parameter's gradient, and the initial weights."""
    config = TrainConfig(model="debug", seq_len=SEQ_LEN, precision="fp32", max_grad_norm=0.0, **settings)
    model = build_model(MODEL, None, config, torch.device("cpu"))
    initial = {model_name(n): p.detach().clone() for n, p in model.named_parameters()}
    gradients = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            param.register_hook(lambda grad, name=model_name(name): gradients.__setitem__(name, grad.clone()))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    result = train_step(model, optimizer, [batch()], config, Distributed(0, 1, torch.device("cpu"), None))
    return result.loss, gradients, initial


def float64_reference(initial: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    model = Transformer(MODEL).double()
    model.load_state_dict(initial)
    b = batch()
    loss = F.cross_entropy(model(b.tokens).flatten(0, 1), b.labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.item(), {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_tiled_mlp_and_loss_equal_the_whole_sequence(checkpointing):
    whole_loss, whole, initial = step(activation_checkpointing=checkpointing)
    tiled_loss, tiled, _ = step(activation_checkpointing=checkpointing, mlp_tile=20, loss_tile=16)  # uneven slices
    assert tiled_loss == pytest.approx(whole_loss, rel=1e-6)
    want_loss, want = float64_reference(initial)
    assert tiled_loss == pytest.approx(want_loss, rel=1e-6)
    assert set(tiled) == set(whole) == set(want)
    for name, grad in whole.items():
        torch.testing.assert_close(tiled[name], grad, rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(tiled[name].double(), want[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("settings", [dict(activation_checkpointing="full"),
                                      dict(activation_checkpointing="selective", lora_rank=4, lora_targets="q,v,up",
                                           mlp_tile=32)])
def test_offloaded_block_inputs_give_exactly_the_same_step(settings):
    kept_loss, kept, _ = step(**settings)
    offloaded_loss, offloaded, _ = step(**settings, offload_activations=True)
    assert offloaded_loss == kept_loss
    assert set(offloaded) == set(kept) and kept
    for name, grad in kept.items():
        assert torch.equal(offloaded[name], grad), name


def test_the_offloading_checkpoint_keeps_no_device_input():
    """The checkpoint's recomputation starts from the host copy: the block input itself is not kept."""
    block = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    kept = []
    original = HostCopy.back

    def back(self):
        kept.append(self)
        return original(self)

    HostCopy.back = back
    try:
        out = offloading_checkpoint({})(block, x * 1.0)
        out.sum().backward()
    finally:
        HostCopy.back = original
    assert len(kept) == 1 and kept[0].host.data_ptr() != x.data_ptr()  # recomputed from the separate buffer
    torch.testing.assert_close(x.grad, block.weight.sum(0).expand(4, 8))
