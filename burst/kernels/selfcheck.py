"""Each kernel checked once against the math kernel before the ring uses it.

A kernel that gives different numbers must not train a model: on a small input of the real
dtype, head dim and GQA grouping, laid out as the ring passes it (row slices of a shard: a
square causal block, a causal block of fewer queries than keys, a rectangular unmasked one),
at a scale that is not the default, the forward's out and lse and the backward's three
gradients, given the row's merged lse and output rather than the block's own, are compared
with `MathKernel`'s. A kernel that disagrees or
raises is refused with the reason; choice.py then tries the next one, so an untested kernel
can make a run slower, never change its numbers.
"""

from __future__ import annotations

import torch

from burst.kernels.contract import AttentionKernel
from burst.kernels.math import MathKernel

# Allowed max error, relative to max(1, |largest expected value|), of (out, lse, grads) per dtype:
# a fused kernel rounds its probabilities to the input dtype before the second matmul.
TOLERANCES = {
    torch.bfloat16: (2e-2, 1e-3, 5e-2),
    torch.float16: (5e-3, 1e-3, 1e-2),
    torch.float32: (5e-3, 1e-3, 1e-2),  # TF32 may be on for a GPU's float32 matmuls, the reference's too
    torch.float64: (1e-8, 1e-8, 1e-8),
}
CHUNK = 80  # rows of one zigzag chunk in the check: not a multiple of any kernel's tile
BATCH, KV_HEADS = 2, 2
SCALE_FACTOR = 0.75  # of the default 1/sqrt(head_dim): a kernel that ignores the scale it is given fails


def one_line(error: BaseException) -> str:
    """`error` as "Type: first line of its message" (a kernel's errors run to pages)."""
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0]}" if message else type(error).__name__


def _max_error(name: str, got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> str | None:
    """Why `got` is not `expected` within `tolerance`; None when it is."""
    if tuple(got.shape) != tuple(expected.shape):
        return f"{name} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if got.dtype != expected.dtype:
        return f"{name} has dtype {got.dtype}, expected {expected.dtype}"
    err = (got.double() - expected.double()).abs().max().item()
    bound = tolerance * max(1.0, expected.double().abs().max().item())
    if not err <= bound:  # NaN fails too
        return f"{name} differs from the math kernel by {err:.3g} (allowed {bound:.3g})"
    return None


def check_block(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                mask: bool | tuple[int, int], scale: float, generator: torch.Generator) -> str | None:
    """What `kernel` gets wrong on one block against the math kernel; None when nothing. `mask`: the causal
    flag (`forward`/`backward`), or a band (lo, hi) (`forward_band`/`backward_band`, its "band" path).

    The backward is given what the ring gives it: the whole row's merged lse and output, not the block's
    own. Another block's share of each row (its lse within a few units of this block's, its output random)
    is merged in, so a kernel that recomputes its own lse, or its own D from its own output, is caught."""
    out_tol, lse_tol, grad_tol = TOLERANCES[q.dtype]
    band = isinstance(mask, tuple)
    forward, backward, path = ((kernel.forward_band, kernel.backward_band, "band ") if band
                               else (kernel.forward, kernel.backward, ""))
    reference = MathKernel()
    ref_out, ref_lse = reference.forward(q, k, v, mask, scale)  # the math kernel takes a band as its mask
    out, lse = forward(q, k, v, mask, scale)
    problem = (_max_error(f"{path}forward out", out, ref_out, out_tol)
               or _max_error(f"{path}forward lse", lse, ref_lse, lse_tol))
    if problem:
        return problem
    other_lse = ref_lse - 3 * torch.rand(ref_lse.shape, generator=generator, device=q.device)
    other_out = torch.randn(ref_out.shape, generator=generator, device=q.device)
    merged_lse = torch.logaddexp(ref_lse, other_lse)  # [b, h, s]
    share = torch.exp(ref_lse - merged_lse).transpose(1, 2).unsqueeze(-1)  # this block's weight, [b, s, h, 1]
    merged_out = (ref_out.float() * share + other_out * (1 - share)).to(q.dtype)
    ref_grads = reference.backward(dout, q, k, v, merged_out, merged_lse, mask, scale)
    grads = backward(dout, q, k, v, merged_out, merged_lse, mask, scale)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        if problem := _max_error(f"{path}backward {name}", got, expected, grad_tol):
            return problem
    return None


def _shards(generator: torch.Generator, device: torch.device, dtype: torch.dtype, head_dim: int,
            groups: int) -> list[torch.Tensor]:
    """q, k, v, dout of one rank's shard: [b, 2 chunks, heads, d] in heads-first memory, as the ring's."""
    def shard(heads: int) -> torch.Tensor:
        x = torch.randn(BATCH, heads, 2 * CHUNK, head_dim, generator=generator, device=device, dtype=torch.float32)
        return x.to(dtype).transpose(1, 2)

    return [shard(KV_HEADS * groups), shard(KV_HEADS), shard(KV_HEADS), shard(KV_HEADS * groups)]


def self_check(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int,
               groups: int = 1) -> str | None:
    """Why `kernel` must not be used for these inputs (one line), or None when it agrees with the
    math kernel on the ring's kinds of block, at a scale that is not the default. Uses its own random
    generator: the run's random state is left as it was."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = _shards(generator, device, dtype, head_dim, groups)
    later, first, whole = slice(CHUNK, None), slice(0, CHUNK), slice(None)
    blocks = (("a causal square block", later, later, True),
              # top-left: query row i sees key rows 0..i, so a bottom-right kernel fails here
              ("a causal block of fewer queries than keys", later, whole, True),
              ("an unmasked block of the whole shard against half of one", whole, first, False))
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            for what, rows, cols, causal in blocks:
                if problem := check_block(kernel, q[:, rows], k[:, cols], v[:, cols], dout[:, rows], causal,
                                          SCALE_FACTOR * head_dim ** -0.5, generator):
                    return f"{problem} on {what}"
    except Exception as error:  # noqa: BLE001 - any failure of a kernel refuses it, with its message
        return f"it raised {one_line(error)}"
    return None


def varlen_self_check(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int,
                      groups: int = 1) -> str | None:
    """Why `kernel`'s varlen path (burst/varlen.py) must not be used, or None when a step of documents
    packed into one call per causal flag (causal squares of three lengths, two prefix-shared rectangles,
    rows of two batch entries) gives the math kernel's results block by block."""
    from burst.varlen import backward_blocks, forward_blocks  # varlen imports the kernels' contract

    generator = torch.Generator(device=device).manual_seed(1)
    shard = lambda heads: torch.randn(BATCH, 2 * CHUNK, heads, head_dim, generator=generator,  # noqa: E731
                                      device=device, dtype=torch.float32).to(dtype)
    q, k, v, dout = shard(KV_HEADS * groups), shard(KV_HEADS), shard(KV_HEADS), shard(KV_HEADS * groups)
    rectangles = [(slice(0, 1), slice(0, 48), slice(0, 48), True),  # (batch rows, query rows, key rows, causal)
                  (slice(1, 2), slice(48, 128), slice(48, 128), True),
                  (slice(0, 2), slice(128, 144), slice(128, 144), True),
                  (slice(0, 1), slice(48, 128), slice(0, 48), False),
                  (slice(1, 2), slice(128, 160), slice(0, 48), False)]
    forward = [(q[b, r], k[b, c], v[b, c], causal) for b, r, c, causal in rectangles]
    out_tol, lse_tol, grad_tol = TOLERANCES[dtype]
    reference, scale = MathKernel(), head_dim ** -0.5
    try:  # the varlen path tried as such: the kernel itself is not changed (choice.py sets its use_varlen once)
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            results = forward_blocks(kernel, forward, scale, varlen=True)
            backward = []
            for (bq, bk, bv, causal), (out, lse), (b, r, _, _) in zip(forward, results, rectangles, strict=True):
                ref_out, ref_lse = reference.forward(bq, bk, bv, causal, scale)
                if problem := (_max_error("varlen forward out", out, ref_out, out_tol)
                               or _max_error("varlen forward lse", lse, ref_lse, lse_tol)):
                    return problem
                backward.append((dout[b, r], bq, bk, bv, ref_out, ref_lse, causal))
            for block, grads in zip(backward, backward_blocks(kernel, backward, scale, varlen=True), strict=True):
                expected = reference.backward(*block[:6], block[6], scale)
                for name, got, want in zip(("dq", "dk", "dv"), grads, expected, strict=True):
                    if problem := _max_error(f"varlen backward {name}", got, want, grad_tol):
                        return problem
    except Exception as error:  # noqa: BLE001 - any failure turns varlen off, with its message
        return f"it raised {one_line(error)}"
    return None


# (query rows, key rows, band) of the band check: a window's edge (an upper triangle), a wider band block, and the
# whole blocks a kernel taking the window natively gets: a window of 40 along a diagonal (several of the CPU kernel's
# strips), and twice as many keys as queries under a band cut on both sides
BAND_BLOCKS = ((slice(0, CHUNK), slice(0, CHUNK), (1 - CHUNK, 0)),
               (slice(CHUNK, CHUNK + 64), slice(0, 100), (-60, 0)),
               (slice(0, 2 * CHUNK), slice(0, 2 * CHUNK), (0, 39)),
               (slice(CHUNK, 2 * CHUNK), slice(0, 2 * CHUNK), (-100, 20)))


def band_self_check(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, head_dim: int,
                    groups: int = 1) -> str | None:
    """Why `kernel`'s band path (`forward_band` / `backward_band`, burst/kernels/contract.py) must not be
    used, or None when it gives the math kernel's results on blocks cut by a sliding window's band, as
    `self_check` checks a block: a scale that is not the default, the backward given a merged lse."""
    generator = torch.Generator(device=device).manual_seed(2)
    q, k, v, dout = _shards(generator, device, dtype, head_dim, groups)
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            for rows, cols, band in BAND_BLOCKS:
                if problem := check_block(kernel, q[:, rows], k[:, cols], v[:, cols], dout[:, rows], band,
                                          SCALE_FACTOR * head_dim ** -0.5, generator):
                    return f"{problem} on band {band}"
    except Exception as error:  # noqa: BLE001 - any failure sends band blocks to the math kernel, with its message
        return f"it raised {one_line(error)}"
    return None
