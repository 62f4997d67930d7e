"""All rectangles of one ring step in as few kernel calls as the kernel allows.

A step of the ring computes a list of blocks: row slices of a query shard against row slices of a
key shard, one per document (or prefix-shared prompt) the plan found visible (burst/plan.py). A
kernel call costs tens of microseconds of launch and Python on a GPU, whatever its size, so a 131K
sequence of short documents would cost hundreds of calls per step and layer. A varlen kernel takes
them all in one call: the rectangles' rows are packed one after another into [total, heads, dim]
tensors, with cumulative offsets cu_seqlens_q / cu_seqlens_k (int32 [n + 1]) and the longest
rectangle's lengths max_q / max_k; its log-sum-exp comes back [heads, total_q] and is cut back into
burst's [b, h, s] per block. Causal and unmasked rectangles go in separate calls (one flag per call;
causal ones are square, where the kernels' bottom-right alignment is burst's top-left).

A block masked by a band (a sliding window, burst/plan.py) has a tuple (lo, hi) for its causal flag; it goes
alone to the kernel's `forward_band` / `backward_band`. A kernel whose band path passed its self-check
(`use_band`, set by choice.py) takes the window natively (`takes_window`): the plan gives it one band block
per visible rectangle, of any size. Any other kernel gets the band in strips, and the math kernel computes
the strips' small band blocks (burst/kernels/contract.py).

Kernels with `forward_varlen` / `backward_varlen` (burst/kernels/cuda.py, flash_attn.py) use it only
once choice.py has checked their varlen path against the math kernel (`use_varlen`); everything else,
the CPU kernel included (per-rectangle calls are fastest there), gets one call per block.

    forward_varlen(q [Tq, hq, d], k [Tk, hk, d], v, cu_q, cu_k, max_q, max_k, causal, scale)
        -> (out [Tq, hq, d], lse [hq, Tq] float32)
    backward_varlen(dout, q, k, v, out, lse [hq, Tq], cu_q, cu_k, max_q, max_k, causal, scale) -> (dq, dk, dv)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from burst.kernels.contract import AttentionKernel
from burst.kernels.math import MathKernel

ForwardBlock = tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]  # q, k, v [nb, len, h, d], causal or band
BackwardBlock = tuple[torch.Tensor, ...]  # dout, q, k, v, out [nb, len, h, d], lse [nb, h, len], then causal or band


@dataclass(frozen=True)
class Offsets:
    """Where each rectangle's rows lie in the packed tensors."""

    cu_seqlens_q: torch.Tensor  # int32 [n + 1]
    cu_seqlens_k: torch.Tensor  # int32 [n + 1]
    max_q: int
    max_k: int

    @staticmethod
    def of(q_lengths: list[int], k_lengths: list[int], device: torch.device) -> Offsets:
        def cumulative(lengths: list[int]) -> torch.Tensor:
            return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

        return Offsets(cumulative(q_lengths), cumulative(k_lengths), max(q_lengths), max(k_lengths))


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[nb, len, h, d] blocks -> [sum of nb x len, h, d], batch row after batch row, block after block."""
    return torch.cat([t.reshape(-1, *t.shape[2:]) for t in tensors])


def unpack(packed: torch.Tensor, like: list[torch.Tensor], dim: int = 0) -> list[torch.Tensor]:
    """Inverse of `pack` along `dim` (0 for [T, h, d]; 1 for an lse [h, T], returned as [nb, h, len])."""
    sizes = [t.shape[0] * t.shape[1] for t in like]
    parts = packed.split(sizes, dim=dim)
    if dim == 0:
        return [p.view(t.shape[0], t.shape[1], *p.shape[1:]) for p, t in zip(parts, like, strict=True)]
    return [p.view(p.shape[0], t.shape[0], t.shape[1]).transpose(0, 1) for p, t in zip(parts, like, strict=True)]


def _lengths(blocks: list[torch.Tensor]) -> list[int]:
    return [t.shape[1] for t in blocks for _ in range(t.shape[0])]


def uses_varlen(kernel: AttentionKernel) -> bool:
    """Whether the ring packs `kernel`'s blocks into varlen calls: its `use_varlen`, part of its interface, set once
    when choice.py built it (after its varlen self-check); a kernel without a varlen path has none."""
    return getattr(kernel, "use_varlen", False)


def _varlen_groups(varlen: bool, causal_flags: list) -> list[list[int]]:
    """Indices of the blocks to pack together: per causal flag, with `varlen` (packing saves a call); otherwise
    (and for every band) one group per block."""
    if not varlen:
        return [[i] for i in range(len(causal_flags))]
    groups = [[i for i, c in enumerate(causal_flags) if c is flag] for flag in (True, False)]
    return [g for g in groups if g] + [[i] for i, c in enumerate(causal_flags) if isinstance(c, tuple)]


def takes_window(kernel: AttentionKernel) -> bool:
    """Whether `kernel` takes a sliding window natively, a band block of any size in one call in memory linear in
    its rows (the plan's `whole_bands`): where its band path passed its self-check (`use_band`, part of its
    interface, set once by choice.py), and the math kernel (whose every block is explicit)."""
    return getattr(kernel, "use_band", False) or isinstance(kernel, MathKernel)


def band_kernel(kernel: AttentionKernel) -> AttentionKernel:
    """The kernel that computes band blocks: `kernel` where it takes the window, else the math one (the plan then
    cuts the band in strips: small band blocks)."""
    return kernel if takes_window(kernel) else MathKernel()


def forward_block(kernel: AttentionKernel, q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's (out, lse): mask is the causal flag, or a band."""
    if isinstance(mask, tuple):
        return band_kernel(kernel).forward_band(q, k, v, mask, scale)
    return kernel.forward(q, k, v, mask, scale)


def backward_block(kernel: AttentionKernel, dout, q, k, v, out, lse, mask, scale: float):
    """One block's (dq, dk, dv): mask is the causal flag, or a band."""
    if isinstance(mask, tuple):
        return band_kernel(kernel).backward_band(dout, q, k, v, out, lse, mask, scale)
    return kernel.backward(dout, q, k, v, out, lse, mask, scale)


def forward_blocks(kernel: AttentionKernel, blocks: list[ForwardBlock], scale: float, varlen: bool | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(out [nb, len, hq, d], lse [nb, hq, len] float32) of every block, in the blocks' order; packed into varlen
    calls as the kernel was built to (`uses_varlen`), or as `varlen` says (its self-check tries the path)."""
    results: list = [None] * len(blocks)
    varlen = uses_varlen(kernel) if varlen is None else varlen
    for group in _varlen_groups(varlen, [b[3] for b in blocks]):
        if len(group) == 1:
            results[group[0]] = forward_block(kernel, *blocks[group[0]], scale)
            continue
        qs, ks, vs = ([blocks[i][j] for i in group] for j in range(3))
        offsets = Offsets.of(_lengths(qs), _lengths(ks), qs[0].device)
        out, lse = kernel.forward_varlen(pack(qs), pack(ks), pack(vs), offsets.cu_seqlens_q, offsets.cu_seqlens_k,
                                         offsets.max_q, offsets.max_k, blocks[group[0]][3], scale)
        for i, o, s in zip(group, unpack(out, qs), unpack(lse, qs, dim=1), strict=True):
            results[i] = (o, s)
    return results


def backward_blocks(kernel: AttentionKernel, blocks: list[BackwardBlock], scale: float, varlen: bool | None = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(dq, dk, dv) of every block (dout, q, k, v, out, lse, causal), each shaped like its input; packed as
    `forward_blocks` packs."""
    results: list = [None] * len(blocks)
    varlen = uses_varlen(kernel) if varlen is None else varlen
    for group in _varlen_groups(varlen, [b[6] for b in blocks]):
        if len(group) == 1:
            results[group[0]] = backward_block(kernel, *blocks[group[0]], scale)
            continue
        douts, qs, ks, vs, outs, lses = ([blocks[i][j] for i in group] for j in range(6))
        offsets = Offsets.of(_lengths(qs), _lengths(ks), qs[0].device)
        packed_lse = torch.cat([s.transpose(0, 1).reshape(s.shape[1], -1) for s in lses], dim=1)  # [hq, Tq]
        dq, dk, dv = kernel.backward_varlen(pack(douts), pack(qs), pack(ks), pack(vs), pack(outs), packed_lse,
                                            offsets.cu_seqlens_q, offsets.cu_seqlens_k, offsets.max_q, offsets.max_k,
                                            blocks[group[0]][6], scale)
        for i, q_grad, k_grad, v_grad in zip(group, unpack(dq, qs), unpack(dk, ks), unpack(dv, vs), strict=True):
            results[i] = (q_grad, k_grad, v_grad)
    return results
