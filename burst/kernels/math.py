"""The reference kernel: explicit scores in float32 (float64 for float64 inputs); any layout."""

from __future__ import annotations

import torch

from burst.kernels.contract import FLOAT_DTYPES, KernelContract, repeat_heads, sum_head_groups


class MathKernel:
    """Explicit scores: slow, simple, exact. K/V heads repeated locally for GQA; causal top-left."""

    name = "math"
    contract = KernelContract(dtypes=FLOAT_DTYPES, gqa="repeated")

    @staticmethod
    def _probabilities_and_lse(q, k, causal, scale):
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        groups = q.shape[2] // k.shape[2]
        qh, kh = q.to(compute).transpose(1, 2), repeat_heads(k, groups).to(compute).transpose(1, 2)
        scores = qh @ kh.transpose(-1, -2) * scale  # [b, h, q_len, kv_len]
        if causal:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
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
