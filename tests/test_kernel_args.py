"""Each CUDA kernel's argument building, checked on CPU: the ops and flash modules are replaced by fakes
that assert what the real ones need (layout, contiguity, the log-sum-exp's shape, GQA native or repeated)
and compute with the math kernel's semantics. The wrapper must then give the math kernel's results on the
row slices the ring passes, with burst's [b, h, s] float32 log-sum-exp."""

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (loaded before the fakes: it registers the real ops)
import torch.nn.functional as F

from burst.kernels import (
    FlashAttn3Kernel,
    FlashAttn4Kernel,
    FlashAttnKernel,
    MathKernel,
    TorchCUDAEfficientKernel,
    TorchCUDAFlashKernel,
    TorchCUDNNKernel,
)

MATH = MathKernel()
received_kv_heads: list[int] = []


def _seq_major(*tensors):  # [b, h, s, d] -> [b, s, h, d] views
    return [t.transpose(1, 2) for t in tensors]


def _assert_dense(**tensors):
    for name, t in tensors.items():
        assert t.is_contiguous(), f"{name} passed with strides {t.stride()}: the op reads it as a dense buffer"


def _assert_last_dim(**tensors):
    for name, t in tensors.items():
        assert t.stride(-1) == 1, f"{name} passed with stride(-1) = {t.stride(-1)}"


# --- PyTorch's ops, heads-first [b, h, s, d] ---

def fake_cudnn_forward(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                       return_debug_mask=False, *, scale=None):
    assert compute_log_sumexp is True and attn_bias is None and dropout_p == 0.0 and not return_debug_mask
    _assert_last_dim(q=q)
    _assert_dense(k=k, v=v)
    received_kv_heads.append(k.shape[1])
    out, lse = MATH.forward(*_seq_major(q, k, v), is_causal, scale)
    return out.transpose(1, 2), lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], None, None, None


def fake_cudnn_backward(dout, q, k, v, out, lse, philox_seed, philox_offset, attn_bias, cum_q, cum_k, max_q, max_k,
                        dropout_p, is_causal, *, scale=None):
    _assert_dense(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    assert lse.shape == (*q.shape[:3], 1) and lse.dtype == torch.float32, lse.shape
    assert (max_q, max_k) == (q.shape[2], k.shape[2]) and cum_q is None and cum_k is None and attn_bias is None
    grads = MATH.backward(*_seq_major(dout, q, k, v, out), lse.squeeze(-1), is_causal, scale)
    return tuple(g.transpose(1, 2) for g in grads)


def fake_flash_forward(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale=None):
    _assert_last_dim(q=q, k=k, v=v)
    received_kv_heads.append(k.shape[1])
    out, lse = MATH.forward(*_seq_major(q, k, v), is_causal, scale)
    return out.transpose(1, 2), lse, None, None, q.shape[2], k.shape[2], None, None, None


def fake_flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                        scale=None):
    _assert_last_dim(dout=dout, q=q, k=k, v=v, out=out)
    _assert_dense(lse=lse)
    assert lse.shape == q.shape[:3] and (max_q, max_k) == (q.shape[2], k.shape[2])
    grads = MATH.backward(*_seq_major(dout, q, k, v, out), lse, is_causal, scale)
    return tuple(g.transpose(1, 2) for g in grads)


# --- memory-efficient attention: sequence-major [b, s, h, d], equal head counts, lse padded to 32 rows ---

def fake_efficient_forward(q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask_type, compute_lse, *,
                           scale=None):
    assert k.shape[2] == q.shape[2], "efficient attention takes equal head counts: K/V must be repeated"
    _assert_last_dim(q=q, k=k, v=v)
    received_kv_heads.append(k.shape[2])
    out, lse = MATH.forward(q, k, v, mask_type == 1, scale)
    return out, F.pad(lse, (0, -lse.shape[-1] % 32), value=float("nan")), None, None, None, None


def fake_efficient_backward(dout, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, lse, dropout_p, seed, offset,
                            mask_type, bias_requires_grad, *, scale=None):
    _assert_dense(dout=dout, out=out, lse=lse)
    assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= q.shape[1]
    dq, dk, dv = MATH.backward(dout, q, k, v, out, lse[..., : q.shape[1]], mask_type == 1, scale)
    return dq, dk, dv, None


# --- the flash-attn packages: sequence-major, GQA native, lse [b, h, s] ---

def _fake_module(name: str, **functions) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(functions)
    return module


def _package_forward(q, k, v, scale, causal):
    _assert_last_dim(q=q, k=k, v=v)
    received_kv_heads.append(k.shape[2])
    return MATH.forward(q, k, v, causal, scale)


def _package_backward(dout, q, k, v, out, lse, scale, causal):
    _assert_dense(lse=lse)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    return MATH.backward(dout, q, k, v, out, lse, causal, scale)


def fa2_forward(q, k, v, *, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                alibi_slopes, return_softmax):
    return (*_package_forward(q, k, v, softmax_scale, causal), None, None)


def fa2_backward(dout, q, k, v, out, lse, dq, dk, dv, *, dropout_p, softmax_scale, causal, window_size_left,
                 window_size_right, softcap, alibi_slopes, deterministic, rng_state):
    for target, grad in zip((dq, dk, dv), _package_backward(dout, q, k, v, out, lse, softmax_scale, causal),
                            strict=True):
        target.copy_(grad)


def fa3_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
                max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
                seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale=None, causal=False):
    assert all(x is None for x in (k_new, v_new, out, cu_seqlens_q, cu_seqlens_k, page_table))
    return (*_package_forward(q, k, v, softmax_scale, causal), None)


def fa3_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q,
                 max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), softcap=0.0):
    for target, grad in zip((dq, dk, dv), _package_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal),
                            strict=True):
        target.copy_(grad)
    return dq, dk, dv, None


def fa4_forward(q, k, v, softmax_scale=None, causal=False, return_lse=False):
    assert return_lse, "without return_lse FA4 returns no log-sum-exp"
    return _package_forward(q, k, v, softmax_scale, causal)


def fa4_backward(q, k, v, out, dout, lse, softmax_scale=None, causal=False):
    return _package_backward(dout, q, k, v, out, lse, softmax_scale, causal)


@pytest.fixture
def fake_kernels(monkeypatch):
    """Every CUDA op and flash module replaced by its CPU fake."""
    for op, fake in (("_scaled_dot_product_cudnn_attention", fake_cudnn_forward),
                     ("_scaled_dot_product_cudnn_attention_backward", fake_cudnn_backward),
                     ("_scaled_dot_product_flash_attention", fake_flash_forward),
                     ("_scaled_dot_product_flash_attention_backward", fake_flash_backward),
                     ("_efficient_attention_forward", fake_efficient_forward),
                     ("_efficient_attention_backward", fake_efficient_backward)):
        monkeypatch.setattr(torch.ops.aten, op, fake)
    for name, module in (
            ("flash_attn.flash_attn_interface", _fake_module("flash_attn.flash_attn_interface",
                                                             _flash_attn_forward=fa2_forward,
                                                             _flash_attn_backward=fa2_backward)),
            ("flash_attn_interface", _fake_module("flash_attn_interface", _flash_attn_forward=fa3_forward,
                                                  _flash_attn_backward=fa3_backward)),
            ("flash_attn.cute.interface", _fake_module("flash_attn.cute.interface", _flash_attn_fwd=fa4_forward,
                                                       _flash_attn_bwd=fa4_backward))):
        monkeypatch.setitem(sys.modules, name, module)
    received_kv_heads.clear()


KERNELS = [TorchCUDNNKernel, TorchCUDAFlashKernel, TorchCUDAEfficientKernel, FlashAttnKernel, FlashAttn3Kernel,
           FlashAttn4Kernel]


@pytest.mark.parametrize("kernel_class", KERNELS, ids=lambda c: c.name)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_kernel_builds_the_arguments_its_op_needs(fake_kernels, kernel_class, heads, causal):
    """Row slices of sequence-major shards, as the ring passes them; lse sliced from the shard's and made dense."""
    chunk, g = 40, torch.Generator().manual_seed(0)
    shard = lambda h: torch.randn(2, 2 * chunk, h, 16, generator=g)  # noqa: E731
    q_shard, k_shard, v_shard, dout_shard = shard(heads[0]), shard(heads[1]), shard(heads[1]), shard(heads[0])
    rows, cols = slice(chunk, None), slice(chunk, None) if causal else slice(0, chunk)
    q, k, v, dout = q_shard[:, rows], k_shard[:, cols], v_shard[:, cols], dout_shard[:, rows]
    kernel = kernel_class()

    out, lse = kernel.forward(q, k, v, causal, 0.3)
    ref_out, ref_lse = MATH.forward(q, k, v, causal, 0.3)
    assert lse.shape == (2, heads[0], chunk) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    grads = kernel.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3)
    for got, expected in zip(grads, MATH.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3), strict=True):
        torch.testing.assert_close(got, expected)
    repeated = kernel_class.contract.gqa == "repeated"
    assert received_kv_heads == [heads[0] if repeated else heads[1]]  # K/V repeated only where the contract says
