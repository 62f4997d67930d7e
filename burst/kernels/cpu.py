"""PyTorch's fused, tiled flash-attention ops for CPU: the fastest kernel a CPU has."""

from __future__ import annotations

import torch

from burst.kernels.contract import FLOAT_DTYPES, KernelContract
from burst.kernels.math import visible_pairs


def fold_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """[b, s, h, d] -> [b * h / group, group, s, d]: batch x kv-head as the batch, a kv head's
    query group as the heads. A view (no copy) on heads-first memory, which is what the library
    passes; other layouts are copied."""
    b, s, h, d = x.shape
    return x.transpose(1, 2).reshape(b * h // group, group, s, d)


def unfold_heads(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of `fold_heads`: [b * h / group, group, s, d] -> [b, s, h, d]."""
    folded, group, s, d = x.shape
    return x.reshape(batch, folded * group // batch, s, d).transpose(1, 2)


class TorchCPUKernel:
    """`_scaled_dot_product_flash_attention_for_cpu` (+ `_backward`); GQA native through the fold.

    Contract: any strides (the ops copy what they need), every float dtype, any head dim, causal
    top-left; the log-sum-exp comes back [b*h/g, g, s] and is reshaped to [b, h, s] (a view).
    The ops keep their outputs, and in backward a copy of dout, in [batch, seq, heads, dim] order.
    With every kv head folded into the batch dimension (one head, or one GQA query group, per batch
    entry) that order is heads-first memory, like the inputs: the backward then reads and writes
    every row of a head contiguously (about 5% faster on the chunk views the ring passes) and no
    copy of dout is made. Results are bit-identical.
    """

    name = "cpu"
    contract = KernelContract(dtypes=FLOAT_DTYPES)

    def forward(self, q, k, v, causal, scale, mask=None):
        batch, q_len, heads, _ = q.shape
        group = heads // k.shape[2]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            fold_heads(q, group), fold_heads(k, 1), fold_heads(v, 1), 0.0, causal, attn_mask=mask, scale=scale)
        return unfold_heads(out, batch), lse.reshape(batch, heads, q_len)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        batch, q_len, heads, _ = q.shape
        group = heads // k.shape[2]
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            fold_heads(dout, group), fold_heads(q, group), fold_heads(k, 1), fold_heads(v, 1),
            fold_heads(out, group), lse.reshape(batch * heads // group, group, q_len), 0.0, causal, attn_mask=mask,
            scale=scale)
        return tuple(unfold_heads(g, batch) for g in grads)

    # A band (burst/plan.py's window edges) as an additive mask [q_len, kv_len] in q's dtype, the ops' only
    # form of one: the plan keeps band blocks within 512 x 1,023 rows, so the mask stays small.
    def forward_band(self, q, k, v, band, scale):
        return self.forward(q, k, v, False, scale, band_mask(q, k, band))

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        return self.backward(dout, q, k, v, out, lse, False, scale, band_mask(q, k, band))


def band_mask(q: torch.Tensor, k: torch.Tensor, band: tuple[int, int]) -> torch.Tensor:
    """0 where the band sees a pair, -inf elsewhere: [q_len, kv_len] in q's dtype."""
    visible = visible_pairs(q.shape[1], k.shape[1], tuple(band), q.device)
    return torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
