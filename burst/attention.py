"""`burst_attn`: exact attention over a sequence sharded across the ranks of a process group.

The public wrapper: it checks its arguments (burst/checks.py), makes the documents one `Documents` value
(burst/documents.py) and calls the ring's registered operator (burst/operator.py); the "ulysses" topology
exchanges heads inside the node around it (burst/ulysses.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from burst.checks import check_ranks_agree, input_signature, validate_inputs
from burst.comm import Traffic
from burst.cost import choose_topology
from burst.documents import Documents, documents_of
from burst.groups import group_rank_and_size
from burst.kernels import default_scale
from burst.layout import check_layout, check_layout_windows, zigzag_layout
from burst.operator import group_name
from burst.plan import check_window
from burst.topology import default_node_size, node_group, validate_topology
from burst.ulysses import from_node, heads_per_rank, to_node


def burst_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
               group: dist.ProcessGroup | None = None, softmax_scale: float | None = None,
               backward: str = "auto", kernel: str = "auto", doc_boundaries=None,
               return_lse: bool = False, topology: str = "auto", node_size: int | None = None,
               check_ranks: bool = True, layout: str = "zigzag", doc_sees=None, window: int | None = None,
               layout_windows=None, documents: Documents | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
    over the global sequence (a list of 1-D tensors, e.g. [0, 100, 350, seq_len]; or a 2-D tensor;
    or a `burst.Documents`, as `documents` below). A query then sees only keys of its own document
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
    the same to `burst.shard_sequence` (the data loader's cut), or to `Documents.of`.
    layout: how the sequence is cut into the ranks' shards (burst/layout.py): "zigzag", or
    "balanced", chosen per batch row from its doc_boundaries (required) so that every rank does the
    same work; the offsets stay over the global sequence in its original order.
    documents: instead of doc_boundaries and doc_sees, the `burst.Documents` value they make (as the data
    loader does), its layout chosen once when it was made: `Documents.of(offsets, global_seq_len,
    world_size, layout, sees)`. It must be made for this call's rows, length, world size and layout.
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
    # what the call was given as a Documents value (the model's BurstAttention passes one as doc_boundaries), which
    # the ranks compare even when it does not fit the call
    given = documents if documents is not None else doc_boundaries if isinstance(doc_boundaries, Documents) else None
    problem = None
    if documents is not None and (doc_boundaries is not None or doc_sees is not None):
        problem = ValueError("pass either documents (a burst.Documents) or doc_boundaries and doc_sees, not both")
    else:
        try:  # checked here, refused below: first every rank learns that they all got the same
            documents = documents_of(documents if documents is not None else doc_boundaries, doc_sees,
                                     q.shape[1] * world_size, world_size, layout, q.shape[0], layout_windows)
        except (ValueError, TypeError, IndexError) as error:
            problem = error
    if check_ranks:
        signed = documents if problem is None else given if given is not None else (doc_boundaries, doc_sees)
        check_ranks_agree(group, input_signature(q, k, v, causal, backward, kernel, signed, topology, node_size,
                                                 layout, window), q.device, traffic, node_size)
    validate_inputs(q, k, v, world_size, backward, kernel)  # the same verdict on every rank now
    validate_topology(topology, node_size, world_size)
    check_layout(layout)
    check_window(window, causal)
    check_layout_windows(layout_windows)
    if problem is not None:
        raise problem
    topology = choose_topology(topology, q, k, backward, node_size, world_size)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    if topology == "ulysses":
        return ulysses_attn(q, k, v, group, node_size, causal, documents, scale, backward, kernel, traffic,
                            return_lse, window)
    out, lse = torch.ops.burst.attention(q, k, v, None if documents is None else documents.encoded, causal, scale,
                                         group_name(group), topology, node_size, backward, kernel, window)
    return (out, lse) if return_lse else out


def ulysses_attn(q, k, v, group, node_size: int, causal: bool, documents: Documents | None, scale: float,
                 backward: str, kernel: str, traffic: Traffic, return_lse: bool, window: int | None = None):
    """burst_attn's "ulysses" topology: heads exchanged inside the node (burst/ulysses.py), the
    ring over the I nodes on node-sized blocks [b, L x C, heads / L, d], and back."""
    q_heads, kv_heads = heads_per_rank(q.shape[2], k.shape[2], node_size)  # raises before any traffic
    rank, world_size = group_rank_and_size(group)
    layouts = documents.layouts if documents is not None else [zigzag_layout(q.shape[1] * world_size, world_size)]
    orders = [lay.group_order(node_size, rank // node_size) for lay in
              (layouts[:1] if all(lay == layouts[0] for lay in layouts) else layouts)]
    order = torch.stack(orders).to(q.device)  # [b or 1, L x C]
    heads_group = node_group(group, node_size) if node_size > 1 else None
    node_q = to_node(q, q_heads, heads_group, traffic, order)
    node_k, node_v = (to_node(x, kv_heads, heads_group, traffic, order) for x in (k, v))
    out, lse = torch.ops.burst.attention(node_q, node_k, node_v, None if documents is None else documents.encoded,
                                         causal, scale, group_name(group), "ulysses", node_size, backward, kernel,
                                         window)
    out = from_node(out, node_size, heads_group, traffic, order)
    if not return_lse:
        return out
    lse = from_node(lse.transpose(1, 2).unsqueeze(-1), node_size, heads_group, traffic, order)  # [b, C, q_heads, 1]
    return out, lse.squeeze(-1).transpose(1, 2)
