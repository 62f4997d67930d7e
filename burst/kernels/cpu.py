"""PyTorch's fused, tiled flash-attention ops for CPU: the fastest kernel a CPU has."""

from __future__ import annotations

from collections.abc import Iterator

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

    # A band (burst/kernels/contract.py) natively, in one call of any size: strip by strip of query rows, each
    # strip one call of the ops on the keys it sees, masked by an additive mask (the ops' only form of one) of
    # the strip's rows x its keys, so memory stays linear in the block (`band_strips`).
    def forward_band(self, q, k, v, band, scale):
        batch, q_len, heads, dim = q.shape
        out = q.new_empty(batch, heads, q_len, dim).transpose(1, 2)  # heads-first, as `forward` returns it
        lse = q.new_empty(batch, heads, q_len, dtype=torch.float32)
        for rows, cols, causal, mask in masked_strips(q, k, band):
            out[:, rows], lse[:, :, rows] = self.forward(q[:, rows], k[:, cols], v[:, cols], causal, scale, mask)
        return out, lse

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        dq = torch.empty_like(q)
        dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (k, v))  # strips share keys: summed
        for rows, cols, causal, mask in masked_strips(q, k, band):
            dq[:, rows], dk_strip, dv_strip = self.backward(dout[:, rows], q[:, rows], k[:, cols], v[:, cols],
                                                            out[:, rows], lse[:, :, rows].contiguous(), causal,
                                                            scale, mask)
            dk[:, cols] += dk_strip
            dv[:, cols] += dv_strip
        return dq, dk.to(k.dtype), dv.to(v.dtype)


def strip_rows(width: int) -> int:
    """Query rows per strip of a band `width` keys wide: an eighth of it (a strip then computes about 1/8 more
    pairs than it sees), a power of two between 64 and 512 rows."""
    return min(512, max(64, 1 << max(width // 8, 1).bit_length() - 1))


def band_strips(q_len: int, kv_len: int, band: tuple[int, int]) -> list[tuple[slice, slice, tuple[int, int]]]:
    """(query rows, key rows, the band in them) of each strip of a band (lo, hi) over q_len x kv_len rows: the
    keys a strip's queries see (row r sees key c iff lo <= r - c <= hi), a strip of `strip_rows` of the band's
    width (its mask stays within 512 x (width + 511) entries)."""
    lo, hi = band
    height = strip_rows(hi - lo + 1)
    strips = []
    for r0 in range(0, q_len, height):
        r1 = min(q_len, r0 + height)
        c0, c1 = max(0, r0 - hi), min(kv_len, r1 - lo)
        strips.append((slice(r0, r1), slice(c0, c1), (lo - r0 + c0, hi - r0 + c0)))
    return strips


def masked_strips(q: torch.Tensor, k: torch.Tensor,
                  band: tuple[int, int]) -> Iterator[tuple[slice, slice, bool, torch.Tensor | None]]:
    """(query rows, key rows, causal, additive mask or None) of each of `band_strips`' strips: no mask where a strip
    sees every pair or a causal square's, else 0 where it sees a pair and -inf elsewhere, [rows, keys] in q's dtype,
    made once for the strips of one shape and band (all but the first few and the last)."""
    masks: dict[tuple[int, int, tuple[int, int]], tuple[bool, torch.Tensor | None]] = {}
    for rows, cols, (lo, hi) in band_strips(q.shape[1], k.shape[1], band):
        q_len, kv_len = rows.stop - rows.start, cols.stop - cols.start
        key = (q_len, kv_len, (lo, hi))
        if key not in masks:
            if hi >= q_len - 1 and lo <= 1 - kv_len:
                masks[key] = False, None  # every pair seen
            elif hi >= q_len - 1 and lo == 0 and q_len == kv_len:
                masks[key] = True, None  # a causal square
            else:
                visible = visible_pairs(q_len, kv_len, (lo, hi), q.device)
                masks[key] = False, torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(
                    ~visible, float("-inf"))
        yield rows, cols, *masks[key]
