"""Each CUDA kernel's argument building, checked on CPU: the ops and flash-attn 2 are replaced by fakes
that assert what the real ones need (layout, contiguity, the log-sum-exp's shape, GQA native or repeated)
and compute with the math kernel's semantics, causal aligned as each aligns it (FlashAttention's
bottom-right, cuDNN's and memory-efficient's top-left). The wrapper must then give the math kernel's
(top-left) results on the row slices the ring passes, with burst's [b, h, s] float32 log-sum-exp.
FlashAttention-3 and -4, as their releases are: tests/test_kernel_packages.py; the ops' argument order
against torch's own meta functions: tests/test_kernel_meta.py."""

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (loaded before the fakes: it registers the real ops)
import torch.nn.functional as F

from burst.kernels import (
    FlashAttnKernel,
    MathKernel,
    TorchCUDAEfficientKernel,
    TorchCUDAFlashKernel,
    TorchCUDNNKernel,
)
from burst.kernels.selfcheck import band_self_check, self_check
from tests.test_kernel_choice import BottomRightKernel

MATH, BOTTOM_RIGHT = MathKernel(), BottomRightKernel()
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
    out, lse = BOTTOM_RIGHT.forward(*_seq_major(q, k, v), is_causal, scale)
    return out.transpose(1, 2), lse, None, None, q.shape[2], k.shape[2], None, None, None


def fake_flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                        scale=None):
    _assert_last_dim(dout=dout, q=q, k=k, v=v, out=out)
    _assert_dense(lse=lse)
    assert lse.shape == q.shape[:3] and (max_q, max_k) == (q.shape[2], k.shape[2])
    grads = BOTTOM_RIGHT.backward(*_seq_major(dout, q, k, v, out), lse, is_causal, scale)
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


# --- the flash-attn packages: sequence-major, GQA native, causal bottom-right, lse [b, h, s] ---

def fake_module(name: str, **functions) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(functions)
    return module


def flash_band(q_len: int, kv_len: int, causal: bool, left: int | None, right: int | None) -> tuple[int, int]:
    """What FlashAttention's causal flag and window_size (left, right; -1 or None: unbounded) show, aligned
    bottom-right, as the math kernel's band (lo, hi): query row r sees key row c iff lo <= r - c <= hi.
    Causal means right = 0; key c is seen iff r + kv_len - q_len - left <= c <= r + kv_len - q_len + right."""
    unbounded, offset = q_len + kv_len, kv_len - q_len
    right = 0 if causal else right
    return (-(offset + right) if right is not None and right >= 0 else -unbounded,
            left - offset if left is not None and left >= 0 else unbounded)


def package_forward(q, k, v, scale, causal, window=(None, None)):
    _assert_last_dim(q=q, k=k, v=v)
    received_kv_heads.append(k.shape[2])
    return MATH.forward(q, k, v, flash_band(q.shape[1], k.shape[1], causal, *window), scale)


def package_backward(dout, q, k, v, out, lse, scale, causal, window=(None, None)):
    _assert_dense(lse=lse)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    return MATH.backward(dout, q, k, v, out, lse, flash_band(q.shape[1], k.shape[1], causal, *window), scale)


def fa2_forward(q, k, v, *, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                alibi_slopes, return_softmax):
    return (*package_forward(q, k, v, softmax_scale, causal, (window_size_left, window_size_right)), None, None)


def fa2_backward(dout, q, k, v, out, lse, dq, dk, dv, *, dropout_p, softmax_scale, causal, window_size_left,
                 window_size_right, softcap, alibi_slopes, deterministic, rng_state):
    for target, grad in zip((dq, dk, dv), package_backward(dout, q, k, v, out, lse, softmax_scale, causal,
                                                           (window_size_left, window_size_right)), strict=True):
        target.copy_(grad)


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
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface",
                        fake_module("flash_attn.flash_attn_interface", _flash_attn_forward=fa2_forward,
                                    _flash_attn_backward=fa2_backward))
    received_kv_heads.clear()


KERNELS = [TorchCUDNNKernel, TorchCUDAFlashKernel, TorchCUDAEfficientKernel, FlashAttnKernel]
BLOCKS = {  # (query rows, key rows, causal) of a shard of two 40-row chunks
    "causal": (slice(40, None), slice(40, None), True), "full": (slice(40, None), slice(0, 40), False),
    "causal-fewer-queries": (slice(40, None), slice(None), True),
    "causal-more-queries": (slice(None), slice(40, None), True)}


@pytest.mark.parametrize("kernel_class", KERNELS, ids=lambda c: c.name)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("block", BLOCKS)
def test_kernel_builds_the_arguments_its_op_needs(fake_kernels, kernel_class, heads, block):
    check_on_ring_slices(kernel_class(), heads, *BLOCKS[block])


def check_on_ring_slices(kernel, heads: tuple[int, int], rows: slice, cols: slice, causal: bool) -> None:
    """Row slices of sequence-major shards, as the ring passes them; lse sliced from the shard's and made dense.
    The kernel's results must be the math kernel's (causal top-left, also on a rectangle)."""
    g = torch.Generator().manual_seed(0)
    shard = lambda h: torch.randn(2, 80, h, 16, generator=g)  # noqa: E731
    q_shard, k_shard, v_shard, dout_shard = shard(heads[0]), shard(heads[1]), shard(heads[1]), shard(heads[0])
    q, k, v, dout = q_shard[:, rows], k_shard[:, cols], v_shard[:, cols], dout_shard[:, rows]
    received_kv_heads.clear()

    out, lse = kernel.forward(q, k, v, causal, 0.3)
    ref_out, ref_lse = MATH.forward(q, k, v, causal, 0.3)
    assert lse.shape == (2, heads[0], q.shape[1]) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    grads = kernel.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3)
    for got, expected in zip(grads, MATH.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3), strict=True):
        torch.testing.assert_close(got, expected)
    repeated = kernel.contract.gqa == "repeated"
    assert set(received_kv_heads) == {heads[0] if repeated else heads[1]}  # K/V repeated only where the contract says


def test_flash_attn_passes_the_self_checks_with_its_window(fake_kernels):
    """flash-attn 2 through its window_size_left/right (a sliding window's band blocks), causal bottom-right."""
    assert self_check(FlashAttnKernel(), torch.device("cpu"), torch.bfloat16, 32, 2) is None
    assert band_self_check(FlashAttnKernel(), torch.device("cpu"), torch.bfloat16, 32, 2) is None
