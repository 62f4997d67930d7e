"""Ring communication: each step sends tensors to the next rank and receives from the previous.

All point-to-point traffic of the library goes through `Ring.exchange`, which posts every send
and receive of one step as one batch (`batch_isend_irecv`) and returns at once, so the caller
computes on the current block while the next one is in flight (double buffering: the tensors
being sent and the fresh receive buffers are distinct). Every rank posts the same sequence
of batches, so messages between a pair of ranks match in order on gloo and NCCL alike.

On CUDA, NCCL runs the transfers on its own stream and `Pending.wait()` makes the current
stream wait on an event: there is no device-wide or host synchronisation in the loop.

Bytes sent are counted here, the one place they leave the rank: see `SENT`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from burst.groups import global_rank, group_rank_and_size


@dataclass
class SentBytes:
    """Bytes this rank sent: cumulative, and in the last forward and backward call."""

    total: int = 0
    last_forward: int = 0
    last_backward: int = 0

    def reset(self) -> None:
        self.total = self.last_forward = self.last_backward = 0


SENT = SentBytes()


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


class Ring:
    """The ring of ranks of `group`: rank r sends to r + 1 and receives from r - 1 (mod W)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank, self.world_size = group_rank_and_size(group)
        self.next = global_rank(group, (self.rank + 1) % self.world_size)
        self.prev = global_rank(group, (self.rank - 1) % self.world_size)
        self.bytes_sent = 0

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
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sending]
        ops += [dist.P2POp(dist.irecv, wire_view(t), self.prev, self.group) for t in received]
        sent = sum(t.numel() * t.element_size() for t in sending)
        self.bytes_sent += sent
        SENT.total += sent
        return Pending(dist.batch_isend_irecv(ops), received, sending)

    def gather_from_every_rank(self, values: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's `values` (int64s, the same count on each), in rank order, on every rank.

        One small all-gather, blocking: used to check that the ranks agree before ring traffic
        whose message sizes depend on what each rank was given.
        """
        if self.world_size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        sent = (self.world_size - 1) * mine.numel() * mine.element_size()  # what a ring all-gather sends
        self.bytes_sent += sent
        SENT.total += sent
        return torch.stack(every).tolist()
