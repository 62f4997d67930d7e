"""The chunked cross-entropy: same value and gradients as F.cross_entropy, without [N, vocab] logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from models import chunked_cross_entropy


def plain_cross_entropy(hidden, weight, labels):
    return F.cross_entropy(hidden.float() @ weight.float().t(), labels, reduction="sum")


def inputs(n: int, dim: int, vocab: int, dtype=torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, dim, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=generator) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=generator)
    labels[::5] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_matches_plain_cross_entropy(chunk_size):
    hidden, weight, labels = inputs(n=61, dim=16, vocab=300)
    loss_sum, count = chunked_cross_entropy(hidden, weight, labels, chunk_size)
    (2.5 * loss_sum).backward()
    grads = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    expected = plain_cross_entropy(hidden, weight, labels)
    (2.5 * expected).backward()
    assert count.item() == (labels != -100).sum().item()
    torch.testing.assert_close(loss_sum, expected, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_computes_in_float32():
    """CPU training: bf16 autocast over float32 weights keeps the logits float32."""
    hidden, weight, labels = inputs(n=40, dim=32, vocab=500, dtype=torch.bfloat16)
    weight = weight.detach().float().requires_grad_()  # the float32 master weight autocast runs over
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_sum, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=16)
    loss_sum.backward()
    assert loss_sum.dtype == torch.float32
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    # Against float32 logits of the same bf16 numbers: only the hidden gradient's final rounding differs.
    hidden32, weight32 = (t.detach().float().requires_grad_() for t in (hidden, weight))
    expected = plain_cross_entropy(hidden32, weight32, labels)
    expected.backward()
    torch.testing.assert_close(loss_sum, expected, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(hidden.grad.float(), hidden32.grad, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(weight.grad, weight32.grad, rtol=1e-5, atol=1e-6)


class MatmulDtypes(TorchDispatchMode):
    """Records the input dtype of every matrix multiply, and of every logsumexp."""

    def __init__(self):
        super().__init__()
        self.matmuls, self.logsumexps = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.matmuls.add(args[-1].dtype)
        if func.overloadpacket is torch.ops.aten.logsumexp:
            self.logsumexps.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_bf16_head_runs_the_matmuls_in_bf16_with_a_float32_logsumexp():
    """Under FSDP mixed precision on CUDA, hidden and the gathered weight are both bf16."""
    hidden, weight, labels = inputs(n=40, dim=32, vocab=500, dtype=torch.bfloat16)
    with MatmulDtypes() as seen:
        loss_sum, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=16)
        loss_sum.backward()
    assert seen.matmuls == {torch.bfloat16} and seen.logsumexps == {torch.float32}
    assert loss_sum.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    # Against float32 logits of the same bf16 numbers: within bf16's rounding of the logits.
    hidden32, weight32 = (t.detach().float().requires_grad_() for t in (hidden, weight))
    expected = plain_cross_entropy(hidden32, weight32, labels)
    expected.backward()
    torch.testing.assert_close(loss_sum, expected, rtol=2e-3, atol=1e-2)
    for got, want in ((hidden.grad, hidden32.grad), (weight.grad, weight32.grad)):
        # relative to the whole gradient: single entries that cancel to ~0 have no relative precision in bf16
        assert (got.float() - want).norm() / want.norm() < 1e-2


class LargestTensor(TorchDispatchMode):
    """Records the most elements any single op produced (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def memory_profile(loss_fn, n: int, dim: int, vocab: int) -> tuple[int, int]:
    """(largest tensor any op creates, elements saved for backward) for one forward + backward."""
    hidden, weight, labels = inputs(n, dim, vocab)
    saved = []
    with LargestTensor() as largest, torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss_fn(hidden, weight, labels).backward()
    return largest.numel, sum(saved)


def test_memory_does_not_grow_with_tokens_times_vocab():
    n, dim, vocab, chunk = 1024, 16, 2048, 256
    chunked = lambda h, w, y: chunked_cross_entropy(h, w, y, chunk)[0]
    # The instrument sees full logits when they exist (so the assertions below can fail) ...
    plain_largest, plain_saved = memory_profile(plain_cross_entropy, n, dim, vocab)
    assert plain_largest >= n * vocab and plain_saved >= n * vocab
    # ... and the chunked loss never creates more than one chunk of logits nor saves any,
    largest, saved = memory_profile(chunked, n, dim, vocab)
    assert largest <= max(chunk * vocab, vocab * dim)
    assert saved <= n * dim + vocab * dim + 3 * n
    # so 4x more tokens leave its largest allocation unchanged.
    assert memory_profile(chunked, 4 * n, dim, vocab)[0] == largest


def test_bad_shapes_are_refused():
    hidden, weight, labels = inputs(n=8, dim=16, vocab=32)
    with pytest.raises(ValueError, match=r"expects hidden \[N, dim\].*got \(8, 16\), \(32, 16\), \(7,\)"):
        chunked_cross_entropy(hidden, weight, labels[:7])
