"""Where the ranks of a group sit (nodes of `node_size` ranks) and how blocks travel between them.

Ranks of the sequence-parallel group are numbered node-major: group rank g = node * L + local,
with L = node_size ranks per node and I = world / L nodes. The sequence layout (burst/layout.py)
is the same whatever the topology; only the path of the blocks changes. Every block goes only to
the ranks whose part of the plan needs it (burst/ring.py), and straight there:

    flat       one round of W steps: at step s rank r gets the block of rank r - s from its owner
               (without document masking, W - 1 blocks per rank per pass; each rank sends the
               W - L of them that other nodes need across).
    two-level  I rounds of L steps: in round o rank (n, l) works on the blocks of node n - o. Each
               arrives once per node, from its owner to its counterpart (n, l) on its own
               communicator, posted at the start of the previous round and needed only at the start
               of this one, so the slow hop hides behind a whole round (I - 1 crossings per rank per
               pass); inside the node every rank gets it from that holder.
    ulysses    an all-to-all over heads inside each node, then a flat round over the I nodes
               on node-sized blocks (see burst/ulysses.py).

A `Schedule` says, for both passes, whose block this rank works on at each step and which rank
holds it, so one loop (`burst.ring.circulate`) serves every topology.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from burst.comm import Links, Traffic
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


def cross_node_links(group: dist.ProcessGroup | None, node_size: int, members: list[int],
                     purpose: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The process groups that carry this rank's messages to other nodes, (to higher ranks, to lower
    ranks), over the group ranks `members` (this rank among them): communicators of their own, so the
    slow hops never queue behind inner traffic.

    gloo joins a pair of ranks by one TCP connection per process group, and one that carries bulk data
    both ways often ran at half the link's rate on the simulated cluster (0.55-0.57 MiB/s per direction
    in 7 of 11 tries at 10 Mbit/s, against 1.02-1.13 in every try with a connection per direction:
    benchmarks/link_directions.py). Blocks go to and come back from the same ranks, so on gloo each
    direction gets its own group. NCCL's connections are one-way already: one group serves both.
    """
    ranks = [global_rank(group, g) for g in members]
    upward = _subgroup(ranks, f"{purpose}, to higher ranks")
    if dist.get_backend(upward) != "gloo":
        return upward, upward
    return upward, _subgroup(ranks, f"{purpose}, to lower ranks")


@dataclass
class Schedule:
    """`rounds` rounds of `steps` steps over a world of rounds x steps positions, numbered node-major.

    At step s of round o this rank (position (n, l) = divmod(rank, steps)) works on the block of
    (n - o, l - s). Round o's blocks of node n - o come to node n once, each over `outer` from its
    owner to the rank with the same local index (its holder for the round), and within the round
    every rank gets each block straight from its holder in the node over `inner`: at step s the block
    of holder (n, l - s); it sends its own to (n, l + s). flat and ulysses: one round, every block
    straight from its owner.
    """

    rank: int
    rounds: int
    steps: int
    inner: Links
    outer: Links | None = None

    @property
    def traffic(self) -> Traffic:
        return self.inner.traffic

    @property
    def world_size(self) -> int:
        return self.rounds * self.steps

    def owner(self, round_: int, step: int) -> int:
        """Whose block this rank works on at `step` of `round_`."""
        node, local = divmod(self.rank, self.steps)
        return (node - round_) % self.rounds * self.steps + (local - step) % self.steps

    def holder(self, step: int) -> int:
        """The rank of this node that holds, in every round, the block this rank works on at `step`."""
        node, local = divmod(self.rank, self.steps)
        return node * self.steps + (local - step) % self.steps

    def host(self, step: int) -> int:
        """The rank of this node that works at `step` on the block this rank holds."""
        node, local = divmod(self.rank, self.steps)
        return node * self.steps + (local + step) % self.steps

    def counterpart(self, node_offset: int) -> int:
        """The rank with this rank's local index on the node `node_offset` nodes further on."""
        node, local = divmod(self.rank, self.steps)
        return (node + node_offset) % self.rounds * self.steps + local


def make_schedule(topology: str, group: dist.ProcessGroup | None, node_size: int, traffic: Traffic) -> Schedule:
    """The schedule of "flat" or "two-level" over `group` (ranks numbered in `group`)."""
    rank, world_size = group_rank_and_size(group)
    nodes = world_size // node_size

    def same(position: int) -> int:
        return position

    if topology == "flat" or nodes == 1 or node_size == 1:  # a two-level ring of one rank per node is flat
        cross = cross_node_links(group, node_size, list(range(world_size)), "cross-node") if nodes > 1 \
            else (None, None)
        return Schedule(rank, 1, world_size, Links(group, node_size, traffic, same, cross))
    members = list(range(rank % node_size, world_size, node_size))  # this rank's counterparts on every node
    outer = Links(group, node_size, traffic, same, cross_node_links(group, node_size, members, "cross-node"))
    return Schedule(rank, nodes, node_size, Links(group, node_size, traffic, same), outer)


def one_process_schedule(traffic: Traffic) -> Schedule:
    """A ring of this process alone (burst.local_attn): one step on its own block, no process group, no traffic."""
    return Schedule(0, 1, 1, Links(None, 1, traffic, lambda position: position))


def node_ring_schedule(group: dist.ProcessGroup | None, node_size: int, traffic: Traffic) -> Schedule:
    """Ulysses' ring: one rank per node (those with this rank's local index), positions = nodes."""
    rank, world_size = group_rank_and_size(group)
    nodes, local = world_size // node_size, rank % node_size

    def counterpart(node: int) -> int:
        return node * node_size + local

    if nodes == 1:  # a ring of one: no traffic
        return Schedule(0, 1, 1, Links(group, node_size, traffic, counterpart))
    members = [counterpart(n) for n in range(nodes)]
    return Schedule(rank // node_size, 1, nodes,
                    Links(group, node_size, traffic, counterpart, cross_node_links(group, node_size, members,
                                                                                   "cross-node")))
