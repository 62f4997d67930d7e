"""Single-process causal attention: the one module the model calls for attention.

Every block holds a `LocalAttention` as `attention.core_attention`; the trainer's parallelize
step replaces it with a distributed module of the same forward signature, so the model code
knows nothing about ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def document_causal_mask(doc_boundaries: Sequence[torch.Tensor], seq_len: int, device: torch.device,
                         doc_sees: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Boolean mask [batch, 1, seq, seq]: True where query i may attend to key j.

    doc_boundaries[b] holds cumulative document offsets of row b, e.g. [0, 100, 350, seq]:
    a token attends to earlier tokens of its own document only, and, where doc_sees[b][d] = e
    (not -1), a token of document d also to every token of the earlier document e.
    """
    positions = torch.arange(seq_len, device=device)
    causal = positions[:, None] >= positions[None, :]  # [seq, seq]
    masks = []
    for row, boundaries in enumerate(doc_boundaries):
        # Document index of each token: how many inner boundaries lie at or before it.
        doc_ids = torch.bucketize(positions, boundaries.to(device)[1:-1], right=True)  # [seq]
        mask = causal & (doc_ids[:, None] == doc_ids[None, :])
        if doc_sees is not None:
            sees = check_doc_sees(doc_sees[row], len(boundaries) - 1, row).to(device)
            mask |= sees[doc_ids][:, None] == doc_ids[None, :]  # -1 matches no document
        masks.append(mask)
    return torch.stack(masks)[:, None]  # [batch, 1, seq, seq]


def check_doc_sees(sees, documents: int, row: int) -> torch.Tensor:
    """One row of doc_sees as an int64 tensor [documents], or a ValueError saying what is wrong."""
    sees = torch.as_tensor(sees)
    if sees.dim() != 1 or sees.is_floating_point() or len(sees) != documents:
        raise ValueError(f"doc_sees row {row} must be a 1-D integer tensor with one entry per document ({documents}), "
                         f"got {sees.dtype} of shape {tuple(sees.shape)}")
    if torch.compiler.is_compiling():
        return sees.long()  # its values are checked where the graph is not compiled (reading them would break it)
    bad = ((sees < -1) | (sees >= torch.arange(documents, device=sees.device))).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        raise ValueError(f"doc_sees row {row}: document {i} sees {int(sees[i])}, but a document may only see an "
                         f"earlier one (0 <= j < {i}) or none (-1)")
    return sees.long()


class LocalAttention(nn.Module):
    """Causal grouped-query attention over the whole sequence held by this process."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                doc_boundaries: Sequence[torch.Tensor] | None = None,
                doc_sees: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """q [batch, seq, n_heads, head_dim], k/v [batch, seq, n_kv_heads, head_dim] -> [batch, seq, n_heads, head_dim].

        doc_boundaries: None, or one 1-D int tensor of document offsets per batch row
        (first 0, last seq), for a block-diagonal causal mask over packed documents.
        doc_sees: None, or per batch row an int tensor [n_docs]: the earlier document each document
        also sees whole (prefix sharing), or -1.
        """
        batch, seq_len = q.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        if doc_boundaries is None:
            if doc_sees is not None:
                raise ValueError("doc_sees names documents by their index in doc_boundaries: pass doc_boundaries too")
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            if len(doc_boundaries) != batch:
                raise ValueError(f"doc_boundaries has {len(doc_boundaries)} rows but the batch has {batch}; "
                                 f"pass one tensor of document offsets per batch row")
            if doc_sees is not None and len(doc_sees) != batch:
                raise ValueError(f"doc_sees has {len(doc_sees)} rows but the batch has {batch}; pass one tensor "
                                 "per batch row, one entry per document")
            mask = document_causal_mask(doc_boundaries, seq_len, q.device, doc_sees)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)  # [batch, seq, n_heads, head_dim]
