"""The input checks of burst's attention: the arguments one call gets, and the ranks' agreement on them.

Every check raises a ValueError that says what was wrong and how to fix it, before any communication.
The ranks of a group compare what they were given first (`check_ranks_agree`, one small all-gather), so a
bad input fails on every rank at once and none is left waiting in a send.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from burst.comm import Traffic, gather_from_every_rank
from burst.documents import Documents
from burst.kernels import KERNEL_NAMES
from burst.layout import LAYOUTS
from burst.topology import TOPOLOGIES

BACKWARD_MODES = ("auto", "burst", "ring")


def check_backward_mode(backward: str, name: str = "backward mode") -> None:
    """Refuse a backward mode that is not one of BACKWARD_MODES; `name` is what the caller calls the setting."""
    if backward not in BACKWARD_MODES:
        raise ValueError(f"unknown {name} {backward!r}; choose one of {', '.join(BACKWARD_MODES)}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str, seq: str = "seq") -> None:
    """Raise a ValueError naming what is wrong with q, k, v [batch, `seq`, heads, head_dim] or the kernel's name:
    the checks the ring and the one-process attention (burst/local.py) share."""
    if kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNEL_NAMES)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, {seq}, heads, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, {seq} and head_dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]}) "
                         "for grouped-query attention")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def check_local_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str) -> None:
    """Raise a ValueError naming what is wrong with q, k, v (shapes as `local_attn` takes them)."""
    check_qkv(q, k, v, kernel)
    if q.shape[1] == 0:
        raise ValueError("the sequence is empty: q, k and v need at least one position")


def validate_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int, backward: str,
                    kernel: str) -> None:
    """Raise a ValueError naming the problem with `burst_attn`'s shards; called before any communication.

    The ranks hold shards of the same shapes (`check_ranks_agree` makes sure of it), so a bad
    input fails on every rank at once and none is left waiting in a send.
    """
    check_backward_mode(backward)
    check_qkv(q, k, v, kernel, "local_seq")
    local = q.shape[1]
    if local == 0 or local % 2 != 0:
        raise ValueError(
            f"local sequence length {local} on each of {world_size} ranks: the global length {local * world_size} "
            f"must be a positive multiple of 2 x world size = {2 * world_size} (both layouts, zigzag and balanced, "
            f"are made of {2 * world_size} chunks); pad the sequence or change its length, and shard it with "
            f"burst.shard_sequence")


_DTYPE_CODES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _code(options: tuple, value) -> int:
    return options.index(value) if value in options else -1


def _shape(t: torch.Tensor) -> list[int]:
    """[ndim, four sizes padded with -1]: a fixed width whatever the tensor's rank."""
    return [t.dim(), *(list(t.shape) + [-1] * 4)[:4]]


# (name, number of ints, how to show them) for each part of `input_signature`
_SIGNATURE_FIELDS = (
    ("q shape", 5, lambda x: str(x[1:1 + x[0]])),
    ("k shape", 5, lambda x: str(x[1:1 + x[0]])),
    ("v shape", 5, lambda x: str(x[1:1 + x[0]])),
    ("dtypes", 3, lambda x: "/".join(str(_DTYPE_CODES[c]).removeprefix("torch.") if c >= 0 else "other" for c in x)),
    ("causal", 1, lambda x: str(bool(x[0]))),
    ("backward", 1, lambda x: BACKWARD_MODES[x[0]] if x[0] >= 0 else "unknown"),
    ("kernel", 1, lambda x: KERNEL_NAMES[x[0]] if x[0] >= 0 else "unknown"),
    ("doc_boundaries", 1, lambda x: "none" if x[0] == 0 else f"fingerprint {x[0] & 0xFFFFFF:06x}"),
    ("doc_sees", 1, lambda x: "none" if x[0] == 0 else f"fingerprint {x[0] & 0xFFFFFF:06x}"),
    ("topology", 1, lambda x: TOPOLOGIES[x[0]] if x[0] >= 0 else "unknown"),
    ("node_size", 1, lambda x: str(x[0])),
    ("layout", 1, lambda x: LAYOUTS[x[0]] if x[0] >= 0 else "unknown"),
    ("chosen layouts", 1, lambda x: "zigzag" if x[0] == 0 else f"fingerprint {x[0] & 0xFFFFFF:06x}"),
    ("window", 1, lambda x: "none" if x[0] == 0 else str(x[0])),
)


def _digest(value) -> int:
    """A non-zero int64 digest of repr(value), the same in every process (str hashes are not)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little") + 1


def _as_lists(rows) -> list[list[int]] | None:
    """Per-row values as lists of ints, whatever their form (invalid ones too, as far as they read)."""
    if rows is None:
        return None
    if isinstance(rows, torch.Tensor):
        return rows.tolist()
    return [r.tolist() if hasattr(r, "tolist") else list(r) for r in rows]


def input_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, backward: str, kernel: str,
                    documents: Documents | tuple | None, topology: str = "flat", node_size=1,
                    layout: str = "zigzag", window: int | None = None) -> list[int]:
    """What every rank of the group must agree on, as ints (see `_SIGNATURE_FIELDS`).

    Ranks that disagree would post ring messages of different sizes (a gloo error or an NCCL
    hang), or one rank would raise while the others wait for it; comparing these first turns
    all of that into the same ValueError on every rank. documents: the call's `Documents`, None, or
    (doc_boundaries, doc_sees) as given where they make no `Documents` (invalid inputs: validation says
    what is wrong, on every rank, once they agree). The balanced layouts the ranks chose are compared
    too: shards of the same size cut differently would give wrong results silently.
    """
    rows, sees, chosen = None, None, 0
    if isinstance(documents, Documents):
        rows, sees = _as_lists(documents.offsets), _as_lists(documents.sees)
        if documents.layout == "balanced":
            chosen = _digest([(lay.chunk, lay.chunks) for lay in documents.layouts])
    elif documents is not None:
        rows, sees, chosen = _as_lists(documents[0]), _as_lists(documents[1]), -1
    return [*_shape(q), *_shape(k), *_shape(v), *(_code(_DTYPE_CODES, t.dtype) for t in (q, k, v)), int(causal),
            _code(BACKWARD_MODES, backward), _code(KERNEL_NAMES, kernel), 0 if rows is None else _digest(rows),
            0 if sees is None else _digest(sees),
            _code(TOPOLOGIES, topology), node_size if isinstance(node_size, int) else -1, _code(LAYOUTS, layout),
            chosen, window if isinstance(window, int) else 0]


def check_ranks_agree(group: dist.ProcessGroup | None, signature: list[int], device: torch.device,
                      traffic: Traffic, node_size: int) -> None:
    """Raise the same ValueError on every rank when the ranks' inputs disagree: one small
    all-gather before any ring traffic, so no rank is left waiting."""
    every = gather_from_every_rank(group, signature, device, traffic, node_size if isinstance(node_size, int) else 1)
    if all(theirs == every[0] for theirs in every):
        return
    differences, start = [], 0
    for name, width, show in _SIGNATURE_FIELDS:
        values = [sig[start:start + width] for sig in every]
        if any(x != values[0] for x in values):
            differences.append(f"{name}: " + ", ".join(f"rank {r} {show(x)}" for r, x in enumerate(values)))
        start += width
    raise ValueError(f"burst_attn got different inputs on the ranks of its group ({'; '.join(differences)}). "
                     "Every rank must pass its shard of the same global sequence (see burst.shard_sequence) with "
                     "the same shapes, dtypes, causal flag, backward mode, kernel, doc_boundaries, doc_sees, topology, "
                     "node_size, layout and window")
