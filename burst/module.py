"""`BurstAttention`: the drop-in module a model's attention calls once it is parallelized.

It has the forward signature of `models.LocalAttention` (q [b, s, hq, d], k/v [b, s, hkv, d],
causal), so the parallelize step swaps one for the other and the model never knows. Its documents are
the `burst.Documents` the data loader made, whose layout (zigzag, or balanced: chosen once, when the loader
cut the shards) the attention uses as it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from burst.attention import burst_attn
from burst.checks import check_backward_mode
from burst.layout import check_layout, check_layout_windows
from burst.topology import check_topology


class BurstAttention(nn.Module):
    def __init__(self, group: dist.ProcessGroup | None = None, backward: str = "auto", kernel: str = "auto",
                 topology: str = "auto", node_size: int | None = None, layout: str = "zigzag",
                 layout_windows=None):
        super().__init__()
        check_backward_mode(backward)
        check_topology(topology)
        check_layout(layout)
        self.group, self.backward, self.kernel = group, backward, kernel
        self.topology, self.node_size, self.layout = topology, node_size, layout
        # the model's layers' windows (burst_attn's layout_windows): the balanced layout weighs all of their work
        self.layout_windows = check_layout_windows(layout_windows)
        # Compare the ranks' inputs on every call (burst_attn's check_ranks): a blocking all-gather and
        # a host read each. A trainer whose ranks agree by construction turns it off between the steps it
        # checks (`set_rank_checks`), choosing them from a step count every rank shares.
        self.check_ranks = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_boundaries=None,
                doc_sees=None, window: int | None = None) -> torch.Tensor:
        """window: the calling layer's sliding window (burst_attn's), or None."""
        return burst_attn(q, k, v, causal=True, group=self.group, backward=self.backward, kernel=self.kernel,
                          doc_boundaries=doc_boundaries, topology=self.topology, node_size=self.node_size,
                          check_ranks=self.check_ranks, layout=self.layout, doc_sees=doc_sees, window=window,
                          layout_windows=self.layout_windows)

    def extra_repr(self) -> str:
        return (f"backward={self.backward!r}, kernel={self.kernel!r}, topology={self.topology!r}, "
                f"layout={self.layout!r}, check_ranks={self.check_ranks}")


def set_rank_checks(model: nn.Module, enabled: bool) -> None:
    """Turn the ranks' agreement check on or off in every `BurstAttention` of `model`; every rank of
    a group must pass the same `enabled` (a rank that checks alone waits for the others forever)."""
    for module in model.modules():
        if isinstance(module, BurstAttention):
            module.check_ranks = enabled
