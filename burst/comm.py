"""Point-to-point links and the few collectives of the library, and the count of bytes sent.

All point-to-point traffic goes through `Ring.exchange`, which posts every send and receive
of one step as one batch (`batch_isend_irecv`) and returns at once, so the caller computes
on the current block while the next one is in flight (double buffering: the tensors being
sent and the fresh receive buffers are distinct). Every rank posts the same sequence of
batches, so messages between a pair of ranks match in order on gloo and NCCL alike. A ring
may run on its own process group (`channel`): the two-level ring sends across nodes on one,
so that a slow inter-node transfer never queues behind the fast inner-ring traffic (on CUDA,
NCCL gives each communicator its own stream). A ring may also receive on another process
group than it sends on (`receive_channel`): between two nodes, where the next and the previous
rank are the same, gloo's one TCP connection per pair would otherwise carry bulk data both
ways (see `burst.topology.cross_node_ring`).

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
    """Transfers posted by `Ring.exchange`; `wait()` returns the received tensors."""

    works: list = field(default_factory=list)
    received: list[torch.Tensor] = field(default_factory=list)
    sending: list[torch.Tensor] = field(default_factory=list)  # kept alive until the sends complete

    def wait(self) -> list[torch.Tensor]:
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


class Ring:
    """This rank's link in a ring of ranks of `group`: it sends to `next_rank` and receives from
    `prev_rank` (ranks of `group`), over `channel` (a process group holding both; `group` by
    default), receiving over `receive_channel` when given. Ranks are numbered node-major,
    `node_size` to a node, which says whether the sends leave the node."""

    def __init__(self, group: dist.ProcessGroup | None, next_rank: int, prev_rank: int, node_size: int,
                 traffic: Traffic, channel: dist.ProcessGroup | None = None,
                 receive_channel: dist.ProcessGroup | None = None) -> None:
        rank, _ = group_rank_and_size(group)
        self.channel = group if channel is None else channel
        self.receive_channel = self.channel if receive_channel is None else receive_channel
        self.next, self.prev = global_rank(group, next_rank), global_rank(group, prev_rank)
        self.leaves_node = next_rank // node_size != rank // node_size
        self.traffic = traffic

    def exchange(self, outgoing: list[torch.Tensor], incoming_like: list[torch.Tensor],
                 incoming_dtypes: list[torch.dtype] | None = None) -> Pending:
        """Post sends of `outgoing` to the next rank and receives shaped like `incoming_like`
        (with `incoming_dtypes` when given) from the previous one; returns without waiting."""
        if not outgoing and not incoming_like:
            return Pending()
        dtypes = incoming_dtypes or [t.dtype for t in incoming_like]
        received = [torch.empty_like(t, dtype=dt) for t, dt in zip(incoming_like, dtypes, strict=True)]  # same strides
        sending = [wire_view(t) for t in outgoing]
        # look the functions up now, not at import: the benchmark harness wraps them to count bytes
        sends = [dist.P2POp(dist.isend, t, self.next, self.channel) for t in sending]
        receives = [dist.P2POp(dist.irecv, wire_view(t), self.prev, self.receive_channel) for t in received]
        # one batch per process group (batch_isend_irecv takes one); on NCCL each is one grouped launch
        batches = [sends + receives] if self.receive_channel is self.channel else [sends, receives]
        sent = nbytes(sending)
        self.traffic.count(sent, sent if self.leaves_node else 0)
        return Pending([work for ops in batches if ops for work in dist.batch_isend_irecv(ops)], received, sending)


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
