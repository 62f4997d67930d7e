"""Tri Dao's FlashAttention packages, each imported only when its kernel is built: flash-attn 2
(`flash_attn`), FlashAttention-3 (`flash_attn_interface` / `flash_attn_3`, built from source for Hopper) and
FlashAttention-4 (`flash_attn.cute`, the `flash-attn-4` wheel, CuTe DSL; pre-releases only).

All take the library's sequence-major [b, s, h, d] layout with any strides but the last, GQA natively, and
align causal masks bottom-right (`BottomRightCausal` makes them top-left, burst's convention).

Finding them imports nothing: a parent package's __init__ may load a CUDA extension that fails on this
machine, and the FA4 wheel installs `flash_attn/cute` alone, with no `flash_attn/__init__.py` and so no
`flash_attn.__version__`. Their private entry points change between releases (FA3's forward `out` became
`out_` in Nov 2025, its backward `causal` became `is_causal` in July 2025), so each call is built from the
function's own parameter names (`LibraryFunction`), never from a version string; a function that lacks a
parameter burst needs is refused in one line when the kernel is built, and a kernel that raises or
disagrees with the math kernel is refused by the self-check (burst/kernels/selfcheck.py).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType

import torch
from torch.torch_version import TorchVersion

from burst.kernels.contract import FLASH_ATTN_CONTRACT, HALF_DTYPES, BottomRightCausal, KernelContract, window_sizes
from burst.kernels.cuda import packed_lse

FLASH_ATTN_MIN_VERSION = "2.7"
FA4_TESTED_VERSION = "4.0.0b40"  # the FA4 pre-release whose signatures tests/test_kernel_packages.py reads
FA3_MODULES = ("flash_attn_3.flash_attn_interface", "flash_attn_interface")
FA4_MODULE = "flash_attn.cute.interface"
FA2_MODULE = "flash_attn.flash_attn_interface"

# What to run when a kernel is missing; each works as written (FA4 has pre-releases only, so a plain
# `pip install flash-attn-4` finds nothing).
INSTALL_HINTS = {
    "flash-attn": f"pip install 'flash-attn>={FLASH_ATTN_MIN_VERSION}' --no-build-isolation (it compiles, for about "
                  "an hour, unless a prebuilt wheel matches this torch and CUDA)",
    "fa3": "FlashAttention-3 has no wheel: build it in flash-attention's hopper/ folder "
           "(pip install . --no-build-isolation)",
    "fa4": f"pip install 'flash-attn-4=={FA4_TESTED_VERSION}' (pre-releases only; 'flash-attn-4[cu13]=="
           f"{FA4_TESTED_VERSION}' on CUDA 13)",
}


def module_file(dotted: str) -> Path | None:
    """The source file of module `dotted` (a.b.c -> .../a/b/c.py) when it is installed, found without
    importing anything (None when it is not)."""
    top, *rest = dotted.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is executed
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        return None
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin and Path(spec.origin).is_file() else None
    for location in spec.submodule_search_locations or ():
        candidate = Path(location, *rest[:-1], rest[-1] + ".py")
        if candidate.is_file():
            return candidate
    return None


def installed_flash_attn_version() -> TorchVersion | None:
    """flash-attn 2's version when it is installed, else None; from its package metadata, or from a source
    tree's `flash_attn/__init__.py`, never by importing it. A `flash_attn` package without
    `flash_attn_interface` is the FA4 wheel's alone, not flash-attn 2."""
    interface = module_file(FA2_MODULE)
    if interface is None:
        return None
    try:
        return TorchVersion(importlib.metadata.version("flash-attn"))
    except importlib.metadata.PackageNotFoundError:  # a source tree on the path, without metadata
        init = interface.with_name("__init__.py")
        found = init.is_file() and re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", init.read_text(), re.MULTILINE)
        return TorchVersion(found.group(1)) if found else None


def fa3_installed() -> bool:
    return any(module_file(name) is not None for name in FA3_MODULES)


def fa4_installed() -> bool:
    return module_file(FA4_MODULE) is not None


def import_kernel_module(kernel: str, names: tuple[str, ...]) -> ModuleType:
    """The first of modules `names` that is installed, imported. ModuleNotFoundError when none is; any other
    failure of the import (a dependency missing, a CUDA extension built for another
    torch) propagates as it is, and the kernel is refused with it in one line (choice.py)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as error:
            parts = name.split(".")
            if error.name not in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
                raise  # the module is there, one of its dependencies is not
    raise ModuleNotFoundError(f"{kernel} is not installed (none of {', '.join(names)})")


def parameter_names(function) -> tuple[str, ...]:
    """The names of `function`'s parameters, in order. A torch.library.custom_op (FlashAttention-3 from July
    2025, flash-attn 2 from 2.7) shows only (*args, **kwargs) to inspect.signature: its schema names them."""
    schema = getattr(getattr(function, "_opoverload", None), "_schema", None)
    if schema is not None:
        return tuple(argument.name for argument in schema.arguments)
    return tuple(inspect.signature(function).parameters)


class LibraryFunction:
    """A private entry point of a kernel package, called by keyword under the names this release gives its
    parameters. Resolved once, when the kernel is built: a release that lacks a parameter burst passes is
    refused then, in one line naming the release's parameters."""

    def __init__(self, module: ModuleType, name: str, library: str) -> None:
        self.function, self.where = getattr(module, name), f"{library}'s {module.__name__}.{name}"
        self.parameters = parameter_names(self.function)

    def name(self, *choices: str) -> str:
        """The first of `choices` (the newest name first) that this release takes."""
        for choice in choices:
            if choice in self.parameters:
                return choice
        raise TypeError(f"{self.where} takes no {' or '.join(map(repr, choices))} parameter (it takes "
                        f"{', '.join(self.parameters)}): a release burst does not know")

    def names(self, *required: str) -> None:
        """Refuse a release that lacks any of `required`."""
        for name in required:
            self.name(name)

    def unused(self, *names: str) -> dict[str, None]:
        """None for each of `names` this release takes: features burst does not use, which some releases
        take without a default (FA3 until September 2025) and others renamed or dropped."""
        return dict.fromkeys(name for name in names if name in self.parameters)

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)

    def window(self, left: int, right: int) -> dict:
        """The keywords of a sliding window (left, right) in this release's names (the band path,
        burst/kernels/contract.py); a release with none raises, and the self-check leaves bands to the math kernel."""
        if "window_size_left" in self.parameters:
            return {"window_size_left": left, "window_size_right": right}
        return {self.name("window_size"): (left, right)}


class BandByWindow:
    """`forward_band` / `backward_band` (burst/kernels/contract.py) through a kernel's bottom-right
    window sizes: its `block_forward` / `block_backward` with a `window` (left, right) keyword."""

    def forward_band(self, q, k, v, band, scale):
        return self.block_forward(q, k, v, False, scale, window=window_sizes(band, q.shape[1], k.shape[1]))

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        return self.block_backward(dout, q, k, v, out, lse, False, scale,
                                   window=window_sizes(band, q.shape[1], k.shape[1]))


class FlashAttnKernel(BandByWindow, BottomRightCausal):
    """flash-attn >= 2.7 (the keyword API of `_flash_attn_forward/_backward`, the same through 2.8.3):
    FlashAttention-2.

    Contract: `FLASH_ATTN_CONTRACT`. The backward takes lse as a pointer to a dense [b, h, q_len]
    buffer, so a sliced lse would be read wrongly (no error): it is made contiguous here.
    """

    name = "flash-attn"
    contract = FLASH_ATTN_CONTRACT

    def __init__(self) -> None:
        self._fa = import_kernel_module(self.name, (FA2_MODULE,))

    def block_forward(self, q, k, v, causal, scale, window=(-1, -1)):
        out, lse, *_ = self._fa._flash_attn_forward(
            q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=window[0],
            window_size_right=window[1], softcap=0.0, alibi_slopes=None, return_softmax=False)
        return out, lse

    def block_backward(self, dout, q, k, v, out, lse, causal, scale, window=(-1, -1)):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_backward(
            dout, q, k, v, out, lse.contiguous(), dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=window[0], window_size_right=window[1], softcap=0.0, alibi_slopes=None,
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


class FlashAttn3Kernel(BandByWindow, BottomRightCausal):
    """FlashAttention-3 (Hopper, sm90): `_flash_attn_forward/_backward` of `flash_attn_interface`, from its
    January 2025 rewrite on (tests/test_kernel_packages.py holds its May, October and November 2025
    signatures). What changed since, and is followed here by parameter name: every feature
    argument required until September 2025 (burst passes None for those a release takes), the backward's
    `causal` renamed `is_causal` (July 2025), the forward's `out` renamed `out_` (November 2025), both
    functions torch.library custom ops (July 2025), and the backward returning only softmax_d (it writes
    dq, dk, dv in place, which burst allocates).

    Contract: fp16/bf16 (its fp8 path is not used), head dim a multiple of 8 up to 256, GQA native,
    causal bottom-right, last dims contiguous (it copies others), lse float32 [b, h, s] returned by
    the forward and read as a dense buffer by the backward (made contiguous here).
    """

    name = "fa3"
    contract = KernelContract(dtypes=HALF_DTYPES, last_dim_contiguous=FLASH_ATTN_CONTRACT.last_dim_contiguous,
                              contiguous=frozenset({"lse"}), head_dim_multiple=8, max_head_dim=256,
                              causal="bottom-right", min_capability=(9, 0))

    def __init__(self) -> None:
        module = import_kernel_module(self.name, FA3_MODULES)
        self._forward = LibraryFunction(module, "_flash_attn_forward", "FlashAttention-3")
        self._backward = LibraryFunction(module, "_flash_attn_backward", "FlashAttention-3")
        self._forward.names("softmax_scale", "causal")
        self._forward_unused = self._forward.unused(
            "k_new", "v_new", "qv", "out_", "out", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new", "seqused_q",
            "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table", "kv_batch_idx", "leftpad_k", "rotary_cos",
            "rotary_sin", "seqlens_rotary", "q_descale", "k_descale", "v_descale")
        self._backward.names("dq", "dk", "dv", "softmax_scale")
        self._backward_causal = self._backward.name("is_causal", "causal")
        self._backward_unused = self._backward.unused(  # `sequed`: the library's own spelling
            "cu_seqlens_q", "cu_seqlens_k", "sequed_q", "sequed_k", "max_seqlen_q", "max_seqlen_k")

    def block_forward(self, q, k, v, causal, scale, window=None):
        out, lse, *_ = self._forward(q, k, v, **self._forward_unused, softmax_scale=scale, causal=causal,
                                     **(self._forward.window(*window) if window else {}))
        return out, lse

    def block_backward(self, dout, q, k, v, out, lse, causal, scale, window=None):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._backward(dout, q, k, v, out, lse.contiguous(), **self._backward_unused, dq=dq, dk=dk, dv=dv,
                       softmax_scale=scale, **{self._backward_causal: causal},
                       **(self._backward.window(*window) if window else {}))
        return dq, dk, dv


class FlashAttn4Kernel(BandByWindow, BottomRightCausal):
    """FlashAttention-4 (sm90 and sm100): `flash_attn.cute.interface._flash_attn_fwd/_bwd` of the
    `flash-attn-4` wheel (pre-releases only; 4.0.0b40 read by the tests), found and imported without
    flash-attn 2.

    Contract: fp16/bf16, head dim a multiple of 8 up to 256, GQA native, causal bottom-right,
    views whose last stride is 1 (16-byte aligned pointers and strides), lse float32 [b, h, s]
    from the forward (return_lse=True) and taken as an external tensor by the backward (made
    contiguous here). A private API whose return arity changed between betas: every argument goes
    by name, and the wrapper takes the first two results of the forward and the first three of the
    backward.
    """

    name = "fa4"
    contract = KernelContract(dtypes=HALF_DTYPES, last_dim_contiguous=FLASH_ATTN_CONTRACT.last_dim_contiguous,
                              contiguous=frozenset({"lse"}), head_dim_multiple=8, max_head_dim=256,
                              causal="bottom-right", min_capability=(9, 0))

    def __init__(self) -> None:
        module = import_kernel_module(self.name, (FA4_MODULE,))
        self._forward = LibraryFunction(module, "_flash_attn_fwd", "FlashAttention-4")
        self._backward = LibraryFunction(module, "_flash_attn_bwd", "FlashAttention-4")
        self._forward.names("q", "k", "v", "softmax_scale", "causal", "return_lse")
        self._backward.names("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal")

    def block_forward(self, q, k, v, causal, scale, window=None):
        out, lse, *_ = self._forward(q=q, k=k, v=v, softmax_scale=scale, causal=causal, return_lse=True,
                                     **(self._forward.window(*window) if window else {}))
        return out, lse

    def block_backward(self, dout, q, k, v, out, lse, causal, scale, window=None):
        dq, dk, dv, *_ = self._backward(q=q, k=k, v=v, out=out, dout=dout, lse=lse.contiguous(), softmax_scale=scale,
                                        causal=causal, **(self._backward.window(*window) if window else {}))
        return dq, dk, dv
