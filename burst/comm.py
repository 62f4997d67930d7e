"""Point-to-point links and the few collectives of the library, and the count of bytes sent.

All point-to-point traffic goes through `Links.exchange`, which posts every send and receive
of one step as one batch per process group (`batch_isend_irecv`) and returns at once, so the
caller computes on the current block while the next one is in flight (double buffering: the
tensors being sent and the fresh receive buffers are distinct). Both ends of every message post
it from the same plan, at the same step and in the same order, so messages between a pair of
ranks match in order on gloo and NCCL alike. Sends that leave the node travel on process groups
of their own (see `Links`).

On CUDA, NCCL runs the transfers on its own stream and `Pending.wait()` makes the current
stream wait on an event: there is no device-wide or host synchronisation in the loop.

Bytes sent are counted here, the one place they leave the rank: see `SENT` and `Traffic`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from burst.groups import global_rank, group_rank_and_size


@dataclass
class SentBytes:
    """Bytes this rank sent: cumulative, and in the last forward and backward call; `inter_node`
    counts the part addressed to ranks on other nodes."""

    total: int = 0
    inter_node: int = 0
    last_forward: int = 0
    last_backward: int = 0
    last_forward_inter_node: int = 0
    last_backward_inter_node: int = 0

    def reset(self) -> None:
        self.total = self.inter_node = 0
        self.last_forward = self.last_backward = self.last_forward_inter_node = self.last_backward_inter_node = 0


SENT = SentBytes()


class Traffic:
    """The bytes of one `burst_attn` call, added to `SENT` as they leave: first its forward's,
    then, from the first call of `enter_backward`, its backward's."""

    def __init__(self, fresh: bool = True) -> None:
        """fresh: a new call, its forward counts start from 0; False: more of a call already counted
        (the attention operators count into the call that `burst_attn` started)."""
        self.backward = False
        if fresh:
            SENT.last_forward = SENT.last_forward_inter_node = 0

    def enter_backward(self, fresh: bool = True) -> None:
        if not self.backward:
            self.backward = True
            if fresh:
                SENT.last_backward = SENT.last_backward_inter_node = 0

    def count(self, sent: int, inter_node: int) -> None:
        SENT.total += sent
        SENT.inter_node += inter_node
        if self.backward:
            SENT.last_backward += sent
            SENT.last_backward_inter_node += inter_node
        else:
            SENT.last_forward += sent
            SENT.last_forward_inter_node += inter_node


@dataclass
class Pending:
    """Transfers posted by `Links.exchange`; `wait()` returns the received tensors, per receive posted."""

    works: list = field(default_factory=list)
    received: list[list[torch.Tensor]] = field(default_factory=list)  # per receive posted, its tensors
    sending: list[torch.Tensor] = field(default_factory=list)  # kept alive until the sends complete

    def wait(self) -> list[list[torch.Tensor]]:
        for work in self.works:
            work.wait()
        return self.received


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous view of `t`'s memory (no copy) for the library's two layouts: sequence-major,
    and heads-first storage seen through a sequence-major view; anything else is copied."""
    if t.is_contiguous():
        return t
    if t.dim() == 4 and t.transpose(1, 2).is_contiguous():
        return t.transpose(1, 2)
    return t.contiguous()


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Links:
    """This rank's point-to-point links to the other positions of one level of a schedule.

    Positions are numbered 0..P-1; `rank_of(position)` is the rank of `group` at that position (the
    group rank itself for a flat or two-level schedule, the rank with this rank's local index on
    node `position` for Ulysses' ring across nodes). Ranks of `group` are numbered node-major,
    `node_size` to a node, which says whether a send leaves the node.

    Inside a node everything travels on `group`. Across nodes it travels on `cross`, process groups
    of its own (so a slow transfer never queues behind inner traffic; on CUDA, NCCL gives each
    communicator its own stream): (to higher ranks, to lower ranks). gloo joins a pair of ranks by
    one TCP connection per process group, and one that carries bulk data both ways often ran at half
    the link's rate (burst.topology.cross_node_links), so on gloo each direction has its own group.
    """

    def __init__(self, group: dist.ProcessGroup | None, node_size: int, traffic: Traffic, rank_of,
                 cross: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None)) -> None:
        self.group, self.node_size, self.traffic, self.rank_of, self.cross = group, node_size, traffic, rank_of, cross
        self.me, _ = group_rank_and_size(group)

    def leaves_node(self, peer: int) -> bool:
        return peer // self.node_size != self.me // self.node_size

    def _channel(self, peer: int, sending: bool) -> dist.ProcessGroup | None:
        """The process group a message to (sending) or from `peer` (a group rank) travels on."""
        if not self.leaves_node(peer) or self.cross[0] is None:
            return self.group
        upward = peer > self.me if sending else peer < self.me
        return self.cross[0] if upward else self.cross[1]

    def exchange(self, sends: list[tuple[int, list[torch.Tensor]]],
                 receives: list[tuple[int, list[torch.Tensor], list[torch.dtype]]]) -> Pending:
        """Post sends of tensors to positions and receives shaped like `like` (with `dtypes`) from
        positions, in the order given; return without waiting. Both ends of every message compute the
        same lists from the same plan, so the messages between two ranks pair up in order."""
        ops: dict[dist.ProcessGroup | None, list[dist.P2POp]] = {}
        received, sending = [], []
        for position, tensors in sends:
            peer = self.rank_of(position)
            channel = self._channel(peer, sending=True)
            views = [wire_view(t) for t in tensors]
            # look the functions up now, not at import: the benchmark harness wraps them to count bytes
            ops.setdefault(channel, []).extend(dist.P2POp(dist.isend, t, global_rank(self.group, peer), channel)
                                               for t in views)
            sent = nbytes(views)
            self.traffic.count(sent, sent if self.leaves_node(peer) else 0)
            sending += views
        for position, like, dtypes in receives:
            peer = self.rank_of(position)
            channel = self._channel(peer, sending=False)
            buffers = [torch.empty_like(t, dtype=dt) for t, dt in zip(like, dtypes, strict=True)]  # same strides
            ops.setdefault(channel, []).extend(dist.P2POp(dist.irecv, wire_view(t), global_rank(self.group, peer),
                                                          channel) for t in buffers)
            received.append(buffers)
        # one batch per process group (batch_isend_irecv takes one); on NCCL each is one grouped launch
        works = [work for batch in ops.values() for work in dist.batch_isend_irecv(batch)]
        return Pending(works, received, sending)


def gather_from_every_rank(group: dist.ProcessGroup | None, values: list[int], device: torch.device,
                           traffic: Traffic, node_size: int) -> list[list[int]]:
    """Every rank's `values` (int64s, the same count on each), in rank order, on every rank.

    One small all-gather, blocking: used to check that the ranks agree before ring traffic
    whose message sizes depend on what each rank was given.
    """
    _, world_size = group_rank_and_size(group)
    if world_size == 1:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    # what a ring all-gather sends; the part addressed to the ranks on other nodes counts as inter-node
    traffic.count((world_size - 1) * nbytes([mine]), (world_size - min(node_size, world_size)) * nbytes([mine]))
    return torch.stack(every).tolist()


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, traffic: Traffic) -> torch.Tensor:
    """x [ranks of `group`, ...]: slice j goes to rank j; returns [ranks, ...] with slice j from rank j.

    `group` is the ranks of one node (Ulysses' head exchange), so nothing counts as inter-node.
    """
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    traffic.count(nbytes([x]) * (x.shape[0] - 1) // x.shape[0], 0)
    return out
