"""Where the ranks of a group sit (nodes of `node_size` ranks) and how blocks travel between them.

Ranks of the sequence-parallel group are numbered node-major: group rank g = node * L + local,
with L = node_size ranks per node and I = world / L nodes. The sequence layout is the same
zigzag over the whole group whatever the topology; only the path of the blocks changes:

    flat       one ring over all W ranks (W - 1 blocks cross each node boundary per pass,
               all through the node's last rank).
    two-level  I rounds of L steps: in round o rank (n, l) works on the blocks of node n - o,
               which circulate the inner ring of its node; each rank passes a block to its
               counterpart (n + 1, l) once per round, on its own communicator, posted at the
               start of the round and needed only at the start of the next, so the slow hop
               hides behind L - 1 inner steps (I - 1 crossings per rank per pass).
    ulysses    an all-to-all over heads inside each node, then a flat ring over the I nodes
               on node-sized blocks (see burst/ulysses.py).

A `Schedule` says, for both passes, whose block this rank holds at each step and where blocks
go next, so one loop (`burst.ring.circulate`) serves every topology.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from burst.comm import Ring, Traffic
from burst.groups import global_rank, group_rank_and_size

TOPOLOGIES = ("auto", "flat", "two-level", "ulysses")


def default_node_size(group: dist.ProcessGroup | None) -> int:
    """Ranks of `group` per node: counted from the launcher's LOCAL_WORLD_SIZE (global rank //
    LOCAL_WORLD_SIZE is a rank's node, as torchrun numbers them); without it, the whole group."""
    rank, world_size = group_rank_and_size(group)
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    if not local_world or world_size == 1:
        return world_size
    nodes = [global_rank(group, g) // int(local_world) for g in range(world_size)]
    node_size = nodes.count(nodes[rank])
    if nodes != sorted(nodes) or any(nodes.count(n) != node_size for n in nodes):
        raise ValueError(f"the group's ranks sit on nodes {nodes} (global rank // LOCAL_WORLD_SIZE): burst_attn needs "
                         "them node-major with as many ranks on every node; build the group from consecutive ranks, "
                         "or pass node_size (and topology='flat') explicitly")
    return node_size


def check_topology(topology: str, name: str = "topology") -> None:
    """Refuse a topology that is not one of TOPOLOGIES; `name` is what the caller calls the setting."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown {name} {topology!r}; choose one of {', '.join(TOPOLOGIES)}")


def validate_topology(topology: str, node_size, world_size: int) -> None:
    """Raise a ValueError naming the problem; the ranks agree on these (`check_ranks_agree`)."""
    check_topology(topology)
    if not isinstance(node_size, int) or node_size < 1 or world_size % node_size != 0:
        raise ValueError(f"node_size {node_size!r} must be a positive divisor of the group's {world_size} ranks "
                         "(the ranks of one node, numbered node-major: group rank = node x node_size + local rank); "
                         "pass node_size=None to read it from LOCAL_WORLD_SIZE")


_GROUPS: dict[tuple[tuple[int, ...], str], dist.ProcessGroup] = {}


def _subgroup(ranks: list[int], purpose: str = "") -> dist.ProcessGroup:
    """The process group of these global ranks for `purpose`, created once. Only the members call
    `new_group` (use_local_synchronization), and each rank creates its node group before its
    cross-node groups, so every rank follows one global creation order."""
    key = (tuple(ranks), purpose)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key[0]), use_local_synchronization=True)
    return _GROUPS[key]


def node_group(group: dist.ProcessGroup | None, node_size: int) -> dist.ProcessGroup:
    """The ranks of this rank's node (for Ulysses' all-to-all)."""
    rank, _ = group_rank_and_size(group)
    first = rank - rank % node_size
    return _subgroup([global_rank(group, g) for g in range(first, first + node_size)])


def cross_node_ring(group: dist.ProcessGroup | None, node_size: int, traffic: Traffic) -> Ring:
    """This rank's link to the ranks with its local index on the next and previous nodes, on
    communicators of its own: the slow hops never queue behind inner-ring traffic.

    Between two nodes the next and the previous rank are the same. gloo joins a pair of ranks by
    one TCP connection, and one that carries bulk data both ways often ran at half the link's rate
    on the simulated cluster (0.55-0.57 MiB/s per direction in 7 of 11 tries at 10 Mbit/s, against
    1.02-1.13 in every try with a connection per direction: benchmarks/link_directions.py). So each
    direction gets its own process group there: node 0 sends on the first, node 1 on the second.
    NCCL's connections are one-way already.
    """
    rank, world_size = group_rank_and_size(group)
    nodes = world_size // node_size
    members = [global_rank(group, g) for g in range(rank % node_size, world_size, node_size)]
    channel = receive_channel = _subgroup(members, "cross-node")
    if nodes == 2 and dist.get_backend(channel) == "gloo":
        other_direction = _subgroup(members, "cross-node, second direction")
        channel, receive_channel = (channel, other_direction) if rank < node_size else (other_direction, channel)
    return Ring(group, (rank + node_size) % world_size, (rank - node_size) % world_size, node_size, traffic,
                channel=channel, receive_channel=receive_channel)


@dataclass
class Schedule:
    """`rounds` rounds of `steps` steps over a world of rounds x steps block owners.

    At step s of round o this rank (position (n, l) = divmod(rank, steps)) holds the block of
    (n - o, l - s). Within a round blocks pass along `inner` (to (n, l + 1)); the first block
    of the next round comes over `outer` (from (n - 1, l)). flat and ulysses: one round.
    """

    rank: int
    rounds: int
    steps: int
    inner: Ring
    outer: Ring | None = None

    @property
    def traffic(self) -> Traffic:
        return self.inner.traffic

    @property
    def world_size(self) -> int:
        return self.rounds * self.steps

    def owner(self, round_: int, step: int) -> int:
        node, local = divmod(self.rank, self.steps)
        return (node - round_) % self.rounds * self.steps + (local - step) % self.steps


def make_schedule(topology: str, group: dist.ProcessGroup | None, node_size: int, traffic: Traffic) -> Schedule:
    """The schedule of "flat" or "two-level" over `group` (ranks numbered in `group`)."""
    rank, world_size = group_rank_and_size(group)
    nodes = world_size // node_size
    if node_size == 1 and nodes > 1:  # a rank per node: every hop leaves the node
        return Schedule(rank, 1, world_size, cross_node_ring(group, node_size, traffic))
    if topology == "flat" or nodes == 1:
        return Schedule(rank, 1, world_size,
                        Ring(group, (rank + 1) % world_size, (rank - 1) % world_size, node_size, traffic))
    node, local = divmod(rank, node_size)
    inner = Ring(group, node * node_size + (local + 1) % node_size, node * node_size + (local - 1) % node_size,
                 node_size, traffic)
    return Schedule(rank, nodes, node_size, inner, cross_node_ring(group, node_size, traffic))


def node_ring_schedule(group: dist.ProcessGroup | None, node_size: int, traffic: Traffic) -> Schedule:
    """Ulysses' ring: one rank per node (those with this rank's local index), positions = nodes."""
    rank, world_size = group_rank_and_size(group)
    nodes = world_size // node_size
    if nodes == 1:  # a ring of one: no traffic
        return Schedule(0, 1, 1, Ring(group, rank, rank, node_size, traffic))
    return Schedule(rank // node_size, 1, nodes, cross_node_ring(group, node_size, traffic))
