"""CUDA paths: local kernels against the math reference, and burst_attn on one GPU.

Skipped without a GPU; run on a GPU machine with `pytest tests/test_cuda.py`.
"""

import importlib.util

import pytest
import torch

import burst
from burst.kernels import FlashAttnKernel, MathKernel, TorchCUDAKernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KERNELS = [TorchCUDAKernel] + ([FlashAttnKernel] if importlib.util.find_spec("flash_attn") else [])


@pytest.mark.parametrize("kernel_class", KERNELS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_len, kv_len, heads", [(256, 256, (8, 8)), (128, 256, (8, 2)), (256, 128, (4, 4))])
def test_cuda_kernel_matches_math(kernel_class, causal, q_len, kv_len, heads):
    if causal and q_len != kv_len:
        pytest.skip("the library only asks for causal blocks on squares")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, q_len, heads[0], 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, kv_len, heads[1], 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "kv")
    dout = torch.randn_like(q)
    kernel, ref = kernel_class(), MathKernel()
    out, lse = kernel.forward(q, k, v, causal, 0.125)
    ref_out, ref_lse = ref.forward(q, k, v, causal, 0.125)
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert (out.float() - ref_out.float()).abs().max() < 2e-2
    assert (lse - ref_lse).abs().max() < 1e-3
    grads = kernel.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.125)
    ref_grads = ref.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.125)
    for g_, r in zip(grads, ref_grads, strict=True):
        assert g_.shape == r.shape
        assert (g_.float() - r.float()).abs().max() < 5e-2


def test_burst_attn_on_one_gpu_matches_sdpa():
    q, k, v = (torch.randn(1, 1024, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    out = burst.burst_attn(q, k, v, doc_boundaries=[torch.tensor([0, 300, 1024])])
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = burst.burst_attn(q2, k2, v2, kernel="math", doc_boundaries=[torch.tensor([0, 300, 1024])])
    ref.sum().backward()
    assert (out.float() - ref.float()).abs().max() < 2e-2
    assert (q.grad.float() - q2.grad.float()).abs().max() < 5e-2
