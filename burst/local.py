"""`local_attn`: burst's attention in one process, for a whole sequence of any length.

The ring's operator (`torch.ops.burst.attention`, burst/operator.py) at a world of one, with no process
group at all: the model's single-process attention calls it, so training, evaluation and a model used
directly attend with the same plan and kernels as the ring. With packed documents or prefix sharing the
plan (burst/plan.py) makes one kernel call per visible rectangle and skips every masked one, so memory
stays linear in the sequence length: no [seq, seq] mask or score matrix is ever formed.
"""

from __future__ import annotations

import torch

from burst.checks import check_local_inputs
from burst.documents import WHOLE, Documents, documents_of
from burst.kernels import default_scale
from burst.operator import ONE_PROCESS
from burst.plan import check_window


def local_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
               softmax_scale: float | None = None, kernel: str = "auto", doc_boundaries=None, doc_sees=None,
               return_lse: bool = False, documents: Documents | None = None,
               window: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over the whole sequence held by this process.

    q [batch, seq, q_heads, head_dim]; k, v [batch, seq, kv_heads, head_dim] (kv_heads divides q_heads;
    never repeated). Returns out [batch, seq, q_heads, head_dim] in q's dtype, and with `return_lse` the
    float32 log-sum-exp [batch, q_heads, seq] (not differentiable). Any seq >= 1.

    kernel: as `burst.select_kernel` names it ("auto": the one the ring would pick for these inputs).
    doc_boundaries, doc_sees: as `burst_attn` takes them (cumulative document offsets per batch row, and
    per row the earlier document each document also sees whole, or -1). A query sees keys of its own
    document (and of the one it sees) only; masked rectangles are never computed. documents: instead of
    them, the `burst.Documents` value they make, of any layout (one process cuts nothing).
    window: a sliding window W (with causal): the query at i sees keys i - W < j <= i only, as `burst_attn`.
    """
    check_local_inputs(q, k, v, kernel)
    check_window(window, causal)
    if documents is not None and (doc_boundaries is not None or doc_sees is not None):
        raise ValueError("pass either documents (a burst.Documents) or doc_boundaries and doc_sees, not both")
    documents = documents_of(documents if documents is not None else doc_boundaries, doc_sees, q.shape[1], 1,
                             WHOLE, q.shape[0])
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    out, lse = torch.ops.burst.attention(q, k, v, None if documents is None else documents.encoded, causal, scale,
                                         ONE_PROCESS, "flat", 1, "auto", kernel, window)
    return (out, lse) if return_lse else out
