"""`burst_attn`: exact attention over a sequence sharded across the ranks of a process group."""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from burst.comm import Traffic, gather_from_every_rank
from burst.cost import choose_backward, choose_topology
from burst.groups import group_rank_and_size
from burst.kernels import KERNEL_NAMES, default_scale, select_kernel
from burst.layout import LAYOUTS, Layout, check_layout, check_layout_windows, row_layouts, whole_sequence
from burst.plan import AttentionPlan, check_window, normalize_boundaries, normalize_sees, sees_by_row
from burst.ring import burst_backward, ring_backward, ring_forward
from burst.topology import (
    TOPOLOGIES,
    Schedule,
    default_node_size,
    make_schedule,
    node_group,
    node_ring_schedule,
    one_process_schedule,
    validate_topology,
)
from burst.ulysses import from_node, heads_per_rank, to_node

BACKWARD_MODES = ("auto", "burst", "ring")


def check_backward_mode(backward: str, name: str = "backward mode") -> None:
    """Refuse a backward mode that is not one of BACKWARD_MODES; `name` is what the caller calls the setting."""
    if backward not in BACKWARD_MODES:
        raise ValueError(f"unknown {name} {backward!r}; choose one of {', '.join(BACKWARD_MODES)}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str, seq: str = "seq") -> None:
    """Raise a ValueError naming what is wrong with q, k, v [batch, `seq`, heads, head_dim] or the kernel's name:
    the checks the ring and the one-process attention (burst/local.py) share."""
    if kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNEL_NAMES)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, {seq}, heads, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, {seq} and head_dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]}) "
                         "for grouped-query attention")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def validate_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int, backward: str,
                    kernel: str) -> None:
    """Raise a ValueError naming the problem; called before any communication.

    The ranks hold shards of the same shapes (`check_ranks_agree` makes sure of it), so a bad
    input fails on every rank at once and none is left waiting in a send.
    """
    check_backward_mode(backward)
    check_qkv(q, k, v, kernel, "local_seq")
    local = q.shape[1]
    if local == 0 or local % 2 != 0:
        raise ValueError(
            f"local sequence length {local} on each of {world_size} ranks: the global length {local * world_size} "
            f"must be a positive multiple of 2 x world size = {2 * world_size} (both layouts, zigzag and balanced, "
            f"are made of {2 * world_size} chunks); pad the sequence or change its length, and shard it with "
            f"burst.shard_sequence")


_DTYPE_CODES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _code(options: tuple, value) -> int:
    return options.index(value) if value in options else -1


def _shape(t: torch.Tensor) -> list[int]:
    """[ndim, four sizes padded with -1]: a fixed width whatever the tensor's rank."""
    return [t.dim(), *(list(t.shape) + [-1] * 4)[:4]]


# (name, number of ints, how to show them) for each part of `input_signature`
_SIGNATURE_FIELDS = (
    ("q shape", 5, lambda x: str(x[1:1 + x[0]])),
    ("k shape", 5, lambda x: str(x[1:1 + x[0]])),
    ("v shape", 5, lambda x: str(x[1:1 + x[0]])),
    ("dtypes", 3, lambda x: "/".join(str(_DTYPE_CODES[c]).removeprefix("torch.") if c >= 0 else "other" for c in x)),
    ("causal", 1, lambda x: str(bool(x[0]))),
    ("backward", 1, lambda x: BACKWARD_MODES[x[0]] if x[0] >= 0 else "unknown"),
    ("kernel", 1, lambda x: KERNEL_NAMES[x[0]] if x[0] >= 0 else "unknown"),
    ("doc_boundaries", 1, lambda x: "none" if x[0] == 0 else f"fingerprint {x[0] & 0xFFFFFF:06x}"),
    ("doc_sees", 1, lambda x: "none" if x[0] == 0 else f"fingerprint {x[0] & 0xFFFFFF:06x}"),
    ("topology", 1, lambda x: TOPOLOGIES[x[0]] if x[0] >= 0 else "unknown"),
    ("node_size", 1, lambda x: str(x[0])),
    ("layout", 1, lambda x: LAYOUTS[x[0]] if x[0] >= 0 else "unknown"),
    ("chosen layouts", 1, lambda x: "zigzag" if x[0] == 0 else f"fingerprint {x[0] & 0xFFFFFF:06x}"),
    ("window", 1, lambda x: "none" if x[0] == 0 else str(x[0])),
)


def _digest(value) -> int:
    """A non-zero int64 digest of repr(value), the same in every process (str hashes are not)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little") + 1


def input_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, backward: str, kernel: str,
                    doc_boundaries, topology: str = "flat", node_size=1, layout: str = "zigzag",
                    world_size: int = 1, doc_sees=None, window: int | None = None, layout_windows=None) -> list[int]:
    """What every rank of the group must agree on, as ints (see `_SIGNATURE_FIELDS`).

    Ranks that disagree would post ring messages of different sizes (a gloo error or an NCCL
    hang), or one rank would raise while the others wait for it; comparing these first turns
    all of that into the same ValueError on every rank. Works on invalid inputs too. The balanced
    layouts each rank chose are compared too: shards of the same size cut differently would give
    wrong results silently.
    """
    rows, sees, chosen = None, None, 0
    if doc_sees is not None:
        sees = doc_sees.tolist() if isinstance(doc_sees, torch.Tensor) else \
            [r.tolist() if isinstance(r, torch.Tensor) else list(r) for r in doc_sees]
    if doc_boundaries is not None:
        rows = doc_boundaries.tolist() if isinstance(doc_boundaries, torch.Tensor) else \
            [r.tolist() if isinstance(r, torch.Tensor) else list(r) for r in doc_boundaries]
        if layout == "balanced":
            try:
                chosen = _digest([(lay.chunk, lay.chunks) for lay in
                                  row_layouts(layout, rows, q.shape[1] * world_size, world_size, len(rows), sees,
                                              layout_windows)])
            except (ValueError, TypeError, IndexError):
                chosen = -1  # invalid inputs: validation says what is wrong, on every rank, once they agree
    return [*_shape(q), *_shape(k), *_shape(v), *(_code(_DTYPE_CODES, t.dtype) for t in (q, k, v)), int(causal),
            _code(BACKWARD_MODES, backward), _code(KERNEL_NAMES, kernel), 0 if rows is None else _digest(rows),
            0 if sees is None else _digest(sees),
            _code(TOPOLOGIES, topology), node_size if isinstance(node_size, int) else -1, _code(LAYOUTS, layout),
            chosen, window if isinstance(window, int) else 0]


def check_ranks_agree(group: dist.ProcessGroup | None, signature: list[int], device: torch.device,
                      traffic: Traffic, node_size: int) -> None:
    """Raise the same ValueError on every rank when the ranks' inputs disagree: one small
    all-gather before any ring traffic, so no rank is left waiting."""
    every = gather_from_every_rank(group, signature, device, traffic, node_size if isinstance(node_size, int) else 1)
    if all(theirs == every[0] for theirs in every):
        return
    differences, start = [], 0
    for name, width, show in _SIGNATURE_FIELDS:
        values = [sig[start:start + width] for sig in every]
        if any(x != values[0] for x in values):
            differences.append(f"{name}: " + ", ".join(f"rank {r} {show(x)}" for r, x in enumerate(values)))
        start += width
    raise ValueError(f"burst_attn got different inputs on the ranks of its group ({'; '.join(differences)}). "
                     "Every rank must pass its shard of the same global sequence (see burst.shard_sequence) with "
                     "the same shapes, dtypes, causal flag, backward mode, kernel, doc_boundaries, doc_sees, topology, "
                     "node_size, layout and window")


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


# burst_attn's ring is one registered operator, `torch.ops.burst.attention`, with its backward
# another: activation-checkpointing policies can save its output by name (the ring forward then
# never runs twice), and torch.compile traces a block around it as one opaque call, with no graph
# break. Operator arguments are tensors and plain values only: the process group travels by its
# name, the document boundaries as one int64 tensor (`boundaries_tensor`), the seen documents as
# another (`sees_tensor`); another setting is one more plain argument of both operators.


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name `torch.ops.burst.attention` takes for `group`; "" is the default group (or a world of one)."""
    return "" if group is None else group.group_name


def resolve_group(name: str) -> dist.ProcessGroup | None:
    return None if name == "" else _resolve_process_group(name)


# The group name of `burst.local_attn`: this process alone, whether or not torch.distributed is initialised
# (a real group's name is a number). Its sequence is one chunk of any length (`whole_sequence`), so the plan
# skips masked blocks as the ring's does, with no sharding and no process group.
ONE_PROCESS = "one process"


ROW_END = -1  # follows each row of document offsets in `boundaries_tensor`'s encoding


def boundaries_tensor(doc_boundaries) -> torch.Tensor | None:
    """doc_boundaries (a list of 1-D offsets per batch row, or a 2-D tensor) as one int64 tensor, each
    row followed by ROW_END. One flat tensor, not a padded 2-D one: a compiled graph then holds one
    symbolic length, with no guards on which row is the longest, whatever the documents per row."""
    if doc_boundaries is None:
        return None
    if isinstance(doc_boundaries, torch.Tensor) and doc_boundaries.dim() != 2:
        raise ValueError(f"doc_boundaries as a tensor must be 2-D [batch, offsets], got shape "
                         f"{tuple(doc_boundaries.shape)}; or pass a list of 1-D tensors, one per batch row")
    rows = [torch.as_tensor(row, dtype=torch.int64) for row in doc_boundaries]
    end = torch.tensor([ROW_END], dtype=torch.int64, device=rows[0].device if rows else None)
    return torch.cat([part for row in rows for part in (row, end)]) if rows else end[:0]


def boundary_rows(boundaries: torch.Tensor) -> list[list[int]]:
    """Inverse of `boundaries_tensor`: the rows as lists of ints."""
    rows, row = [], []
    for value in boundaries.tolist():
        if value == ROW_END:
            rows.append(row)
            row = []
        else:
            row.append(value)
    return rows


def sees_tensor(doc_sees) -> torch.Tensor | None:
    """doc_sees (a list of 1-D tensors per batch row, or a 2-D tensor) as one flat int64 tensor, the rows
    one after another: each row has one entry per document, so `sees_rows` cuts them by the boundaries."""
    if doc_sees is None:
        return None
    rows = [torch.as_tensor(row, dtype=torch.int64) for row in doc_sees]
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)


def sees_rows(doc_sees: torch.Tensor | None, boundaries: list[list[int]] | None) -> list[list[int]] | None:
    """Inverse of `sees_tensor`, checked against the rows' offsets (`normalize_sees`); None where no
    document sees another."""
    if doc_sees is None or boundaries is None:
        return normalize_sees(doc_sees, boundaries)  # None, or the error of sees without boundaries
    values, rows, start = doc_sees.tolist(), [], 0
    for offsets in boundaries:
        rows.append(values[start:start + len(offsets) - 1])
        start += len(offsets) - 1
    if start != len(values):
        raise ValueError(f"doc_sees holds {len(values)} entries for {start} documents; give one entry per document")
    return normalize_sees(rows, boundaries)


def sequence_layouts(doc_boundaries: torch.Tensor | None, batch: int, seq_len: int, world_size: int,
                     layout: str, doc_sees: torch.Tensor | None = None, layout_windows: list[int] | None = None
                     ) -> tuple[list[list[int]] | None, list[list[int]] | None, list[Layout]]:
    """(document offsets per batch row or None, seen documents per row or None, the layout of each row) for
    one call; boundaries and sees as `boundaries_tensor` and `sees_tensor` encode them, checked (ValueError),
    the layers' windows as `windows_list` does."""
    rows = None if doc_boundaries is None else normalize_boundaries(boundary_rows(doc_boundaries), batch, seq_len)
    sees = sees_rows(doc_sees, rows)
    windows = None if layout_windows is None else [w or None for w in layout_windows]
    return rows, sees, row_layouts(layout, rows, seq_len, world_size, batch, sees, windows)


def windows_list(layout_windows) -> list[int] | None:
    """The layers' windows (`burst_attn`'s layout_windows, checked) as the operators take them: ints, 0 for a
    causal layer; None when no layer has one."""
    windows = check_layout_windows(layout_windows)
    return None if windows is None else [w or 0 for w in windows]


def ring_and_plan(q: torch.Tensor, doc_boundaries: torch.Tensor | None, doc_sees: torch.Tensor | None, causal: bool,
                  group: str, topology: str, node_size: int, layout: str,
                  traffic: Traffic, window: int | None = None, layout_windows: list[int] | None = None
                  ) -> tuple[Schedule, AttentionPlan]:
    """The schedule and plan of one call of the operators: "flat" or "two-level" over the group, or
    "ulysses" for the ring across nodes that ulysses_attn runs on node-sized blocks (the layout
    grouped by node)."""
    if group == ONE_PROCESS:
        rows = None if doc_boundaries is None else \
            normalize_boundaries(boundary_rows(doc_boundaries), q.shape[0], q.shape[1])
        sees = sees_rows(doc_sees, rows)
        return one_process_schedule(traffic), shared_plan((whole_sequence(q.shape[1]),) * q.shape[0], causal,
                                                          None if rows is None else tuple(map(tuple, rows)),
                                                          None if sees is None else tuple(map(tuple, sees)), window)
    group_ = resolve_group(group)
    schedule = node_ring_schedule(group_, node_size, traffic) if topology == "ulysses" else \
        make_schedule(topology, group_, node_size, traffic)
    _, world_size = group_rank_and_size(group_)
    rows, sees, layouts = sequence_layouts(doc_boundaries, q.shape[0], q.shape[1] * schedule.world_size, world_size,
                                           layout, doc_sees, layout_windows)
    if topology == "ulysses":
        layouts = [lay.grouped(node_size) for lay in layouts]
    return schedule, shared_plan(tuple(layouts), causal, None if rows is None else tuple(map(tuple, rows)),
                                 None if sees is None else tuple(map(tuple, sees)), window)


@functools.lru_cache(maxsize=16)
def shared_plan(layouts: tuple[Layout, ...], causal: bool, boundaries: tuple[tuple[int, ...], ...] | None,
                sees: tuple[tuple[int, ...], ...] | None = None, window: int | None = None) -> AttentionPlan:
    """One plan for every call on the same sequences: a model's layers, forward and backward, reuse the
    segments and rows it has worked out (they cost milliseconds per call at 128K tokens)."""
    return AttentionPlan(list(layouts), causal, None if boundaries is None else [list(b) for b in boundaries],
                         None if sees is None else [list(s) for s in sees], window)


@torch.library.custom_op("burst::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_boundaries: torch.Tensor | None,
                 doc_sees: torch.Tensor | None, causal: bool, scale: float, group: str, topology: str, node_size: int,
                 backward: str, kernel: str, layout: str, window: int | None = None,
                 layout_windows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the ring; see `burst_attn`, which checks the arguments (group: a `group_name`)."""
    schedule, plan = ring_and_plan(q, doc_boundaries, doc_sees, causal, group, topology, node_size, layout,
                                   Traffic(fresh=False), window, layout_windows)
    q, k, v = kernel_layout(q), kernel_layout(k), kernel_layout(v)
    kernel_ = select_kernel(q.device, q.dtype, kernel, head_dim=q.shape[-1], groups=q.shape[2] // k.shape[2])
    with torch.autocast(q.device.type, enabled=False):  # the kernels choose their own precision
        return ring_forward(schedule, kernel_, plan, q, k, v, scale)


@attention_op.register_fake
def _(q, k, v, doc_boundaries, doc_sees, causal, scale, group, topology, node_size, backward, kernel, layout,
      window=None, layout_windows=None):
    batch, shard_len, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(batch, heads, shard_len, dtype=torch.float32)  # contiguous, as made


@torch.library.custom_op("burst::attention_backward", mutates_args=())
def attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, doc_boundaries: torch.Tensor | None, doc_sees: torch.Tensor | None,
                          causal: bool, scale: float,
                          group: str, topology: str, node_size: int, backward: str,
                          kernel: str, layout: str, window: int | None = None,
                          layout_windows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `torch.ops.burst.attention`."""
    traffic = Traffic(fresh=False)
    traffic.enter_backward(fresh=topology != "ulysses")  # ulysses' exchange back from the node came first
    schedule, plan = ring_and_plan(q, doc_boundaries, doc_sees, causal, group, topology, node_size, layout, traffic,
                                   window, layout_windows)
    # the layout the forward computed in (on CPU a copy: the saved inputs are the caller's)
    q, k, v, dout = kernel_layout(q), kernel_layout(k), kernel_layout(v), kernel_layout(dout)
    kernel_ = select_kernel(q.device, q.dtype, kernel, head_dim=q.shape[-1], groups=q.shape[2] // k.shape[2])
    run = burst_backward if choose_backward(q, k, backward) == "burst" else ring_backward
    with torch.autocast(q.device.type, enabled=False):
        return run(schedule, kernel_, plan, dout.to(q.dtype), q, k, v, out, lse, scale)


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, doc_boundaries, doc_sees, causal, scale, group, topology, node_size, backward, kernel,
      layout, window=None, layout_windows=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as made


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, doc_boundaries, doc_sees, *ctx.settings = inputs
    ctx.save_for_backward(q, k, v, *output, doc_boundaries, doc_sees)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, doc_boundaries, doc_sees = ctx.saved_tensors
    dq, dk, dv = torch.ops.burst.attention_backward(dout, q, k, v, out, lse, doc_boundaries, doc_sees,
                                                    *ctx.settings)
    return dq, dk, dv, *[None] * (len(ctx.settings) + 2)


attention_op.register_autograd(_backward, setup_context=_setup_context)


def burst_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
               group: dist.ProcessGroup | None = None, softmax_scale: float | None = None,
               backward: str = "auto", kernel: str = "auto", doc_boundaries=None,
               return_lse: bool = False, topology: str = "auto", node_size: int | None = None,
               check_ranks: bool = True, layout: str = "zigzag",
               doc_sees=None, window: int | None = None,
               layout_windows=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention of this rank's queries against the whole sharded sequence.

    q [batch, local_seq, q_heads, head_dim]; k, v [batch, local_seq, kv_heads, head_dim], each
    rank passing its shard as laid out by `burst.shard_sequence` (with the same `layout`). Returns the local output
    [batch, local_seq, q_heads, head_dim] in q's dtype, and with `return_lse` also the float32
    log-sum-exp [batch, q_heads, local_seq] of every query row (not differentiable).

    group: the sequence-parallel process group (None: the default group; without
    torch.distributed initialised, a world of one). backward: "burst" (the query side
    travels), "ring" (keys and values travel) or "auto" (whichever sends fewer bytes).
    kernel: the local attention kernel, see `burst.kernels.select_kernel`.
    doc_boundaries: for packed sequences, the cumulative document offsets of each batch row
    over the global sequence (a list of 1-D tensors, e.g. [0, 100, 350, seq_len], as the
    loader returns them; or a 2-D tensor). A query then sees only keys of its own document
    (causally when `causal`), and fully masked blocks are skipped, not computed nor sent.
    doc_sees: with doc_boundaries, per batch row an int64 tensor [n_docs]: doc_sees[row][i] = j
    (0 <= j < i) lets document i's queries also see every key of document j (prefix sharing:
    two answers that see their prompt), -1 only their own document; None: -1 everywhere. Seen
    documents are computed as full rectangles; only the rows that a rank's calls touch travel.
    window: a sliding window W (with causal): the query at global position i sees keys j with
    i - W < j <= i only, within its document (a seen document counts as lying just before the
    document that sees it); None: all earlier keys. Blocks outside every window are neither computed
    nor sent (burst/plan.py). layout_windows: with layout "balanced", the sliding window of every layer of
    the model (None for a causal one), so that the layout, one for all layers, balances their work; pass
    the same to `burst.shard_sequence` (the data loader's cut).
    layout: how the sequence is cut into the ranks' shards (burst/layout.py): "zigzag", or
    "balanced", chosen per batch row from its doc_boundaries (required) so that every rank does the
    same work; the offsets stay over the global sequence in its original order.
    topology: how blocks travel between nodes (see burst/topology.py): "flat" (one ring),
    "two-level" (a ring inside each node, one hop per round to the next node), "ulysses"
    (all-to-all over heads inside a node, ring across nodes) or "auto" (flat on one node, else
    whichever sends fewer bytes across nodes, see `burst.cost`). node_size: ranks of the group
    per node, numbered node-major (None: from LOCAL_WORLD_SIZE, else the whole group).

    Raises ValueError, on every rank of the group, for bad inputs and for ranks whose inputs
    disagree. check_ranks: compare the ranks' inputs in one small all-gather before any ring
    traffic (a blocking collective and a host read per call). Pass False where the ranks are
    known to agree, as the trainer does between its periodic checks (`BurstAttention.check_ranks`);
    every rank must pass the same value. Without it, disagreeing ranks may fail alone or hang.
    """
    _, world_size = group_rank_and_size(group)
    node_size = default_node_size(group) if node_size is None else node_size
    traffic = Traffic()
    if check_ranks:
        check_ranks_agree(group, input_signature(q, k, v, causal, backward, kernel, doc_boundaries, topology,
                                                 node_size, layout, world_size, doc_sees, window, layout_windows),
                                                 q.device,
                          traffic, node_size)
    validate_inputs(q, k, v, world_size, backward, kernel)  # the same verdict on every rank now
    validate_topology(topology, node_size, world_size)
    check_layout(layout)
    check_window(window, causal)
    windows = windows_list(layout_windows)
    if layout == "balanced" and doc_boundaries is None:
        raise ValueError("layout 'balanced' is chosen from the documents' boundaries: pass doc_boundaries (one row "
                         "of cumulative offsets per batch row), or use layout 'zigzag'")
    topology = choose_topology(topology, q, k, backward, node_size, world_size)
    boundaries = boundaries_tensor(doc_boundaries)  # checked by the operator
    if doc_sees is not None:  # its shapes now; its values where the boundaries' are checked, in the operator
        sees_by_row(doc_sees, None if doc_boundaries is None else [len(row) - 1 for row in doc_boundaries])
    sees = sees_tensor(doc_sees)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    if topology == "ulysses":
        return ulysses_attn(q, k, v, group, node_size, causal, boundaries, sees, scale, backward, kernel, layout,
                            traffic, return_lse, window, windows)
    out, lse = torch.ops.burst.attention(q, k, v, boundaries, sees, causal, scale, group_name(group), topology,
                                         node_size, backward, kernel, layout, window, windows)
    return (out, lse) if return_lse else out


def ulysses_attn(q, k, v, group, node_size: int, causal: bool, boundaries, sees, scale: float, backward: str,
                 kernel: str, layout: str, traffic: Traffic, return_lse: bool, window: int | None = None,
                 layout_windows: list[int] | None = None):
    """burst_attn's "ulysses" topology: heads exchanged inside the node (burst/ulysses.py), the
    ring over the I nodes on node-sized blocks [b, L x C, heads / L, d], and back."""
    q_heads, kv_heads = heads_per_rank(q.shape[2], k.shape[2], node_size)  # raises before any traffic
    rank, world_size = group_rank_and_size(group)
    _, _, layouts = sequence_layouts(boundaries, q.shape[0], q.shape[1] * world_size, world_size, layout, sees,
                                     layout_windows)
    orders = [lay.group_order(node_size, rank // node_size) for lay in
              (layouts[:1] if all(lay == layouts[0] for lay in layouts) else layouts)]
    order = torch.stack(orders).to(q.device)  # [b or 1, L x C]
    heads_group = node_group(group, node_size) if node_size > 1 else None
    node_q = to_node(q, q_heads, heads_group, traffic, order)
    node_k, node_v = (to_node(x, kv_heads, heads_group, traffic, order) for x in (k, v))
    out, lse = torch.ops.burst.attention(node_q, node_k, node_v, boundaries, sees, causal, scale, group_name(group),
                                         "ulysses", node_size, backward, kernel, layout, window, layout_windows)
    out = from_node(out, node_size, heads_group, traffic, order)
    if not return_lse:
        return out
    lse = from_node(lse.transpose(1, 2).unsqueeze(-1), node_size, heads_group, traffic, order)  # [b, C, q_heads, 1]
    return out, lse.squeeze(-1).transpose(1, 2)
