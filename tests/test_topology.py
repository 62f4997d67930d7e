"""burst_attn's topologies (flat, two-level, ulysses, auto) on simulated nodes of localhost gloo
ranks, against the float64 reference, with the bytes sent across nodes checked against
`burst.cost.inter_node_bytes`."""

import itertools

import pytest
import torch
import torch.distributed as dist

import burst
from burst.attention import input_signature
from burst.cost import choose_topology, inter_node_bytes, node_blocks, plan_bytes
from burst.layout import row_layouts
from burst.plan import AttentionPlan
from tests.distributed import run_on_ranks
from tests.test_burst_attn import TOLERANCE, make_inputs
from tests.test_doc_mask import reference

CHUNK = 6  # tokens per zigzag chunk: a sequence of 2W chunks


def head_cases(node_size):
    """MHA, GQA whose kv heads split over a node, GQA where each rank of a node needs one kv head."""
    q_heads = 2 * node_size
    return [(q_heads, q_heads), (q_heads, node_size), (q_heads, 1)]


def documents(seq):
    return [[0, 5, CHUNK + 1, seq // 2 + 3, seq], [0, seq - CHUNK - 2, seq]]


def check_case(world_size, node_size, topology, causal, heads, mode, docs, layout="zigzag", boundaries=None):
    seq = 2 * world_size * CHUNK if boundaries is None else boundaries[0][-1]
    q, k, v, dout = make_inputs(seq, *heads, torch.float32, seed=world_size + node_size, head_dim=8)
    if boundaries is None:
        boundaries = documents(seq) if docs else [[0, seq]] * 2
    expected = reference(q, k, v, dout, boundaries, causal)
    doc_boundaries = [torch.tensor(b) for b in boundaries] if docs else None
    cut = {"layout": layout, "doc_boundaries": doc_boundaries}
    lq, lk, lv = (burst.shard_sequence(t, **cut).requires_grad_() for t in (q, k, v))
    out, lse = burst.burst_attn(lq, lk, lv, causal=causal, backward=mode, topology=topology, node_size=node_size,
                                doc_boundaries=doc_boundaries, return_lse=True, layout=layout)
    forward = (burst.SENT.last_forward, burst.SENT.last_forward_inter_node)
    out.backward(burst.shard_sequence(dout, **cut))
    backward = (burst.SENT.last_backward, burst.SENT.last_backward_inter_node)
    got = [burst.gather_sequence(out.detach(), **cut), burst.gather_sequence(lse, dim=2, **cut)]
    got += [burst.gather_sequence(t.grad, **cut) for t in (lq, lk, lv)]
    where = f"({world_size // node_size} nodes x {node_size}, {topology}, {causal=}, {heads=}, {mode}, {docs=}, " \
            f"{layout})"
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        err = (g.double() - e).abs().max().item()
        assert err <= TOLERANCE[torch.float32], f"{name}: max error {err:.2e} {where}"
    if not docs and not causal:
        check_bytes(world_size, node_size, topology, lq, lk, mode, forward, backward, where)
    check_planned_bytes(world_size, node_size, topology, lq, lk, mode, boundaries if docs else None, causal, layout,
                        forward, backward, where)


def check_bytes(world_size, node_size, topology, q, k, mode, forward, backward, where):
    """Unmasked (no causal mask, no documents): inter-node bytes of this rank as the formulas say; flat and
    two-level send W - 1 blocks in all."""
    rank = dist.get_rank()
    resolved = choose_topology(topology, q, k, mode, node_size, world_size)
    fwd, bwd = inter_node_bytes(resolved, q, k, mode, node_size, world_size, rank)
    signature = len(input_signature(q, k, k, True, mode, "auto", None)) * 8  # the agreement all-gather, per rank
    assert forward[1] == fwd + (world_size - node_size) * signature, f"forward inter-node bytes {where}"
    assert backward[1] == bwd, f"backward inter-node bytes {where}"
    if resolved != "ulysses":
        assert forward[0] == (world_size - 1) * (2 * k.numel() * k.element_size() + signature), where
        hop = burst.cost.backward_bytes_per_hop(q, k, burst.choose_backward(q, k, mode))
        assert backward[0] == (world_size - 1) * hop, where


def check_planned_bytes(world_size, node_size, topology, q, k, mode, boundaries, causal, layout, forward, backward,
                        where):
    """Exactly the rows of the blocks the plan needs (`burst.cost.plan_bytes`), all of them when unmasked."""
    rank = dist.get_rank()
    resolved = choose_topology(topology, q, k, mode, node_size, world_size)
    layouts = row_layouts(layout, boundaries, q.shape[1] * world_size, world_size, q.shape[0])
    if resolved == "ulysses":
        layouts = [lay.grouped(node_size) for lay in layouts]
        q, k = node_blocks(q, k, node_size)
    planned = plan_bytes(AttentionPlan(layouts, causal, boundaries), resolved, q, k, mode, node_size, rank)
    signature = len(input_signature(q, k, k, True, mode, "auto", None)) * 8
    assert forward[1] == planned[1] + (world_size - node_size) * signature, f"forward inter-node bytes {where}"
    assert backward[1] == planned[3], f"backward inter-node bytes {where}"
    if resolved != "ulysses":  # whose all-to-all inside the node comes on top
        assert forward[0] == planned[0] + (world_size - 1) * signature, f"forward bytes {where}"
        assert backward[0] == planned[2], f"backward bytes {where}"


def _all_cases(rank, world_size, node_sizes):
    for node_size in node_sizes:
        for topology, causal, heads, mode in itertools.product(("flat", "two-level", "ulysses", "auto"), (True, False),
                                                               head_cases(node_size), ("burst", "ring")):
            check_case(world_size, node_size, topology, causal, heads, mode, docs=causal == (mode == "burst"))


@pytest.mark.parametrize("world_size, node_sizes", [(4, (2, 4)), (6, (3, 2))], ids=["2x2,1x4", "2x3,3x2"])
def test_topologies_match_float64_reference(world_size, node_sizes):
    run_on_ranks(_all_cases, world_size, args=(node_sizes,), timeout_s=300)


def bad_topology_inputs(rank):
    """(q heads, kv heads, kwargs, expected message) on a world of 4."""
    return [
        (4, 4, {"node_size": 3}, "node_size 3 must be a positive divisor of the group's 4 ranks"),
        (4, 4, {"node_size": 0}, "positive divisor"),
        (4, 4, {"topology": "mesh"}, "unknown topology 'mesh'"),
        (6, 6, {"topology": "ulysses", "node_size": 4}, "splits the 6 query heads over the 4 ranks"),
        (12, 3, {"topology": "ulysses", "node_size": 2}, "equal shares of 12 query and 3 key/value heads"),
        (4, 4, {"node_size": 2 if rank else 4}, "different inputs on the ranks.*node_size: rank 0 4, rank 1 2"),
        (4, 4, {"topology": "flat" if rank else "ulysses"}, "topology: rank 0 ulysses, rank 1 flat"),
    ]


def _bad_inputs_raise(rank, world_size):
    for q_heads, kv_heads, kwargs, message in bad_topology_inputs(rank):
        q, k = torch.zeros(1, 8, q_heads, 8), torch.zeros(1, 8, kv_heads, 8)
        with pytest.raises(ValueError, match=message):
            burst.burst_attn(q, k, k, **kwargs)
    dist.barrier()  # every rank raised and none is stuck in a send


def test_bad_topology_inputs_raise_on_every_rank():
    run_on_ranks(_bad_inputs_raise, 4, timeout_s=60)


def test_auto_picks_the_topology_that_sends_least_across_nodes():
    def pick(q_heads, kv_heads, node_size, world_size=8):
        q, k = torch.empty(1, 64, q_heads, 64, dtype=torch.bfloat16), torch.empty(1, 64, kv_heads, 64,
                                                                                   dtype=torch.bfloat16)
        return choose_topology("auto", q, k, "auto", node_size, world_size)

    assert pick(8, 8, 8) == "flat"  # one node
    assert pick(8, 8, 4) == "ulysses"  # the same bytes across nodes as two-level; fewer inside the node
    assert pick(8, 1, 4) == "two-level"  # ulysses would send each rank's kv head L times over
    assert pick(6, 6, 4) == "two-level"  # the heads do not split over a node
    q, k = torch.empty(1, 64, 8, 64), torch.empty(1, 64, 8, 64)
    flat = [inter_node_bytes("flat", q, k, "burst", 4, 8, r) for r in range(8)]
    two_level = [inter_node_bytes("two-level", q, k, "burst", 4, 8, r) for r in range(8)]
    # 2 x 4: two-level sends each block once to the other node (8 crossings), flat to each of its 4 ranks (32)
    assert sum(map(sum, two_level)) * 4 == sum(map(sum, flat))


def _record_sends(rank, world_size, node_size, topology):
    """Every (process group, sender, receiver) of one forward and backward, gathered from all ranks."""
    sends = []
    post = dist.batch_isend_irecv

    def recording(ops):
        sends.extend((op.group.group_name, rank, op.peer) for op in ops if op.op is dist.isend)
        return post(ops)

    dist.batch_isend_irecv = recording
    try:
        q, k, v, dout = (burst.shard_sequence(t).requires_grad_() for t in make_inputs(8 * world_size, 4, 4,
                                                                                         torch.float32, seed=0))
        burst.burst_attn(q, k, v, causal=True, topology=topology, node_size=node_size).backward(dout.detach())
    finally:
        dist.batch_isend_irecv = post
    every = [None] * world_size
    dist.all_gather_object(every, sends)
    return [send for rank_sends in every for send in rank_sends]


def _cross_node_connections_carry_one_direction(rank, world_size):
    cases = [(1, "flat"), (1, "two-level")] + ([(2, "two-level"), (2, "ulysses")] if world_size == 4 else [])
    for node_size, topology in cases:
        sends = _record_sends(rank, world_size, node_size, topology)
        directions = {}
        for group_name, sender, receiver in sends:
            if sender // node_size != receiver // node_size:
                directions.setdefault((group_name, frozenset((sender, receiver))), set()).add((sender, receiver))
        assert directions, f"no cross-node sends recorded ({node_size=}, {topology})"
        both_ways = {key: ways for key, ways in directions.items() if len(ways) > 1}
        assert not both_ways, f"connections carrying data both ways ({node_size=}, {topology}): {both_ways}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_cross_node_connections_carry_one_direction(world_size):
    """Between two nodes each rank's next and previous rank are the same; a gloo connection that
    carries bulk data both ways runs at half rate, so each direction has its own process group."""
    run_on_ranks(_cross_node_connections_carry_one_direction, world_size, timeout_s=120)
