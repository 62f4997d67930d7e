"""Every PyTorch CUDA op burst calls, run on meta tensors: torch's own meta functions (the shape rules
torch.compile and FakeTensor use) check the argument order, count and types, and give the shapes the real
kernels return, without a GPU. On top, each backward must receive the log-sum-exp exactly as its forward
returned it (shape, dtype, one dense buffer), after burst's round trip through [b, h, s].

torch 2.13's meta function for `_efficient_attention_backward` is itself broken (it lacks the schema's
`out` argument, so every later argument lands one place off): that one call is checked against the op's
schema instead, and a test notices when torch fixes it.
"""

import inspect

import pytest
import torch

from burst.kernels import TorchCUDAEfficientKernel, TorchCUDAFlashKernel, TorchCUDNNKernel
from tests import test_kernel_args as fakes
from tests.test_kernel_args import BLOCKS

META = torch.device("meta")
# kernel -> (forward op, backward op); each forward returns the log-sum-exp second, each backward takes `logsumexp`
OPS = {"flash": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
       "cudnn": ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"),
       "efficient": ("_efficient_attention_forward", "_efficient_attention_backward"),
       "flash varlen": ("_flash_attention_forward", "_flash_attention_backward")}
BROKEN_META = "_efficient_attention_backward"
SCHEMAS = {name: getattr(torch.ops.aten, name).default._schema for pair in OPS.values() for name in pair}


def bind(op_name: str, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by the op's schema names; raises on too many or unknown ones."""
    schema = SCHEMAS[op_name]
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    assert len(args) <= len(positional), f"{op_name}: {len(args)} positional arguments, the schema has {positional}"
    unknown = set(kwargs) - {a.name for a in schema.arguments}
    assert not unknown, f"{op_name}: no arguments {unknown} in {schema}"
    return dict(zip(positional, args, strict=False)) | kwargs


@pytest.fixture
def calls(monkeypatch):
    """Every forward and backward op call as (op, bound arguments, results), the real meta functions run."""
    made = []
    for forward, backward in OPS.values():
        for name in (forward, backward):
            real = getattr(torch.ops.aten, name)

            def record(*args, _name=name, _real=real, **kwargs):
                bound = bind(_name, args, kwargs)
                if _name == BROKEN_META:  # its grads as the op makes them: like query, key, value
                    results = (*(torch.empty_like(bound[n]) for n in ("query", "key", "value")), None)
                else:
                    results = _real(*args, **kwargs)
                made.append((_name, bound, results))
                return results

            monkeypatch.setattr(torch.ops.aten, name, record)
    return made


def meta_slices(heads: tuple[int, int], rows: slice, cols: slice) -> list[torch.Tensor]:
    """q, k, v, dout as the ring passes them: row slices of [2, 80, h, 64] bf16 shards, heads-first memory."""
    shard = lambda h: torch.empty(2, h, 80, 64, device=META, dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v, dout = shard(heads[0]), shard(heads[1]), shard(heads[1]), shard(heads[0])
    return [q[:, rows], k[:, cols], v[:, cols], dout[:, rows]]


def assert_lse_round_trip(calls: list, forward: str, backward: str) -> None:
    """Each backward got the log-sum-exp as the matching forward returned it: same shape and dtype, dense."""
    returned = [results[1] for name, _, results in calls if name == forward]
    given = [bound["logsumexp"] for name, bound, _ in calls if name == backward]
    assert len(returned) == len(given) > 0
    for out_lse, in_lse in zip(returned, given, strict=True):
        assert (in_lse.shape, in_lse.dtype) == (out_lse.shape, out_lse.dtype), (backward, in_lse.shape, out_lse.shape)
        assert in_lse.is_contiguous(), f"{backward} got a log-sum-exp with strides {in_lse.stride()}"


@pytest.mark.parametrize("kernel_class", [TorchCUDAFlashKernel, TorchCUDNNKernel, TorchCUDAEfficientKernel],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("block", BLOCKS)
def test_pytorch_ops_take_burst_arguments_by_their_meta_functions(calls, kernel_class, heads, block):
    rows, cols, causal = BLOCKS[block]
    q, k, v, dout = meta_slices(heads, rows, cols)
    kernel = kernel_class()
    out, lse = kernel.forward(q, k, v, causal, 0.3)
    assert (out.shape, out.dtype) == (q.shape, q.dtype)
    assert (lse.shape, lse.dtype) == ((2, heads[0], q.shape[1]), torch.float32)
    shard_lse = torch.empty(2, heads[0], 80, device=META)  # the ring slices the merged one from the shard's
    grads = kernel.backward(dout, q, k, v, out, shard_lse[:, :, rows].contiguous(), causal, 0.3)
    assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in (q, k, v)]
    assert_lse_round_trip(calls, *OPS[kernel_class.name])


def test_flash_varlen_ops_take_burst_arguments_by_their_meta_functions(calls):
    """Documents in one launch: packed [total, h, d] rows, int32 offsets, the log-sum-exp [h, total_q]."""
    offsets = torch.tensor([0, 48, 128, 160], dtype=torch.int32, device=META)
    q, dout = (torch.empty(160, 4, 64, device=META, dtype=torch.bfloat16) for _ in "qd")
    k, v = (torch.empty(160, 2, 64, device=META, dtype=torch.bfloat16) for _ in "kv")
    kernel = TorchCUDAFlashKernel()
    out, lse = kernel.forward_varlen(q, k, v, offsets, offsets, 80, 80, True, 0.3)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (4, 160), torch.float32)
    grads = kernel.backward_varlen(dout, q, k, v, out, lse, offsets, offsets, 80, 80, True, 0.3)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert_lse_round_trip(calls, *OPS["flash varlen"])


def test_flash_band_ops_take_burst_arguments_by_their_meta_functions(calls):
    """A sliding window's band blocks through the varlen ops' window sizes: every batch row one packed sequence."""
    q, k, v, dout = meta_slices((4, 2), slice(0, 64), slice(0, 80))
    kernel = TorchCUDAFlashKernel()
    out, lse = kernel.forward_band(q, k, v, (-60, 0), 0.3)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (2, 4, 64), torch.float32)
    grads = kernel.backward_band(dout, q, k, v, out, lse, (-60, 0), 0.3)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert_lse_round_trip(calls, *OPS["flash varlen"])
    # band (-60, 0): row r sees keys r..r + 60; aligned bottom-right (offset kv_len - q_len = 16) that is
    # r + 16 - 16 <= c <= r + 16 + 44
    assert {(bound["window_size_left"], bound["window_size_right"]) for _, bound, _ in calls} == {(16, 44)}


def test_torch_meta_for_the_efficient_backward_is_still_broken():
    """Why that one op skips its meta function above. When this fails, torch has fixed it: drop BROKEN_META."""
    q, k, v, dout = meta_slices((4, 4), slice(None), slice(None))
    kernel = TorchCUDAEfficientKernel()
    out, lse = kernel.forward(q, k, v, False, 0.3)
    with pytest.raises(TypeError, match="got multiple values for argument 'scale'"):
        kernel.backward(dout, q, k, v, out, lse, False, 0.3)


@pytest.mark.parametrize("op, fake", [
    ("_scaled_dot_product_cudnn_attention", fakes.fake_cudnn_forward),
    ("_scaled_dot_product_cudnn_attention_backward", fakes.fake_cudnn_backward),
    ("_scaled_dot_product_flash_attention", fakes.fake_flash_forward),
    ("_scaled_dot_product_flash_attention_backward", fakes.fake_flash_backward),
    ("_efficient_attention_forward", fakes.fake_efficient_forward),
    ("_efficient_attention_backward", fakes.fake_efficient_backward)], ids=lambda x: x if isinstance(x, str) else "")
def test_the_cpu_fakes_take_the_arguments_the_ops_take(op, fake):
    """tests/test_kernel_args.py's fakes stand in for these ops: as many positional arguments, and keywords the
    op has, so a call that suits a fake suits the op."""
    parameters = inspect.signature(fake).parameters.values()
    positional = [p for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keywords = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert len(positional) == len([a for a in SCHEMAS[op].arguments if not a.kwarg_only]), SCHEMAS[op]
    assert keywords <= {a.name for a in SCHEMAS[op].arguments if a.kwarg_only}, SCHEMAS[op]
