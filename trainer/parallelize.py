"""Parallelism applied to the model from outside, in one documented order (torchtitan's):

0. LoRA (--lora-rank): the targeted linear layers get adapters and everything else is frozen (models/lora.py),
   in the run's compute precision: with bf16 the frozen weights keep no float32 copy (`keep_frozen_in_bf16`);
1. sequence parallelism: every block's `attention.core_attention` becomes a `burst.BurstAttention`
   over the mesh's "cp" dimension (when cp > 1), cutting sequences by the
   layout the data loader cuts them with (`TrainConfig.sequence_layout`); the model code never knows;
   the MLP computes over slices of --mlp-tile tokens (trainer/memory.py);
2. activation checkpointing: each block is wrapped to recompute its activations in backward
   ("full"), or all of them but attention's output ("selective": the ring forward, the costliest
   part of a long-context block, never runs twice); it wraps the blocks before FSDP so that FSDP's
   per-block units see the recomputation; with --offload-activations the input each block keeps for
   its recomputation waits in host memory (trainer/memory.py);
3. compilation (--compile): each block, checkpoint wrapper included, becomes `torch.compile`d;
   attention is one opaque operator (`torch.ops.burst.attention`) in its graph, document tensors
   are dynamic in length (`mark_documents_dynamic`), so the first step compiles and no later one does
   (docs/one-process-attention.md);
4. FSDP2: `fully_shard` on every block, then on the root, over the flattened dp x cp mesh (when
   world > 1), frozen and trainable weights alike (only the trainable ones get gradients to reduce).
   Parameters, gradients and optimizer state are sharded over all ranks: cp ranks hold
   the same weights, so they share the sharding with the dp ranks. With bf16 on CUDA, parameters are
   gathered and used in bf16 over float32 master weights (see `mixed_precision_policy`).

`build_model` goes meta -> parallelize -> materialise -> fill each rank's shard: no rank ever holds
the whole model. Fresh weights are drawn row-range by row-range (models/init.py) and checkpoints are
read slice by slice (safetensors), so the same seed or checkpoint gives the same weights whatever the
cp x dp layout. A resumed run fills nothing here: the training checkpoint's load writes every shard.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import burst
from burst.documents import Documents
from models import ModelConfig, Transformer
from models.convert import Checkpoint, read_checkpoint, read_peft
from models.init import initial_rows
from models.lora import Adapter, apply_lora, initial_adapter_rows, is_adapter
from trainer.config import TrainConfig
from trainer.memory import offloading_checkpoint, tile_feed_forward


def parallelize(model: Transformer, mesh: DeviceMesh | None, config: TrainConfig,
                device_type: str | None = None) -> Transformer:
    """Apply BurstAttention, activation checkpointing and FSDP2 to `model` in place (see the module docstring).

    mesh: the ("dp", "cp") DeviceMesh, or None for a single process (checkpointing and compilation apply).
    device_type: where the model will run ("cpu", "cuda"), which decides the frozen weights' dtype; by default the
    mesh's, or the CPU without one.
    """
    if config.lora.enabled:
        apply_lora(model, config.lora)
        if config.precision == "bf16":
            keep_frozen_in_bf16(model, device_type or (mesh.device_type if mesh is not None else "cpu"))
    if mesh is not None and mesh["cp"].size() > 1:
        # At cp = 1 the model's own LocalAttention is burst's attention at a world of one (burst.local_attn):
        # the same plan and kernels, masked blocks skipped, with no process group and no ranks to compare.
        cp_group = mesh["cp"].get_group()
        for block in model.layers:
            block.attention.core_attention = burst.BurstAttention(group=cp_group, backward=config.attention_backward,
                                                                      kernel=config.attention_kernel,
                                                                      topology=config.cp_topology,
                                                                      layout=config.sequence_layout,
                                                                      layout_windows=model.config.windows)
    else:
        for block in model.layers:
            block.attention.core_attention.kernel = config.attention_kernel

    if config.mlp_tile:
        for block in model.layers:
            tile_feed_forward(block.feed_forward, config.mlp_tile)

    if config.activation_checkpointing != "none":
        options = checkpoint_options(config.activation_checkpointing)
        if config.offload_activations:
            options = {"checkpoint_fn": offloading_checkpoint(options)}
        for index, block in enumerate(model.layers):
            model.layers[index] = checkpoint_wrapper(block, **options)

    if config.compile:
        for block in model.layers:
            block.compile()  # in place: parameter names, and so checkpoints, stay as they are

    if mesh is not None and mesh.size() > 1:
        shard_mesh = mesh["dp", "cp"]._flatten("dp_cp")  # 1-D mesh of every rank (torchtitan does the same)
        policy = mixed_precision_policy(config, shard_mesh.device_type)
        for block in model.layers:
            fully_shard(block, mesh=shard_mesh, mp_policy=policy)
        fully_shard(model, mesh=shard_mesh, mp_policy=policy)
        # Training calls model.loss, not forward: FSDP must gather the root's weights around it too.
        register_fsdp_forward_method(model, "loss")
        register_fsdp_forward_method(model, "answer_logps")  # preference objectives
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # The loss is already divided by the global token count, so each rank's gradient is its
                # share of the true gradient: sum the shares (FSDP would average them over the ranks).
                # Forcing SUM reductions keeps it to ops gloo and NCCL both have (no PREMUL_SUM).
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    return model


def mark_documents_dynamic(config: TrainConfig, documents: Documents | None) -> None:
    """Under --compile, let the documents' operator encoding (`Documents.encoded`) vary in length: the documents
    of a row change from batch to batch, and one graph serves any count instead of a recompile per count."""
    if config.compile and documents is not None:
        torch._dynamo.maybe_mark_dynamic(documents.encoded, 0)


def end_forward_only(model: torch.nn.Module) -> None:
    """Call after forward passes without backward (under no_grad) on a model `parallelize` sharded: FSDP2 clears
    its per-iteration state only in backward, and left over it corrupts the gradients of a later step (measured at
    cp 2: the second training step after a no_grad pass held part of the first step's gradient, its norm 3e-4
    relative off); `reset_iter_state` clears it. A no-op on an unsharded model."""
    if isinstance(model, FSDPModule):
        model.reset_iter_state()


def keep_frozen_in_bf16(model: Transformer, device_type: str) -> None:
    """Keep a bf16 run's frozen (LoRA) weights in bf16: they never update, so a float32 copy only costs memory.

    On CUDA every frozen parameter: FSDP2's policy gathers and uses them all in bf16 (`mixed_precision_policy`).
    On a CPU, where bf16 is autocast over float32 weights, the frozen linear layers' weights and biases inside
    the blocks only: autocast rounds exactly these to bf16 (to nearest, as this cast does) before every use, so
    every value the run computes is the same, while the embeddings, the norms and the LM head, which compute in
    float32 there, stay float32. SmolLM2-135M: 202 MiB less at the peak, half its block weights (docs/lora.md)."""
    for module_name, module in model.named_modules():
        linear_in_block = isinstance(module, torch.nn.Linear) and module_name.startswith("layers.")
        for param in module.parameters(recurse=False):
            if not param.requires_grad and (device_type == "cuda" or linear_in_block):
                param.data = param.data.to(torch.bfloat16)


def mixed_precision_policy(config: TrainConfig, device_type: str) -> MixedPrecisionPolicy:
    """FSDP2's casting for `config.precision` on `device_type` (torchtitan's choice for bf16 on GPUs).

    bf16 on CUDA: parameters are all-gathered and used in bf16 (half the bytes of float32), gradients
    reduce-scattered in float32 into the float32 sharded master weights the optimizer updates. The LM
    head then runs in bf16 too, with a float32 log-sum-exp (models/loss.py). Otherwise no casting:
    fp32 as it is, and bf16 on CPU as bf16 autocast over float32 parameters (trainer/step.py), which
    keeps gloo's collectives and the CPU loss in float32. Autocast stays on under the CUDA policy too,
    where it only keeps its float32 ops (softmax, norms) in float32.
    """
    if config.precision == "bf16" and device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


# Attention outputs that selective checkpointing keeps: burst's operator, which BurstAttention (the ring) and
# LocalAttention (one process, burst.local_attn) both call. Its backward needs the output and its
# log-sum-exp, which the operator returns.
SAVED_OPS = {torch.ops.burst.attention.default}


def keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: save attention's output, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_options(mode: str) -> dict:
    """checkpoint_wrapper's keyword arguments for --activation-checkpointing `mode` ("full" or "selective")."""
    if mode == "full":
        return {}
    return {"context_fn": functools.partial(create_selective_checkpoint_contexts, keep_attention)}


def model_name(name: str) -> str:
    """The Transformer's own name of a parameter of the parallelized model (without wrapper prefixes)."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, range]:
    """The part of `param` this rank holds, and the rows (dim 0) of the whole parameter it covers.

    FSDP2 shards every parameter along dim 0 (Shard(0) over the flattened mesh); a rank past the end
    of a parameter with fewer rows than ranks holds no rows.
    """
    if not isinstance(param, DTensor):
        return param, range(param.shape[0])
    local = param.to_local()
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(local.shape[1:]) != tuple(param.shape[1:]):
        raise NotImplementedError(f"a parameter sharded beyond dim 0 ({param.placements}) cannot be filled by rows")
    return local, range(offset[0], offset[0] + local.shape[0])


@torch.no_grad()
def fill_initial_weights(model: Transformer, seed: int, checkpoint: Checkpoint | None,
                         adapter: Adapter | None = None) -> None:
    """Write this rank's rows of every parameter: the checkpoint's (read alone), or fresh ones from `seed`; LoRA's
    adapters (and the embeddings and norms it trains) from `adapter` (--init-adapter), else fresh (B zero)."""
    for name, param in model.named_parameters():
        name = model_name(name)
        local, rows = local_rows(param)
        if adapter is not None and name in adapter.tensors:
            values = adapter.tensors[name][rows.start:rows.stop]
        elif is_adapter(name):
            values = initial_adapter_rows(name, tuple(param.shape), seed, rows)
        elif checkpoint is not None:
            values = checkpoint.rows(name, rows)
        else:
            values = initial_rows(model.config, name, tuple(param.shape), seed, rows)
        local.copy_(values)  # [len(rows), *shape[1:]], cast to the parameter's dtype on `device`


def build_model(model_config: ModelConfig, mesh: DeviceMesh | None, config: TrainConfig, device: torch.device,
                checkpoint: Path | None = None, fill: bool = True) -> Transformer:
    """The parallelized model on `device` holding its initial weights (float32 master weights): those of
    `checkpoint` (native or Hugging Face), or drawn from config.seed; left empty with fill=False (to resume)."""
    with torch.device("meta"):
        model = Transformer(model_config)
    parallelize(model, mesh, config, device.type)
    model.to_empty(device=device)
    if fill:
        fill_initial_weights(model, config.seed, read_checkpoint(checkpoint) if checkpoint is not None else None,
                             read_peft(Path(config.init_adapter), model_config) if config.init_adapter else None)
    return model

