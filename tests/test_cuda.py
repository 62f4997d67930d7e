"""CUDA kernels against the math kernel, on the sliced inputs the ring passes, for every CUDA kernel this
machine has (PyTorch's flash, efficient and cuDNN; flash-attn, FlashAttention-3 and -4 where installed), their
varlen paths (documents in one launch), and burst_attn on one GPU with each of them: GQA, documents and prefix
sharing.

Skipped without a GPU; run on a GPU machine with `pytest tests/test_cuda.py` (scripts/gpu_check.sh does; the
one test here that runs without a GPU checks that script says it needs pytest).
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch

import burst
from burst.kernels import MathKernel, TorchCUDAEfficientKernel, candidates, detect_machine, select_kernel, self_check
from burst.kernels.choice import KERNEL_CLASSES
from burst.kernels.selfcheck import varlen_self_check
from burst.ring import output_with_delta, row_dot
from tests.test_kernel_contract import using_kernel

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_kernels() -> list[type]:
    """Every CUDA kernel class this machine has that takes bf16 at head dim 64, fastest first."""
    if not torch.cuda.is_available():
        return []
    return [KERNEL_CLASSES[name] for name in candidates(detect_machine(torch.device("cuda")), torch.bfloat16, 64)]


KERNELS = cuda_kernels()
SCALE = 0.1  # not head dim 64's default (0.125): a kernel that ignores it fails
OUT_TOLERANCE, LSE_TOLERANCE, GRAD_TOLERANCE = 2e-2, 1e-3, 5e-2  # bf16 inputs against float32 math


def assert_close(name: str, got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    """Max error within `tolerance`, relative to the largest expected value where that is over 1
    (a bf16 result of magnitude 8 is only stored to 1/32)."""
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    err = (got.float() - expected.float()).abs().max().item()
    bound = tolerance * max(1.0, expected.float().abs().max().item())
    assert err < bound, f"{name}: max error {err:.2e}, allowed {bound:.2e}"


@needs_gpu
@pytest.mark.parametrize("kernel_class", KERNELS, ids=lambda c: c.name)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal, cols", [(True, "square"), (True, "whole"), (False, "first")],
                         ids=["causal", "causal-fewer-queries", "full"])
def test_kernel_on_ring_slices_matches_math(kernel_class, heads, causal, cols):
    """The views the ring passes: one zigzag chunk of a rank's shard, all batch rows (not contiguous),
    lse sliced from the shard's [b, h, s] and made contiguous, out the real one or burst mode's O'.
    Causal is top-left, also on a block of fewer queries than keys."""
    chunk = 192  # not a multiple of the kernels' 128-row tiles
    g = torch.Generator(device="cuda").manual_seed(0)
    shard = lambda kv_heads: torch.randn(2, 2 * chunk, kv_heads, 64, device="cuda", generator=g,  # noqa: E731
                                         dtype=torch.bfloat16)
    q_shard, k_shard, v_shard, dout_shard = shard(heads[0]), shard(heads[1]), shard(heads[1]), shard(heads[0])
    b, rows = slice(None), slice(chunk, None)
    cols = {"square": rows, "whole": slice(None), "first": slice(0, chunk)}[cols]
    q, k, v, dout = q_shard[b, rows], k_shard[b, cols], v_shard[b, cols], dout_shard[b, rows]
    assert not (q.is_contiguous() or k.is_contiguous())

    kernel, ref = kernel_class(), MathKernel()
    out, lse = kernel.forward(q, k, v, causal, SCALE)
    ref_out, ref_lse = ref.forward(q, k, v, causal, SCALE)
    assert lse.dtype == torch.float32 and out.dtype == q.dtype
    assert_close("out", out, ref_out, OUT_TOLERANCE)
    assert_close("lse", lse, ref_lse, LSE_TOLERANCE)

    lse_shard = torch.zeros(2, heads[0], 2 * chunk, device="cuda")
    lse_shard[b, :, rows] = ref_lse
    ref_grads = ref.backward(dout, q, k, v, ref_out, ref_lse, causal, SCALE)
    stand_in = output_with_delta(dout, row_dot(dout, ref_out))  # what burst mode passes for another rank's rows
    for out_name, out_arg in (("out", ref_out), ("O'", stand_in)):
        grads = kernel.backward(dout, q, k, v, out_arg, lse_shard[b, :, rows].contiguous(), causal, SCALE)
        for name, got, expected in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
            assert_close(f"{name} with {out_name}", got, expected, GRAD_TOLERANCE)


@needs_gpu
@pytest.mark.parametrize("kernel_class", KERNELS, ids=lambda c: c.name)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("documents", ["one-doc", "documents", "prefix-sharing"])
@pytest.mark.parametrize("varlen", [False, True], ids=["per-document", "varlen"])
@pytest.mark.parametrize("mode", ["burst", "ring"])
def test_burst_attn_on_one_gpu_matches_math(kernel_class, heads, documents, varlen, mode):
    if varlen and (documents == "one-doc" or not hasattr(kernel_class, "forward_varlen")):
        pytest.skip("varlen needs documents and a kernel with a varlen path")
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 1024, heads[0], 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1024, heads[1], 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "kv")
    dout = torch.randn_like(q)
    cut = {"one-doc": {}, "documents": {"doc_boundaries": [torch.tensor([0, 300, 301, 700, 1024])] * 2},
           "prefix-sharing": {"doc_boundaries": [torch.tensor([0, 500, 700, 900, 1024])] * 2,
                              "doc_sees": [torch.tensor([-1, 0, 0, -1])] * 2}}[documents]
    kernel = kernel_class()
    kernel.use_varlen = varlen
    results = []
    for each in (kernel, MathKernel()):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with using_kernel(each):
            out = burst.burst_attn(*leaves, backward=mode, **cut)
            out.backward(dout)
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, got, expected in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert_close(name, got, expected, OUT_TOLERANCE if name == "out" else GRAD_TOLERANCE)


@needs_gpu
@pytest.mark.parametrize("kernel_class", KERNELS, ids=lambda c: c.name)
@pytest.mark.parametrize("head_dim, groups", [(64, 1), (128, 4)])
def test_every_kernel_passes_its_self_check(kernel_class, head_dim, groups):
    """What `auto` checks before using a kernel: it must pass here, or the machine runs slower than it could."""
    device = torch.device("cuda")
    if kernel_class.contract.unsupported(torch.bfloat16, head_dim):
        pytest.skip(f"{kernel_class.name} does not take head_dim {head_dim}")
    kernel = kernel_class()
    assert self_check(kernel, device, torch.bfloat16, head_dim, groups) is None
    if hasattr(kernel, "forward_varlen"):
        assert varlen_self_check(kernel, device, torch.bfloat16, head_dim, groups) is None


@needs_gpu
def test_burst_attn_takes_inputs_with_a_strided_last_dimension():
    """Made contiguous once at the boundary: every CUDA kernel needs stride(-1) == 1."""
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(1, 64, 4, 256, device="cuda", generator=g, dtype=torch.bfloat16).permute(0, 3, 2, 1)
               for _ in "qkv")  # [1, 256, 4, 64] views with stride(-1) = 1024
    assert q.stride(-1) != 1
    out = burst.burst_attn(q, k, v)
    with using_kernel(MathKernel()):
        ref = burst.burst_attn(q, k, v)
    assert_close("out", out, ref, OUT_TOLERANCE)


@needs_gpu
def test_auto_selection_on_this_gpu():
    """auto takes the fastest kernel that passes its self-check; float32 and odd head dims get efficient."""
    device = torch.device("cuda")
    best = select_kernel(device, torch.bfloat16, "auto", head_dim=128, groups=4)
    assert best.name in candidates(detect_machine(device), torch.bfloat16, 128)
    assert self_check(best, device, torch.bfloat16, 128, 4) is None
    assert type(select_kernel(device, torch.float32, "auto", head_dim=128)) is TorchCUDAEfficientKernel
    assert type(select_kernel(device, torch.bfloat16, "auto", head_dim=100)) is TorchCUDAEfficientKernel


def test_gpu_check_says_it_needs_pytest(tmp_path):
    """Run where pytest is not installed, scripts/gpu_check.sh says so in one line before doing anything."""
    shim = tmp_path / "bin" / "python"
    shim.parent.mkdir()
    shim.write_text('#!/bin/sh\ncase "$*" in *"import pytest"*) exit 1;; esac\nexit 3\n')
    shim.chmod(0o755)
    script = Path(__file__).parents[1] / "scripts" / "gpu_check.sh"
    result = subprocess.run(["bash", str(script), str(tmp_path / "run")], capture_output=True, text=True,
                            env={**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}"})
    assert result.returncode == 2
    assert result.stderr == ("error: scripts/gpu_check.sh runs tests/test_cuda.py with pytest, which is not installed "
                             'here: pip install -e ".[dev]" (or pip install pytest)\n')
    assert not (tmp_path / "run").exists()
