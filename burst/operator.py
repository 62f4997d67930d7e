"""The ring as one registered operator, `torch.ops.burst.attention`, with its backward another.

Activation-checkpointing policies can save its output by name (the ring forward then never runs twice),
and torch.compile traces a block around it as one opaque call, with no graph break. Operator arguments are
tensors and plain values only: the process group travels by its name, the documents as their encoding
(`Documents.encoded`, burst/documents.py, decoded here); another setting is one more plain argument of
both operators. The public wrappers, which check the arguments first, are burst/attention.py
(`burst_attn`) and burst/local.py (`local_attn`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from burst.comm import Traffic
from burst.cost import choose_backward
from burst.documents import Documents
from burst.groups import group_rank_and_size
from burst.kernels import select_kernel
from burst.layout import Layout, whole_sequence, zigzag_layout
from burst.plan import AttentionPlan
from burst.ring import burst_backward, ring_backward, ring_forward
from burst.topology import Schedule, make_schedule, node_ring_schedule, one_process_schedule
from burst.varlen import takes_window


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[b, s, h, d] with heads-first memory ([b, h, s, d] contiguous), seen sequence-major.

    PyTorch's CPU flash kernels run 5-10% faster on heads-first memory; indexing stays
    sequence-major everywhere, and `comm.wire_view` sends such tensors without a copy.
    """
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """x in the memory the kernels get: heads-first on CPU; elsewhere as given, unless its last
    dimension is strided (the CUDA kernels need it contiguous, see burst/kernels/)."""
    if x.device.type == "cpu":
        return heads_first(x)
    return x if x.stride(-1) == 1 else x.contiguous()


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name `torch.ops.burst.attention` takes for `group`; "" is the default group (or a world of one)."""
    return "" if group is None else group.group_name


def resolve_group(name: str) -> dist.ProcessGroup | None:
    return None if name == "" else _resolve_process_group(name)


# The group name of `burst.local_attn`: this process alone, whether or not torch.distributed is initialised
# (a real group's name is a number). Its sequence is one chunk of any length (`whole_sequence`), so the plan
# skips masked blocks as the ring's does, with no sharding and no process group.
ONE_PROCESS = "one process"


def ring_and_plan(q: torch.Tensor, encoded: torch.Tensor | None, causal: bool, group: str, topology: str,
                  node_size: int, traffic: Traffic, window: int | None = None,
                  whole_bands: bool = True) -> tuple[Schedule, AttentionPlan]:
    """The schedule and plan of one call of the operators: "flat" or "two-level" over the group, or
    "ulysses" for the ring across nodes that ulysses_attn runs on node-sized blocks (the layout
    grouped by node). The layouts are the documents' own, chosen when they were made; zigzag without them.
    whole_bands: whether the kernel takes a sliding window natively (`burst.varlen.takes_window`)."""
    documents = None if encoded is None else Documents.decode(encoded)
    if group == ONE_PROCESS:
        schedule, layouts = one_process_schedule(traffic), (whole_sequence(q.shape[1]),) * q.shape[0]
    else:
        group_ = resolve_group(group)
        schedule = node_ring_schedule(group_, node_size, traffic) if topology == "ulysses" else \
            make_schedule(topology, group_, node_size, traffic)
        _, world_size = group_rank_and_size(group_)
        layouts = documents.layouts if documents is not None else \
            (zigzag_layout(q.shape[1] * schedule.world_size, world_size),) * q.shape[0]
        if topology == "ulysses":
            layouts = tuple(lay.grouped(node_size) for lay in layouts)
    return schedule, shared_plan(tuple(layouts), causal, None if documents is None else documents.offsets,
                                 None if documents is None else documents.sees, window, whole_bands)


@functools.lru_cache(maxsize=16)
def shared_plan(layouts: tuple[Layout, ...], causal: bool, boundaries: tuple[tuple[int, ...], ...] | None,
                sees: tuple[tuple[int, ...], ...] | None = None, window: int | None = None,
                whole_bands: bool = True) -> AttentionPlan:
    """One plan for every call on the same sequences: a model's layers, forward and backward, reuse the
    segments and rows it has worked out (they cost milliseconds per call at 128K tokens)."""
    return AttentionPlan(list(layouts), causal, None if boundaries is None else [list(b) for b in boundaries],
                         None if sees is None else [list(s) for s in sees], window, whole_bands)


@torch.library.custom_op("burst::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None, causal: bool,
                 scale: float, group: str, topology: str, node_size: int, backward: str, kernel: str,
                 window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the ring; see `burst_attn`, which checks the arguments (group: a `group_name`; documents:
    `Documents.encoded`, or None)."""
    kernel_ = select_kernel(q.device, q.dtype, kernel, head_dim=q.shape[-1], groups=q.shape[2] // k.shape[2])
    schedule, plan = ring_and_plan(q, documents, causal, group, topology, node_size, Traffic(fresh=False), window,
                                   takes_window(kernel_))
    q, k, v = kernel_layout(q), kernel_layout(k), kernel_layout(v)
    with torch.autocast(q.device.type, enabled=False):  # the kernels choose their own precision
        return ring_forward(schedule, kernel_, plan, q, k, v, scale)


@attention_op.register_fake
def _(q, k, v, documents, causal, scale, group, topology, node_size, backward, kernel, window=None):
    batch, shard_len, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(batch, heads, shard_len, dtype=torch.float32)  # contiguous, as made


@torch.library.custom_op("burst::attention_backward", mutates_args=())
def attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, documents: torch.Tensor | None, causal: bool, scale: float, group: str,
                          topology: str, node_size: int, backward: str, kernel: str,
                          window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `torch.ops.burst.attention`."""
    traffic = Traffic(fresh=False)
    traffic.enter_backward(fresh=topology != "ulysses")  # ulysses' exchange back from the node came first
    kernel_ = select_kernel(q.device, q.dtype, kernel, head_dim=q.shape[-1], groups=q.shape[2] // k.shape[2])
    schedule, plan = ring_and_plan(q, documents, causal, group, topology, node_size, traffic, window,
                                   takes_window(kernel_))
    # the layout the forward computed in (on CPU a copy: the saved inputs are the caller's)
    q, k, v, dout = kernel_layout(q), kernel_layout(k), kernel_layout(v), kernel_layout(dout)
    run = burst_backward if choose_backward(q, k, backward) == "burst" else ring_backward
    with torch.autocast(q.device.type, enabled=False):
        return run(schedule, kernel_, plan, dout.to(q.dtype), q, k, v, out, lse, scale)


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, documents, causal, scale, group, topology, node_size, backward, kernel,
      window=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as made


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, documents, *ctx.settings = inputs
    ctx.save_for_backward(q, k, v, *output, documents)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, documents = ctx.saved_tensors
    dq, dk, dv = torch.ops.burst.attention_backward(dout, q, k, v, out, lse, documents, *ctx.settings)
    return dq, dk, dv, *[None] * (len(ctx.settings) + 1)


attention_op.register_autograd(_backward, setup_context=_setup_context)
