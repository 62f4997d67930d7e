"""`local_attn`: burst's attention in one process, for a whole sequence of any length.

The ring's operator (`torch.ops.burst.attention`) at a world of one, with no process group at all:
the model's single-process attention calls it, so training, evaluation and a model used directly
attend with the same plan and kernels as the ring. With packed documents or prefix sharing the plan
(burst/plan.py) makes one kernel call per visible rectangle and skips every masked one, so memory
stays linear in the sequence length: no [seq, seq] mask or score matrix is ever formed.
"""

from __future__ import annotations

import torch

from burst.attention import ONE_PROCESS, boundaries_tensor, sees_tensor
from burst.kernels import KERNEL_NAMES, default_scale
from burst.plan import sees_by_row


def check_local_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str) -> None:
    """Raise a ValueError naming what is wrong with q, k, v (shapes as `local_attn` takes them)."""
    if kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNEL_NAMES)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, seq and head_dim")
    if q.shape[1] == 0:
        raise ValueError("the sequence is empty: q, k and v need at least one position")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]}) "
                         "for grouped-query attention")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def local_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
               softmax_scale: float | None = None, kernel: str = "auto", doc_boundaries=None, doc_sees=None,
               return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over the whole sequence held by this process.

    q [batch, seq, q_heads, head_dim]; k, v [batch, seq, kv_heads, head_dim] (kv_heads divides q_heads;
    never repeated). Returns out [batch, seq, q_heads, head_dim] in q's dtype, and with `return_lse` the
    float32 log-sum-exp [batch, q_heads, seq] (not differentiable). Any seq >= 1.

    kernel: as `burst.select_kernel` names it ("auto": the one the ring would pick for these inputs).
    doc_boundaries, doc_sees: as `burst_attn` takes them (cumulative document offsets per batch row, and
    per row the earlier document each document also sees whole, or -1). A query sees keys of its own
    document (and of the one it sees) only; masked rectangles are never computed.
    """
    check_local_inputs(q, k, v, kernel)
    if doc_sees is not None:  # its shapes here; its values with the boundaries', in the operator
        sees_by_row(doc_sees, None if doc_boundaries is None else [len(row) - 1 for row in doc_boundaries])
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    out, lse = torch.ops.burst.attention(q, k, v, boundaries_tensor(doc_boundaries), sees_tensor(doc_sees), causal,
                                         scale, ONE_PROCESS, "flat", 1, "auto", kernel, "zigzag")
    return (out, lse) if return_lse else out
