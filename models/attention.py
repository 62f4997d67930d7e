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


def document_causal_mask(doc_boundaries: Sequence[torch.Tensor], seq_len: int, device: torch.device) -> torch.Tensor:
    """Boolean mask [batch, 1, seq, seq]: True where query i may attend to key j.

    doc_boundaries[b] holds cumulative document offsets of row b, e.g. [0, 100, 350, seq]:
    a token attends to earlier tokens of its own document only.
    """
    positions = torch.arange(seq_len, device=device)
    causal = positions[:, None] >= positions[None, :]  # [seq, seq]
    masks = []
    for boundaries in doc_boundaries:
        # Document index of each token: how many inner boundaries lie at or before it.
        doc_ids = torch.bucketize(positions, boundaries.to(device)[1:-1], right=True)  # [seq]
        masks.append(causal & (doc_ids[:, None] == doc_ids[None, :]))
    return torch.stack(masks)[:, None]  # [batch, 1, seq, seq]


class LocalAttention(nn.Module):
    """Causal grouped-query attention over the whole sequence held by this process."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                doc_boundaries: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """q [batch, seq, n_heads, head_dim], k/v [batch, seq, n_kv_heads, head_dim] -> [batch, seq, n_heads, head_dim].

        doc_boundaries: None, or one 1-D int tensor of document offsets per batch row
        (first 0, last seq), for a block-diagonal causal mask over packed documents.
        """
        batch, seq_len = q.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        if doc_boundaries is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            if len(doc_boundaries) != batch:
                raise ValueError(f"doc_boundaries has {len(doc_boundaries)} rows but the batch has {batch}; "
                                 f"pass one tensor of document offsets per batch row")
            mask = document_causal_mask(doc_boundaries, seq_len, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)  # [batch, seq, n_heads, head_dim]
