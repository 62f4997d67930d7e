"""The ring meets the strictest kernel contract (flash-attn's) on every call, checked on CPU.

No GPU runs in CI, and a CUDA kernel given a sliced lse does not fail: it reads the wrong
offsets and returns wrong gradients. `ContractCheckingKernel` wraps the CPU kernel and raises
on any argument flash-attn could not take as it is, so burst_attn run with it at 2 and 3 ranks
(causal and not, documents, GQA, both backward modes) shows the ring never passes one, while
the results still match the float64 reference.
"""

import contextlib

import pytest
import torch

import burst.operator
from burst.kernels import FLASH_ATTN_CONTRACT, KernelContract, TorchCPUKernel
from tests.distributed import run_on_ranks
from tests.test_burst_attn import check_against_reference
from tests.test_doc_mask import boundary_cases, check_case


class ContractCheckingKernel:
    """TorchCPUKernel that raises AssertionError when a call breaks `contract`, or when the
    kernel's results break the interface the ring relies on (out like q, lse [b, h, q_len] float32)."""

    name = "torch"

    def __init__(self, contract: KernelContract = FLASH_ATTN_CONTRACT):
        self.contract, self.inner = contract, TorchCPUKernel()
        self.calls = {"forward": 0, "backward": 0}

    def _check(self, call: str, causal: bool, **args: torch.Tensor) -> None:
        breaches = self.contract.breaches(**args)
        if causal and args["q"].shape[1] != args["k"].shape[1]:
            breaches.append(f"causal on a {args['q'].shape[1]} x {args['k'].shape[1]} block (only squares)")
        assert not breaches, f"{call} breaks the kernel contract: " + "; ".join(breaches)
        self.calls[call] += 1

    def forward(self, q, k, v, causal, scale):
        self._check("forward", causal, q=q, k=k, v=v)
        out, lse = self.inner.forward(q, k, v, causal, scale)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        self._check("backward", causal, dout=dout, q=q, k=k, v=v, out=out, lse=lse)
        grads = self.inner.backward(dout, q, k, v, out, lse, causal, scale)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        return grads


@contextlib.contextmanager
def using_kernel(kernel):
    """burst_attn uses `kernel` for every call inside the block, whatever it would select."""
    select = burst.operator.select_kernel
    burst.operator.select_kernel = lambda *_, **__: kernel
    try:
        yield kernel
    finally:
        burst.operator.select_kernel = select


def run_with_checking_kernel(fn, *args) -> dict[str, int]:
    """Run fn(*args) with burst_attn's kernel replaced by a ContractCheckingKernel; its call counts."""
    with using_kernel(ContractCheckingKernel()) as kernel:
        fn(*args)
    return kernel.calls


def _all_configurations(rank, world_size):
    """Every configuration in bf16 (flash-attn's dtypes), against the float64 reference."""
    for mode in ("burst", "ring"):
        for heads in ((4, 4), (4, 2)):
            for causal in (True, False):
                calls = run_with_checking_kernel(check_against_reference, world_size, causal, heads,
                                                 torch.bfloat16, mode)
                assert calls["forward"] > 0 and calls["backward"] > 0
            documents = boundary_cases(world_size)
            for causal, case in ((True, "short docs"), (True, "mixed rows"), (False, "short docs")):
                run_with_checking_kernel(check_case, world_size, documents[case], causal, heads, torch.bfloat16, mode)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_meets_the_flash_attn_contract(world_size):
    run_on_ranks(_all_configurations, world_size)


def test_checking_kernel_refuses_a_sliced_lse():
    """The check itself: the lse slice the ring used to pass is refused, its contiguous copy taken."""
    q, k, v, dout = (torch.randn(1, 8, 2, 16, dtype=torch.bfloat16) for _ in range(4))
    kernel = ContractCheckingKernel()
    out, lse = kernel.forward(q, k, v, True, 0.25)
    full_lse = torch.cat([lse, lse], dim=2)  # [b, h, 16]: the whole shard's rows
    with pytest.raises(AssertionError, match="lse is not contiguous"):
        kernel.backward(dout, q, k, v, out, full_lse[:, :, 8:], True, 0.25)
    kernel.backward(dout, q, k, v, out, full_lse[:, :, 8:].contiguous(), True, 0.25)
    with pytest.raises(AssertionError, match="dtype"):
        kernel.forward(q.float(), k.float(), v.float(), False, 0.25)
    with pytest.raises(AssertionError, match="stride"):
        kernel.forward(q, k.transpose(1, 3).contiguous().transpose(1, 3), v, False, 0.25)
