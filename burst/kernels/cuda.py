"""PyTorch's own CUDA attention kernels: FlashAttention-2, memory-efficient attention and cuDNN.

All three are reached through their aten ops, which take [b, h, s, d]: the library's
sequence-major [b, s, h, d] tensors pass as transposed views, never copied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from burst.kernels.contract import (
    FLASH_ATTN_CONTRACT,
    HALF_DTYPES,
    BottomRightCausal,
    KernelContract,
    repeat_heads,
    sum_head_groups,
    window_sizes,
)


def _no_rng(device: torch.device) -> torch.Tensor:
    """The philox seed/offset the backward ops take; read only with dropout, which burst never uses."""
    return torch.empty(0, dtype=torch.int64, device=device)


class TorchCUDAFlashKernel(BottomRightCausal):
    """`_scaled_dot_product_flash_attention` (+ `_backward`): PyTorch's FlashAttention-2.

    Contract: flash-attn's (the same kernel): fp16/bf16, head dim a multiple of 8 up to 256,
    Ampere or newer, GQA native, causal bottom-right, last dims contiguous (the backward makes
    out and dout contiguous itself) and lse one dense float32 [b, h, s] buffer, as returned.
    """

    name = "flash"
    contract = FLASH_ATTN_CONTRACT

    def block_forward(self, q, k, v, causal, scale):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=scale)
        return out.transpose(1, 2), lse  # [b, s, h, d], [b, h, s] float32

    def block_backward(self, dout, q, k, v, out, lse, causal, scale):
        no_rng = _no_rng(q.device)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
            lse.contiguous(), None, None, q.shape[1], k.shape[1], 0.0, causal, no_rng, no_rng, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)

    # Documents in one launch (burst/varlen.py): the ops behind nested-tensor attention take packed
    # [total, h, d] rows with cumulative offsets; the log-sum-exp comes back [h, total_q] float32.
    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                               scale=scale)
        return out, packed_lse(lse, q)

    def backward_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        no_rng = _no_rng(q.device)
        return tuple(torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal,
            no_rng, no_rng, scale=scale))


    # A band (burst/kernels/contract.py) through the varlen ops, the ones with window sizes: each batch row
    # one sequence of the packed rows.
    def forward_band(self, q, k, v, band, scale):
        batch, q_len, heads, dim = q.shape
        left, right = window_sizes(band, q_len, k.shape[1])
        packed_q = _rows(q)
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            packed_q, _rows(k), _rows(v), *_row_offsets(q, k), q_len, k.shape[1], 0.0, False, False, scale=scale,
            window_size_left=left, window_size_right=right)
        return out.view(batch, q_len, heads, dim), packed_lse(lse, packed_q).view(heads, batch, q_len).transpose(0, 1)

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        batch, q_len, heads, _ = q.shape
        left, right = window_sizes(band, q_len, k.shape[1])
        no_rng = _no_rng(q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            _rows(dout).contiguous(), _rows(q), _rows(k), _rows(v), _rows(out).contiguous(),
            lse.transpose(0, 1).reshape(heads, batch * q_len).contiguous(), *_row_offsets(q, k), q_len, k.shape[1],
            0.0, False, no_rng, no_rng, scale=scale, window_size_left=left, window_size_right=right)
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[b, s, h, d] -> [b x s, h, d] (a copy unless the rows are dense)."""
    return x.reshape(-1, *x.shape[2:])


def _row_offsets(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens of q's and k's batch rows as one packed sequence each: int32 [b + 1] twice."""
    return tuple(torch.arange(0, (q.shape[0] + 1) * x.shape[1], x.shape[1], dtype=torch.int32, device=q.device)
                 for x in (q, k))


def packed_lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A varlen kernel's log-sum-exp as [h, total_q] float32; a padded [n, h, max_q] one is refused
    (its rows would need cutting per sequence): raising makes the self-check turn varlen off."""
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise ValueError(f"varlen log-sum-exp of shape {tuple(lse.shape)}, expected [heads, total] = "
                         f"{(q.shape[1], q.shape[0])}")
    return lse.float()


class TorchCUDAEfficientKernel:
    """`_efficient_attention_forward` (+ `_backward`): any float dtype and GPU, any head dim the
    op takes. K/V heads are REPEATED locally for GQA (the kernel takes equal head counts); causal
    top-left (mask type 1). Reads q, k, v with their strides (last dimension contiguous); out, dout
    and lse are made contiguous here. The lse comes back padded to a multiple of 32 rows
    ([b, h, ceil32(s)]): the forward cuts it to [b, h, s], the backward pads it again.
    """

    name = "efficient"
    contract = KernelContract(dtypes=(torch.float32, *HALF_DTYPES), last_dim_contiguous=frozenset({"q", "k", "v"}),
                              gqa="repeated", lse="[b, h, ceil32(s)]", min_capability=(5, 0))
    _NO_MASK, _CAUSAL_TOP_LEFT = 0, 1

    def forward(self, q, k, v, causal, scale):
        groups = q.shape[2] // k.shape[2]
        out, lse, *_ = torch.ops.aten._efficient_attention_forward(
            q, repeat_heads(k, groups), repeat_heads(v, groups), None, None, None, None, None, 0.0,
            self._CAUSAL_TOP_LEFT if causal else self._NO_MASK, True, scale=scale)
        return out, lse[..., : q.shape[1]].float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[2] // k.shape[2]
        no_rng = _no_rng(q.device)
        padded_lse = F.pad(lse, (0, -lse.shape[-1] % 32))  # the layout the forward returns
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            dout.contiguous(), q, repeat_heads(k, groups), repeat_heads(v, groups), None, out.contiguous(),
            None, None, q.shape[1], k.shape[1], padded_lse.contiguous(), 0.0, no_rng, no_rng,
            self._CAUSAL_TOP_LEFT if causal else self._NO_MASK, False, scale=scale)
        return dq, sum_head_groups(dk, groups), sum_head_groups(dv, groups)


class TorchCUDNNKernel:
    """`_scaled_dot_product_cudnn_attention` (+ `_backward`): cuDNN's fused attention, PyTorch's
    default on Hopper from 2.11 and 1.65-1.72x FlashAttention-2's speed there (docs/kernels.md).

    Contract (from the ops' schema and PyTorch's own ring, which calls the same two ops): fp16/bf16,
    head dim a multiple of 8 up to 128 (256 needs cuDNN >= 9.10 on sm90: not assumed), GQA native
    when the op is called directly, causal top-left. The log-sum-exp is float32 [b, h, s, 1] and
    only produced with compute_log_sumexp=True; it is viewed as [b, h, s] here, and the merged
    one handed back as a dense [b, h, s, 1]. Real strides go into a cuDNN graph built once per
    shape and stride combination; PyTorch's ring makes K/V and the sliced lse contiguous before
    calling, citing wrong numerics otherwise, and so does this wrapper for every argument of the
    backward (a copy of the block, small next to its O(s^2) work). Backward is not deterministic.
    """

    name = "cudnn"
    contract = KernelContract(dtypes=HALF_DTYPES, last_dim_contiguous=frozenset({"q", "k", "v", "out", "dout"}),
                              head_dim_multiple=8, max_head_dim=128, lse="[b, h, s, 1]", min_capability=(8, 0))

    def forward(self, q, k, v, causal, scale):
        batch, q_len, heads, _ = q.shape
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), None, True,
            0.0, causal, False, scale=scale)
        return out.transpose(1, 2), lse.reshape(batch, heads, q_len)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        no_rng = _no_rng(q.device)
        heads_first = [x.transpose(1, 2).contiguous() for x in (dout, q, k, v, out)]
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            *heads_first, lse.contiguous().unsqueeze(-1), no_rng, no_rng, None, None, None, q.shape[1], k.shape[1],
            0.0, causal, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)
