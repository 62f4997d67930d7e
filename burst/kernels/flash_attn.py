"""Tri Dao's FlashAttention packages, each imported only when its kernel is built:
flash-attn 2 (`flash_attn`: pip install 'burst-attention[cuda]'), FlashAttention-3 (`flash_attn_3` /
`flash_attn_interface`, built from source for Hopper) and FlashAttention-4
(`flash_attn.cute`, the `flash-attn-4` wheel, CuTe DSL).

All take the library's sequence-major [b, s, h, d] layout with any strides but the last, GQA
natively, and align causal masks bottom-right (the ring passes causal only on square blocks,
where that equals top-left). Their private entry points change between releases: every call
passes keywords, so a changed signature raises, and a kernel that raises is refused by the
self-check before the ring uses it (burst/kernels/selfcheck.py).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util

import torch
from torch.torch_version import TorchVersion

from burst.kernels.contract import FLASH_ATTN_CONTRACT, HALF_DTYPES, KernelContract
from burst.kernels.cuda import packed_lse

FLASH_ATTN_MIN_VERSION = "2.7"


def installed_flash_attn_version() -> TorchVersion | None:
    """flash-attn's version when it is installed, else None (without importing it)."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        return TorchVersion(importlib.metadata.version("flash_attn"))
    except importlib.metadata.PackageNotFoundError:  # importable without package metadata (a source tree)
        import flash_attn

        return TorchVersion(flash_attn.__version__)


def _module_installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name whose parent is missing
        return False


FA3_MODULES = ("flash_attn_3.flash_attn_interface", "flash_attn_interface")
FA4_MODULE = "flash_attn.cute.interface"


def fa3_installed() -> bool:
    return any(_module_installed(name) for name in FA3_MODULES)


def fa4_installed() -> bool:
    return _module_installed(FA4_MODULE)


class FlashAttnKernel:
    """flash-attn >= 2.7 (the keyword API of `_flash_attn_forward/_backward`): FlashAttention-2.

    Contract: `FLASH_ATTN_CONTRACT`. The backward takes lse as a pointer to a dense [b, h, q_len]
    buffer, so a sliced lse would be read wrongly (no error): it is made contiguous here.
    """

    name = "flash-attn"
    contract = FLASH_ATTN_CONTRACT

    def __init__(self) -> None:
        self._fa = importlib.import_module("flash_attn.flash_attn_interface")

    def forward(self, q, k, v, causal, scale):
        out, lse, *_ = self._fa._flash_attn_forward(
            q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
            window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_backward(
            dout, q, k, v, out, lse.contiguous(), dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
            deterministic=False, rng_state=None)
        return dq, dk, dv

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        out, lse, *_ = self._fa._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False)
        return out, packed_lse(lse, q)

    def backward_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_varlen_backward(
            dout, q, k, v, out, lse.contiguous(), dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
            softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, deterministic=False, rng_state=None)
        return dq, dk, dv


class FlashAttn3Kernel:
    """FlashAttention-3 (Hopper, sm90): `_flash_attn_forward/_backward` of `flash_attn_interface`.

    Contract: fp16/bf16 (its fp8 path is not used), head dim a multiple of 8 up to 256, GQA native,
    causal bottom-right, last dims contiguous (it copies others), lse float32 [b, h, s] returned by
    the forward and read as a dense buffer by the backward (made contiguous here).
    """

    name = "fa3"
    contract = KernelContract(dtypes=HALF_DTYPES, last_dim_contiguous=FLASH_ATTN_CONTRACT.last_dim_contiguous,
                              contiguous=frozenset({"lse"}), head_dim_multiple=8, max_head_dim=256,
                              causal="bottom-right", min_capability=(9, 0))

    def __init__(self) -> None:
        for name in FA3_MODULES:
            if _module_installed(name):
                self._fa = importlib.import_module(name)
                return
        raise ModuleNotFoundError(f"FlashAttention-3 is not installed (none of {', '.join(FA3_MODULES)})")

    def forward(self, q, k, v, causal, scale):
        none = dict.fromkeys(("k_new", "v_new", "qv", "out", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new",
                              "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table",
                              "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary",
                              "q_descale", "k_descale", "v_descale"))
        out, lse, *_ = self._fa._flash_attn_forward(q, k, v, **none, softmax_scale=scale, causal=causal)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_backward(
            dout, q, k, v, out, lse.contiguous(), cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
            sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=dq, dk=dk, dv=dv, softmax_scale=scale,
            causal=causal)
        return dq, dk, dv


class FlashAttn4Kernel:
    """FlashAttention-4 (sm90 and sm100): `flash_attn.cute.interface._flash_attn_fwd/_bwd`.

    Contract: fp16/bf16, head dim a multiple of 8 up to 256, GQA native, causal bottom-right,
    views whose last stride is 1 (16-byte aligned pointers and strides), lse float32 [b, h, s]
    from the forward (return_lse=True) and taken as an external tensor by the backward (made
    contiguous here). A private API whose return arity changed between betas: the wrapper takes
    the first two results of the forward and the first three of the backward.
    """

    name = "fa4"
    contract = KernelContract(dtypes=HALF_DTYPES, last_dim_contiguous=FLASH_ATTN_CONTRACT.last_dim_contiguous,
                              contiguous=frozenset({"lse"}), head_dim_multiple=8, max_head_dim=256,
                              causal="bottom-right", min_capability=(9, 0))

    def __init__(self) -> None:
        self._fa = importlib.import_module(FA4_MODULE)

    def forward(self, q, k, v, causal, scale):
        out, lse, *_ = self._fa._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv, *_ = self._fa._flash_attn_bwd(q, k, v, out, dout, lse.contiguous(), softmax_scale=scale,
                                                  causal=causal)
        return dq, dk, dv
