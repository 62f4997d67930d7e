"""The reference kernel: explicit scores in float32 (float64 for float64 inputs); any layout."""

from __future__ import annotations

import torch

from burst.kernels.contract import FLOAT_DTYPES, KernelContract, repeat_heads, sum_head_groups


def visible_pairs(q_len: int, kv_len: int, mask, device: torch.device) -> torch.Tensor | None:
    """bool [q_len, kv_len] of the pairs a call sees: mask False (all: None), True (causal top-left) or a
    band (lo, hi) (row r sees column c iff lo <= r - c <= hi, burst/kernels/contract.py)."""
    if mask is False:
        return None
    distance = torch.arange(q_len, device=device)[:, None] - torch.arange(kv_len, device=device)[None, :]
    lo, hi = (0, q_len) if mask is True else mask
    return (distance >= lo) & (distance <= hi)


class MathKernel:
    """Explicit scores: slow, simple, exact. K/V heads repeated locally for GQA; causal top-left; a band
    masked explicitly (`forward_band`, the reference of the kernels' own)."""

    name = "math"
    contract = KernelContract(dtypes=FLOAT_DTYPES, gqa="repeated")

    def forward_band(self, q, k, v, band, scale):
        return self.forward(q, k, v, tuple(band), scale)

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        return self.backward(dout, q, k, v, out, lse, tuple(band), scale)

    @staticmethod
    def _probabilities_and_lse(q, k, causal, scale):
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        groups = q.shape[2] // k.shape[2]
        qh, kh = q.to(compute).transpose(1, 2), repeat_heads(k, groups).to(compute).transpose(1, 2)
        scores = qh @ kh.transpose(-1, -2) * scale  # [b, h, q_len, kv_len]
        visible = visible_pairs(q.shape[1], k.shape[1], causal, q.device)  # causal: a flag, or a band
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        return scores, torch.logsumexp(scores, dim=-1)

    def forward(self, q, k, v, causal, scale):
        scores, lse = self._probabilities_and_lse(q, k, causal, scale)
        groups = q.shape[2] // k.shape[2]
        vh = repeat_heads(v, groups).to(scores.dtype).transpose(1, 2)
        out = (torch.exp(scores - lse.unsqueeze(-1)) @ vh).transpose(1, 2)
        return out.to(q.dtype), lse.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        scores, _ = self._probabilities_and_lse(q, k, causal, scale)
        compute, groups = scores.dtype, q.shape[2] // k.shape[2]
        probs = torch.exp(scores - lse.to(compute).unsqueeze(-1))  # normalised by the whole row
        qh, kh, vh, doh, oh = (t.to(compute).transpose(1, 2) for t in
                               (q, repeat_heads(k, groups), repeat_heads(v, groups), dout, out))
        delta = (doh * oh).sum(-1, keepdim=True)  # D = rowsum(dO * O)
        dscores = probs * (doh @ vh.transpose(-1, -2) - delta) * scale
        dq = (dscores @ kh).transpose(1, 2)
        dk = sum_head_groups((dscores.transpose(-1, -2) @ qh).transpose(1, 2), groups)
        dv = sum_head_groups((probs.transpose(-1, -2) @ doh).transpose(1, 2), groups)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
