"""Local attention kernels: the per-rank block computation behind one small interface.

Every kernel works in the sequence-major layout the library uses throughout:

    q    [batch, q_len, q_heads, head_dim]
    k, v [batch, kv_len, kv_heads, head_dim]     (kv_heads divides q_heads; never repeated)
    out  [batch, q_len, q_heads, head_dim]       (q's dtype)
    lse  [batch, q_heads, q_len]                 (float32 log-sum-exp of the scaled scores)

forward(q, k, v, causal, scale) -> (out, lse)
backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv), each like its input.

`out` in backward is only used through D = rowsum(dout * out); `lse` is the log-sum-exp of
the *whole* row (all blocks merged), so the block gradients come out already normalised.
`causal` is top-left aligned and only used on square blocks.

Backends: "flash-attn" (CUDA, when installed), "torch" (PyTorch's fused flash-attention ops
on CPU, memory-efficient attention on CUDA), "math" (explicit scores; a reference for tests).
"""

from __future__ import annotations

import importlib.util
import math
from typing import Protocol

import torch
import torch.nn.functional as F

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class AttentionKernel(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float) -> Grads: ...


def _fold_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """[b, s, h, d] -> [b * h / group, group, s, d]: batch x kv-head as the batch, a kv head's
    query group as the heads. A view (no copy) on heads-first memory, which is what the library
    passes; other layouts are copied."""
    b, s, h, d = x.shape
    return x.transpose(1, 2).reshape(b * h // group, group, s, d)


def _unfold_heads(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of `_fold_heads`: [b * h / group, group, s, d] -> [b, s, h, d]."""
    folded, group, s, d = x.shape
    return x.reshape(batch, folded * group // batch, s, d).transpose(1, 2)


class TorchCPUKernel:
    """PyTorch's fused, tiled flash-attention ops for CPU (GQA handled natively).

    The ops keep their outputs, and in backward a copy of dout, in [batch, seq, heads, dim]
    order. With every kv head folded into the batch dimension (one head, or one GQA query
    group, per batch entry) that order is heads-first memory, like the inputs: the backward
    then reads and writes every row of a head contiguously (about 5% faster on the chunk
    views the ring passes) and no copy of dout is made. Results are bit-identical.
    """

    name = "torch"

    def forward(self, q, k, v, causal, scale):
        batch, q_len, heads, _ = q.shape
        group = heads // k.shape[2]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _fold_heads(q, group), _fold_heads(k, 1), _fold_heads(v, 1), 0.0, causal, scale=scale)
        return _unfold_heads(out, batch), lse.reshape(batch, heads, q_len)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        batch, q_len, heads, _ = q.shape
        group = heads // k.shape[2]
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _fold_heads(dout, group), _fold_heads(q, group), _fold_heads(k, 1), _fold_heads(v, 1),
            _fold_heads(out, group), lse.reshape(batch * heads // group, group, q_len), 0.0, causal, scale=scale)
        return tuple(_unfold_heads(g, batch) for g in grads)


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, s, h_kv, d] -> [b, s, h_kv * groups, d], locally only (never on the wire)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _sum_head_groups(g: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of `_repeat_heads`: [b, s, h_kv * groups, d] -> [b, s, h_kv, d]."""
    if groups == 1:
        return g
    b, s, h, d = g.shape
    return g.view(b, s, h // groups, groups, d).sum(3)


class TorchCUDAKernel:
    """PyTorch's memory-efficient attention on CUDA (sequence-major layout, any float dtype)."""

    name = "torch"
    _NO_MASK, _CAUSAL_TOP_LEFT = 0, 1

    def forward(self, q, k, v, causal, scale):
        groups = q.shape[2] // k.shape[2]
        out, lse, *_ = torch.ops.aten._efficient_attention_forward(
            q, _repeat_heads(k, groups), _repeat_heads(v, groups), None, None, None, None, None, 0.0,
            self._CAUSAL_TOP_LEFT if causal else self._NO_MASK, True, scale=scale)
        return out, lse[..., : q.shape[1]].float()  # lse may be padded to a multiple of 32

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[2] // k.shape[2]
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
        padded_lse = F.pad(lse, (0, -lse.shape[-1] % 32))  # the layout the forward returns
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            dout.contiguous(), q, _repeat_heads(k, groups), _repeat_heads(v, groups), None, out.contiguous(),
            None, None, q.shape[1], k.shape[1], padded_lse.contiguous(), 0.0, no_rng, no_rng,
            self._CAUSAL_TOP_LEFT if causal else self._NO_MASK, False, scale=scale)
        return dq, _sum_head_groups(dk, groups), _sum_head_groups(dv, groups)


class FlashAttnKernel:
    """Tri Dao's flash-attn (>= 2.7) on CUDA, fp16/bf16; GQA native, sequence-major layout."""

    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface

        self._fa = flash_attn_interface

    def forward(self, q, k, v, causal, scale):
        out, lse, *_ = self._fa._flash_attn_forward(
            q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
            window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_backward(
            dout, q, k, v, out, lse, dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
            deterministic=False, rng_state=None)
        return dq, dk, dv


class MathKernel:
    """Explicit scores in float32 (or float64 for float64 inputs): slow, simple, exact."""

    name = "math"

    @staticmethod
    def _probabilities_and_lse(q, k, causal, scale):
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        groups = q.shape[2] // k.shape[2]
        qh, kh = q.to(compute).transpose(1, 2), _repeat_heads(k, groups).to(compute).transpose(1, 2)
        scores = qh @ kh.transpose(-1, -2) * scale  # [b, h, q_len, kv_len]
        if causal:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        return scores, torch.logsumexp(scores, dim=-1)

    def forward(self, q, k, v, causal, scale):
        scores, lse = self._probabilities_and_lse(q, k, causal, scale)
        groups = q.shape[2] // k.shape[2]
        vh = _repeat_heads(v, groups).to(scores.dtype).transpose(1, 2)
        out = (torch.exp(scores - lse.unsqueeze(-1)) @ vh).transpose(1, 2)
        return out.to(q.dtype), lse.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        scores, _ = self._probabilities_and_lse(q, k, causal, scale)
        compute, groups = scores.dtype, q.shape[2] // k.shape[2]
        probs = torch.exp(scores - lse.to(compute).unsqueeze(-1))  # normalised by the whole row
        qh, kh, vh, doh, oh = (t.to(compute).transpose(1, 2) for t in
                               (q, _repeat_heads(k, groups), _repeat_heads(v, groups), dout, out))
        delta = (doh * oh).sum(-1, keepdim=True)  # D = rowsum(dO * O)
        dscores = probs * (doh @ vh.transpose(-1, -2) - delta) * scale
        dq = (dscores @ kh).transpose(1, 2)
        dk = _sum_head_groups((dscores.transpose(-1, -2) @ qh).transpose(1, 2), groups)
        dv = _sum_head_groups((probs.transpose(-1, -2) @ doh).transpose(1, 2), groups)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


KERNEL_NAMES = ("auto", "flash-attn", "torch", "math")


def select_kernel(device: torch.device, dtype: torch.dtype, name: str = "auto") -> AttentionKernel:
    """The kernel for tensors on `device` with `dtype`; "auto" prefers flash-attn, then torch."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {', '.join(KERNEL_NAMES)}")
    on_cuda = device.type == "cuda"
    flash_ok = on_cuda and dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flash_attn")
    if name == "flash-attn" and not flash_ok:
        raise ValueError("kernel 'flash-attn' needs CUDA tensors in fp16/bf16 and the flash-attn package "
                         "(pip install 'burst[cuda]'); use kernel='torch' instead")
    if name == "math":
        return MathKernel()
    if name == "flash-attn" or (name == "auto" and flash_ok):
        return FlashAttnKernel()
    if on_cuda:
        return TorchCUDAKernel()
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return TorchCPUKernel()
    return MathKernel()


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
