"""FSDP2 mixed precision for bf16 on CUDA: bf16 parameters in compute, float32 master weights and reductions.

No GPU here: the CUDA policy is forced onto a CPU gloo mesh to check that parallelize applies it on
every fully_shard, and that a step under it matches the float32 step within bf16 tolerance.
"""

import dataclasses
import importlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.distributed import run_on_ranks
from tests.test_parallelize import config_for, rank_batches, step_once
from trainer.distributed import Distributed
from trainer.parallelize import mixed_precision_policy

PARALLELIZE = importlib.import_module("trainer.parallelize")  # the module (trainer.parallelize is the function)


def test_policy_is_bf16_compute_with_float32_reduction_only_for_bf16_on_cuda():
    bf16, fp32 = config_for(cp=1, dp=2), dataclasses.replace(config_for(cp=1, dp=2), precision="fp32")
    bf16 = dataclasses.replace(bf16, precision="bf16")
    policy = mixed_precision_policy(bf16, "cuda")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    for config, device_type in ((bf16, "cpu"), (fp32, "cuda"), (fp32, "cpu")):
        policy = mixed_precision_policy(config, device_type)
        assert policy.param_dtype is None and policy.reduce_dtype is None  # no casting


def _cuda_policy_on_cpu(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "cp"))
    env = Distributed(rank, world_size, torch.device("cpu"), mesh)
    fp32 = config_for(cp=1, dp=world_size)
    bf16 = dataclasses.replace(fp32, precision="bf16")
    _, want, _, want_gradients = step_once(fp32, env, rank, 0)

    real_policy = PARALLELIZE.mixed_precision_policy
    PARALLELIZE.mixed_precision_policy = lambda config, _device_type: real_policy(config, "cuda")
    try:
        model, got, _, gradients = step_once(bf16, env, rank, 0)
        assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())  # master weights
        compute_dtypes, head_inputs = set(), set()
        hooks = [block.register_forward_pre_hook(
            lambda module, _: compute_dtypes.add(module.attention.wq.weight.dtype)) for block in model.layers]
        hooks.append(model.norm.register_forward_hook(lambda _module, _input, out: head_inputs.add(out.dtype)))
        model.loss(*(getattr(rank_batches(rank, world_size, 0, 1, 1)[0], n) for n in ("tokens", "labels")))
        for hook in hooks:
            hook.remove()
    finally:
        PARALLELIZE.mixed_precision_policy = real_policy
    assert compute_dtypes == {torch.bfloat16}  # every block runs on its bf16 copy
    assert head_inputs == {torch.bfloat16}  # with the bf16 output weight: the LM head runs in bf16 (models/loss.py)
    assert abs(got.loss - want.loss) < 2e-2 * want.loss
    for name, grad in want_gradients.items():
        assert (gradients[name] - grad).norm() <= 5e-2 * grad.norm() + 1e-6, name


def test_cuda_policy_step_matches_float32_within_bf16():
    run_on_ranks(_cuda_policy_on_cpu, 2)
