"""Single-process causal attention: the one module the model calls for attention.

Every block holds a `LocalAttention` as `attention.core_attention`; the trainer's parallelize
step replaces it with a distributed module of the same forward signature, so the model code
knows nothing about ranks. In one process it is burst's attention over the whole sequence
(`burst.local_attn`): the kernel the ring would choose, and with packed documents or prefix
sharing one kernel call per visible rectangle, masked ones skipped, never a [seq, seq] mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from burst.decode import LayerCache, attend_cached
from burst.local import local_attn


class LocalAttention(nn.Module):
    """Causal grouped-query attention over the whole sequence held by this process.

    kernel: the local kernel, as `burst.select_kernel` names it ("auto": the fastest that passes its self-check);
    the trainer's parallelize step sets it from --attention-kernel.
    """

    def __init__(self, kernel: str = "auto") -> None:
        super().__init__()
        self.kernel = kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                doc_boundaries: Sequence[torch.Tensor] | None = None,
                doc_sees: Sequence[torch.Tensor] | None = None, window: int | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        """q [batch, seq, n_heads, head_dim], k/v [batch, seq, n_kv_heads, head_dim] -> [batch, seq, n_heads, head_dim].

        doc_boundaries: None, the batch's `burst.Documents` (as the data loader makes them), or one 1-D int
        tensor of document offsets per batch row
        (first 0, last seq): a token attends to earlier tokens of its own document only.
        doc_sees: None, or per batch row an int tensor [n_docs]: the earlier document each document
        also sees whole (prefix sharing), or -1.
        window: the layer's sliding window W (a query at i sees keys i - W < j <= i), or None.
        cache: when generating, this layer's keys and values (burst/decode.py): the prompt's pass keeps its keys
        there; a later pass's tokens attend to every key kept (one token at a time).
        """
        if cache is not None and cache.length > 0:
            if q.shape[1] != 1:
                raise ValueError(f"after the prompt, generation passes one token at a time, got {q.shape[1]}")
            cache.write(k, v)
            return attend_cached(q, cache, window=window)[0].to(q.dtype)
        if cache is not None:
            cache.write(k, v)
        return local_attn(q, k, v, causal=True, kernel=self.kernel, doc_boundaries=doc_boundaries,
                          doc_sees=doc_sees, window=window)
