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

Each kernel class states what it needs of its arguments in a `KernelContract` (`contract`):
the ring passes row slices of larger tensors, and a CUDA kernel that takes a raw pointer reads
a slice with the wrong strides silently. The strictest is flash-attn's (`FLASH_ATTN_CONTRACT`):
q, k, v, out, dout with a contiguous last dimension (other strides are passed to the kernel),
fp16/bf16, head_dim a multiple of 8 up to 256, and lse one dense [batch, heads, q_len] float32
buffer (the backward indexes it as (b * heads + h) * q_len + row, whatever its strides). The
ring meets that contract on every call; tests/test_kernel_contract.py checks it on CPU.

Backends, in the order "auto" prefers them on CUDA (see `cuda_kernel_choice`):
  "flash-attn"  Tri Dao's flash-attn >= 2.7, when installed;
  "torch"       PyTorch's own copy of the same FlashAttention-2 kernels
                (`_scaled_dot_product_flash_attention`), else its memory-efficient attention
                (float32, pre-Ampere GPUs, or head dims flash does not take); on CPU its
                fused flash-attention ops for CPU;
  "math"        explicit scores; a reference for tests.
PyTorch's cuDNN attention is not used: its log-sum-exp comes back as [b, h, s, 1] and its
backward's stride and GQA requirements differ between releases, which cannot be pinned down
here without a GPU; FlashAttention-2 takes GQA natively and is the same kernel as flash-attn.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import warnings
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KernelContract:
    """What a kernel needs of the tensors it is given (see the module docstring for the shapes).

    dtypes: the dtypes q, k and v may have; out and dout must have q's dtype, lse is float32.
    last_dim_contiguous: arguments that need stride(-1) == 1; their other strides are taken as
        they are (a row slice is fine).
    contiguous: arguments read as one dense buffer whatever their strides: a slice would be
        read at the wrong offsets, so they must be contiguous.
    head_dim_multiple, max_head_dim: the head dims the kernel takes.
    """

    dtypes: tuple[torch.dtype, ...]
    last_dim_contiguous: frozenset[str] = frozenset()
    contiguous: frozenset[str] = frozenset()
    head_dim_multiple: int = 1
    max_head_dim: int | None = None

    def unsupported(self, dtype: torch.dtype, head_dim: int) -> list[str]:
        """Why the kernel cannot take inputs of `dtype` and `head_dim`; [] if it can."""
        found = []
        if dtype not in self.dtypes:
            found.append(f"dtype {dtype}: this kernel takes {', '.join(map(str, self.dtypes))}")
        if head_dim % self.head_dim_multiple or (self.max_head_dim is not None and head_dim > self.max_head_dim):
            found.append(f"head_dim {head_dim}: it must be a multiple of {self.head_dim_multiple}"
                         + (f" and at most {self.max_head_dim}" if self.max_head_dim else ""))
        return found

    def breaches(self, **args: torch.Tensor) -> list[str]:
        """What is wrong with a call's arguments (q, k, v, and in backward dout, out, lse); [] if nothing."""
        q, k = args["q"], args["k"]
        batch, q_len, heads, head_dim = q.shape
        found = self.unsupported(q.dtype, head_dim)
        expected = {"k": (batch, k.shape[1], k.shape[2], head_dim), "v": tuple(k.shape),
                    "out": tuple(q.shape), "dout": tuple(q.shape), "lse": (batch, heads, q_len)}
        for name, t in args.items():
            if name != "q" and tuple(t.shape) != expected[name]:
                found.append(f"{name} has shape {tuple(t.shape)}, expected {expected[name]}")
            want = torch.float32 if name == "lse" else q.dtype
            if t.dtype != want:
                found.append(f"{name} has dtype {t.dtype}, expected {want}")
            if name in self.last_dim_contiguous and t.stride(-1) != 1:
                found.append(f"{name} has stride(-1) = {t.stride(-1)}; the kernel needs a contiguous last dimension")
            if name in self.contiguous and not t.is_contiguous():
                found.append(f"{name} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); the kernel "
                             "reads it as one dense buffer")
        if heads % k.shape[2]:
            found.append(f"q heads ({heads}) must be a multiple of kv heads ({k.shape[2]})")
        return found


# FlashAttention-2, as flash-attn and PyTorch's CUDA flash ops both run it.
FLASH_ATTN_CONTRACT = KernelContract(
    dtypes=HALF_DTYPES, last_dim_contiguous=frozenset({"q", "k", "v", "out", "dout"}),
    contiguous=frozenset({"lse"}), head_dim_multiple=8, max_head_dim=256)


class AttentionKernel(Protocol):
    name: str
    contract: KernelContract

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

    Takes any strides (the ops copy what they need). The ops keep their outputs, and in
    backward a copy of dout, in [batch, seq, heads, dim] order. With every kv head folded into
    the batch dimension (one head, or one GQA query group, per batch entry) that order is
    heads-first memory, like the inputs: the backward then reads and writes every row of a head
    contiguously (about 5% faster on the chunk views the ring passes) and no copy of dout is
    made. Results are bit-identical.
    """

    name = "torch"
    contract = KernelContract(dtypes=FLOAT_DTYPES)

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


class TorchCUDAFlashKernel:
    """PyTorch's FlashAttention-2 on CUDA (Ampere or newer, fp16/bf16): GQA native, no K/V repeat.

    The ops take [b, h, s, d] and hand the kernel the transpose, so the library's sequence-major
    tensors pass through as transposed views, never copied. Contract: flash-attn's (the same
    kernel); the backward makes out and dout contiguous itself but reads lse as one dense buffer.
    """

    name = "torch"
    contract = FLASH_ATTN_CONTRACT

    def forward(self, q, k, v, causal, scale):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=scale)
        return out.transpose(1, 2), lse  # [b, s, h, d], [b, h, s] float32

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        unused_rng = torch.empty(0, dtype=torch.int64, device=q.device)  # read only with dropout
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
            lse, None, None, q.shape[1], k.shape[1], 0.0, causal, unused_rng, unused_rng, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)


class TorchCUDAEfficientKernel:
    """PyTorch's memory-efficient attention on CUDA: any float dtype and GPU, but K/V heads are
    repeated locally for GQA (the kernel takes equal head counts). The fallback for float32,
    pre-Ampere GPUs and head dims FlashAttention does not take.

    Reads q, k, v with their strides (last dimension contiguous); out, dout and lse are made
    contiguous here, and lse padded to the multiple of 32 the forward returns it in.
    """

    name = "torch"
    contract = KernelContract(dtypes=(torch.float32, *HALF_DTYPES), last_dim_contiguous=frozenset({"q", "k", "v"}))
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
    """Tri Dao's flash-attn (>= 2.7: the keyword API of `_flash_attn_forward/_backward`) on CUDA.

    GQA native; sequence-major layout with any strides but the last. The backward takes lse as
    a pointer to a dense [b, h, q_len] buffer, so a sliced lse is read wrongly (no error).
    """

    name = "flash-attn"
    contract = FLASH_ATTN_CONTRACT

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
    """Explicit scores in float32 (or float64 for float64 inputs): slow, simple, exact; any layout."""

    name = "math"
    contract = KernelContract(dtypes=FLOAT_DTYPES)

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


def cuda_kernel_choice(dtype: torch.dtype, head_dim: int, capability: tuple[int, int],
                       flash_attn_version: TorchVersion | None, torch_flash_built: bool, name: str = "auto") -> str:
    """Which CUDA kernel serves `name` for these inputs: "flash-attn", "torch-flash" or "torch-efficient".

    FlashAttention-2 (flash-attn's or PyTorch's) needs fp16/bf16, an Ampere or newer GPU
    (capability >= 8.0) and a head dim it takes; otherwise memory-efficient attention.
    Raises ValueError when flash-attn is asked for by name and cannot serve.
    """
    flash_fits = not FLASH_ATTN_CONTRACT.unsupported(dtype, head_dim) and capability >= (8, 0)
    old_flash_attn = flash_attn_version is not None and flash_attn_version < FLASH_ATTN_MIN_VERSION
    if name == "flash-attn":
        if flash_attn_version is None or old_flash_attn:
            found = "is not installed" if flash_attn_version is None else f"{flash_attn_version} is installed"
            raise ValueError(f"kernel 'flash-attn' needs flash-attn >= {FLASH_ATTN_MIN_VERSION} and {found}; "
                             "pip install 'burst-attention[cuda]' (or 'flash-attn>=2.7'), or use kernel='torch'")
        if not flash_fits:
            raise ValueError(f"kernel 'flash-attn' needs fp16/bf16 inputs, a head dim that is a multiple of 8 up to "
                             f"256, and an Ampere or newer GPU; got {dtype}, head_dim {head_dim}, capability "
                             f"{capability}; use kernel='torch'")
        return "flash-attn"
    if name == "auto" and old_flash_attn:
        warnings.warn(f"flash-attn {flash_attn_version} is older than {FLASH_ATTN_MIN_VERSION}, whose API burst "
                      f"calls; using PyTorch's attention kernels instead (pip install 'flash-attn>=2.7' to use it)",
                      stacklevel=3)
    if name == "auto" and flash_fits and flash_attn_version is not None and not old_flash_attn:
        return "flash-attn"
    return "torch-flash" if flash_fits and torch_flash_built else "torch-efficient"


_CUDA_KERNELS = {"flash-attn": FlashAttnKernel, "torch-flash": TorchCUDAFlashKernel,
                 "torch-efficient": TorchCUDAEfficientKernel}


def select_kernel(device: torch.device, dtype: torch.dtype, name: str = "auto", head_dim: int = 64) -> AttentionKernel:
    """The kernel for tensors on `device` with `dtype` and `head_dim`.

    "auto" prefers flash-attn, then PyTorch's own kernels (see `cuda_kernel_choice` on CUDA);
    "math" is the reference. Raises ValueError for an unknown name or a kernel that cannot serve.
    """
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {', '.join(KERNEL_NAMES)}")
    if name == "math":
        return MathKernel()
    if device.type == "cuda":
        torch_flash_built = torch.version.hip is None and torch.backends.cuda.is_flash_attention_available()
        choice = cuda_kernel_choice(dtype, head_dim, torch.cuda.get_device_capability(device),
                                    installed_flash_attn_version(), torch_flash_built, name)
        return _CUDA_KERNELS[choice]()
    if name == "flash-attn":
        raise ValueError(f"kernel 'flash-attn' needs CUDA tensors, got {device.type}; use kernel='torch'")
    if device.type == "cpu" and dtype in FLOAT_DTYPES:
        return TorchCPUKernel()
    return MathKernel()


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
