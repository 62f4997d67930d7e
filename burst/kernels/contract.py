"""What every local attention kernel promises the ring, and what each one needs of its arguments.

Every kernel works in the sequence-major layout the library uses throughout:

    q    [batch, q_len, q_heads, head_dim]
    k, v [batch, kv_len, kv_heads, head_dim]     (kv_heads divides q_heads; never repeated on the wire)
    out  [batch, q_len, q_heads, head_dim]       (q's dtype)
    lse  [batch, q_heads, q_len]                 (float32, natural-log log-sum-exp of the scaled scores)

forward(q, k, v, causal, scale) -> (out, lse)
backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv), each like its input.

`out` in backward is only used through D = rowsum(dout * out); `lse` is the log-sum-exp of the
*whole* row (all blocks merged), so the block gradients come out already normalised. `causal` is
top-left aligned on any block, square or not: query row i sees key rows 0..i. FlashAttention 2/3/4
align it bottom-right, which agrees only on squares; `BottomRightCausal` adapts them.

A kernel may also take a sliding window natively, as a *band* (burst/plan.py): (lo, hi), where query row r
of the block sees key row c iff lo <= r - c <= hi, and every row and every column sees at least one key
(so lo <= 0 <= hi and lo <= q_len - kv_len <= hi: the window sizes of a bottom-right aligned kernel,
`window_sizes`, are never negative). forward_band(q, k, v, band, scale) and backward_band(dout, q, k, v,
out, lse, band, scale) are optional, and take a block of any size in one call, in memory linear in its
rows (one band segment per pair of stretches the window lets meet). A kernel without them, or whose band
path fails its self-check, gets the band in strips from the plan, and the math kernel computes the
strips' small band blocks (at most 512 x 1,023 rows each).

Each kernel class states what it needs of its arguments in a `KernelContract` (`contract`): the
ring passes row slices of larger tensors, and a CUDA kernel that takes a raw pointer reads a slice
with the wrong strides silently. tests/test_kernel_contract.py checks the ring against the
strictest one on CPU; burst/kernels/selfcheck.py checks each kernel against the math kernel
before it is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

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
    gqa: "native" (K/V with fewer heads go to the kernel as they are) or "repeated" (the wrapper
        repeats K/V heads locally, in memory only, and sums their gradients back).
    causal: the kernel's own mask alignment, "top-left" or "bottom-right"; a bottom-right kernel's
        wrapper is a `BottomRightCausal`, so every kernel's forward and backward are top-left.
    lse: the log-sum-exp's shape as the kernel returns it, converted to [b, h, s] by the wrapper.
    min_capability: the oldest CUDA compute capability it runs on (None: not a CUDA kernel).
    """

    dtypes: tuple[torch.dtype, ...]
    last_dim_contiguous: frozenset[str] = frozenset()
    contiguous: frozenset[str] = frozenset()
    head_dim_multiple: int = 1
    max_head_dim: int | None = None
    gqa: str = "native"
    causal: str = "top-left"
    lse: str = "[b, h, s]"
    min_capability: tuple[int, int] | None = None

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


# FlashAttention-2, as flash-attn and PyTorch's CUDA flash ops both run it: GQA native, bottom-right causal.
FLASH_ATTN_CONTRACT = KernelContract(
    dtypes=HALF_DTYPES, last_dim_contiguous=frozenset({"q", "k", "v", "out", "dout"}),
    contiguous=frozenset({"lse"}), head_dim_multiple=8, max_head_dim=256, causal="bottom-right",
    min_capability=(8, 0))


class AttentionKernel(Protocol):
    name: str
    contract: KernelContract
    # A kernel with forward_varlen / backward_varlen (burst/varlen.py) also has `use_varlen: bool`, part of its
    # interface: whether the ring packs a step's blocks into one varlen call. choice.py sets it once, when it builds
    # the kernel, from the varlen self-check; nothing toggles it after (the self-check tries the path directly).

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float) -> Grads: ...


class BottomRightCausal:
    """The top-left causal mask (burst's) from a kernel that aligns it bottom-right (FlashAttention 2/3/4);
    the two differ on rectangular blocks. With fewer queries than keys, top-left, no query reaches the keys
    past the last query row: they are cut off and get zero gradients. With more queries than keys, the rows
    past the last key see every key: a causal square and an unmasked block, one call each. Subclasses give
    the kernel's own calls as `block_forward` and `block_backward` (the `AttentionKernel` signatures)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        q_len, kv_len = q.shape[1], k.shape[1]
        if not causal or q_len == kv_len:
            return self.block_forward(q, k, v, causal, scale)
        if q_len < kv_len:
            return self.block_forward(q, k[:, :q_len], v[:, :q_len], True, scale)
        (square_out, square_lse), (rest_out, rest_lse) = (self.block_forward(q[:, :kv_len], k, v, True, scale),
                                                          self.block_forward(q[:, kv_len:], k, v, False, scale))
        return torch.cat([square_out, rest_out], 1), torch.cat([square_lse, rest_lse], 2)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> Grads:
        q_len, kv_len = q.shape[1], k.shape[1]
        if not causal or q_len == kv_len:
            return self.block_backward(dout, q, k, v, out, lse, causal, scale)
        if q_len < kv_len:
            dq, dk, dv = self.block_backward(dout, q, k[:, :q_len], v[:, :q_len], out, lse, True, scale)
            unseen = (0, 0, 0, 0, 0, kv_len - q_len)  # [b, s, h, d]: zero rows after the last seen key
            return dq, F.pad(dk, unseen), F.pad(dv, unseen)
        square, rest = slice(0, kv_len), slice(kv_len, None)
        dq_square, dk_square, dv_square = self.block_backward(
            dout[:, square], q[:, square], k, v, out[:, square], lse[:, :, square].contiguous(), True, scale)
        dq_rest, dk_rest, dv_rest = self.block_backward(
            dout[:, rest], q[:, rest], k, v, out[:, rest], lse[:, :, rest].contiguous(), False, scale)
        return torch.cat([dq_square, dq_rest], 1), dk_square + dk_rest, dv_square + dv_rest


def window_sizes(band: tuple[int, int], q_len: int, kv_len: int) -> tuple[int, int]:
    """(left, right) of FlashAttention's window_size, aligned bottom-right, for a band (lo, hi): key c is
    seen by query r iff r + kv_len - q_len - left <= c <= r + kv_len - q_len + right."""
    lo, hi = band
    return hi - (q_len - kv_len), (q_len - kv_len) - lo


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, s, h_kv, d] -> [b, s, h_kv * groups, d], locally only (never on the wire)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def sum_head_groups(g: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of `repeat_heads`: [b, s, h_kv * groups, d] -> [b, s, h_kv, d]."""
    if groups == 1:
        return g
    b, s, h, d = g.shape
    return g.view(b, s, h // groups, groups, d).sum(3)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
