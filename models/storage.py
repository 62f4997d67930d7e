"""Checkpoint directories on disk: safetensors files, sharded with an index, written atomically.

The layout is Hugging Face's: `model.safetensors`, or past a size threshold
`model-00001-of-0000N.safetensors` ... plus `model.safetensors.index.json`
({"metadata": {"total_size": bytes}, "weight_map": {tensor name: file name}}). Both the native
format and the Hugging Face format use it; only tensor names and config.json differ.
Tensors are read and written one at a time so a 7B model never sits in memory twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.directories import exclusive_writer, write_atomically

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def umask_mode(mode: int) -> int:
    """`mode` less the bits this process's umask removes: what open() would give a new file."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def read_json(path: Path) -> dict:
    """A JSON object from `path`, with an error naming the file when it is missing, malformed or not an object."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); re-export or re-download it") from err
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a JSON {type(obj).__name__}, not an object; re-export or re-download it")
    return obj


def read_index(index: Path) -> dict[str, str]:
    """The weight map of `index` (model.safetensors.index.json): tensor name -> shard file name in the same
    directory, every field checked for its type; an error names the file, the field and the fix."""
    fix = "re-export or re-download the checkpoint"
    content = read_json(index)
    metadata = content.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ValueError(f"{index}: 'metadata' is a {type(metadata).__name__}, not an object; {fix}")
    total_size = metadata.get("total_size", 0)
    if isinstance(total_size, bool) or not isinstance(total_size, int) or total_size < 0:
        raise ValueError(f"{index}: 'metadata.total_size' = {total_size!r} is not a whole number of bytes; {fix}")
    weight_map = content.get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no 'weight_map' object (tensor name -> file name); {fix}")
    if not weight_map:
        raise ValueError(f"{index}: 'weight_map' lists no tensors; {fix}")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ValueError(f"{index}: 'weight_map' maps {name!r} to {file!r}, not to a file name; {fix}")
        if Path(file).name != file or file in (".", "..") or not file.endswith(".safetensors"):
            raise ValueError(f"{index}: 'weight_map' maps {name!r} to {file!r}, which is not the name of a "
                             f".safetensors file beside the index; {fix}")
    return weight_map


def write_json(obj: dict, path: Path) -> None:
    """Write `obj` to `path` whole or not at all (a temporary renamed over it, runtime.directories)."""
    write_atomically(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def os_error_in(err: Exception, file: Path | None = None) -> OSError | None:
    """The OSError behind an error safetensors raised (its own type, the OS's number in its text), or None."""
    number = re.search(r"\(os error (\d+)\)", str(err))
    if number is None:
        return None
    return OSError(int(number.group(1)), os.strerror(int(number.group(1))), *([str(file)] if file else []))


def open_safetensors(file: Path):
    """safe_open(file), with a ValueError naming the file when it is truncated or corrupt (an OSError when the
    file system refused to read it: no permission, an I/O error)."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as err:  # safetensors raises its own error types for each kind of damage
        denied = os_error_in(err, file) if not isinstance(err, OSError) else err
        if denied is not None:
            raise denied from None
        raise ValueError(f"{file} is not a readable safetensors file ({err}); "
                         f"it is probably truncated or corrupt: re-download or re-export it") from err


def tensor_files(directory: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file in `directory` that holds it."""
    single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
    if index.is_file():
        files = {name: directory / file for name, file in read_index(index).items()}
    elif single.is_file():
        with open_safetensors(single) as f:
            return dict.fromkeys(f.keys(), single)
    else:
        raise ValueError(f"{directory} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}; "
                         f"point at a directory written by save_pretrained or burst")
    for file in sorted(set(files.values())):
        if not file.is_file():
            raise ValueError(f"{file} is listed in {index} but does not exist; copy the missing shard")
        with open_safetensors(file) as f:
            stored = set(f.keys())
        listed = {name for name, listed_file in files.items() if listed_file == file}
        if listed - stored:
            raise ValueError(f"{file} lacks tensors that {index} places there: {sorted(listed - stored)[:5]}; "
                             f"the shard and the index do not belong together")
    return files


def tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, read from the file headers only (no tensor data is loaded)."""
    shapes = {}
    for file in sorted(set(files.values())):
        with open_safetensors(file) as f:
            for name in f.keys():
                if files.get(name) == file:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def read_tensors(files: dict[str, Path], device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, opening each file once."""
    for file in sorted(set(files.values())):
        with open_safetensors(file) as f:
            for name in f.keys():
                if files.get(name) == file:
                    try:
                        yield name, f.get_tensor(name).to(device)
                    except Exception as err:
                        raise ValueError(f"{file}: tensor {name!r} cannot be read ({err}); "
                                         f"the file is corrupt: re-download or re-export it") from err


def read_rows(file: Path, name: str, rows: range) -> torch.Tensor:
    """Rows `rows` (along dim 0) of tensor `name` in `file`, reading only those: a rank of a sharded run
    reads its shard alone. The file is mapped only during the call, so its pages do not stay resident."""
    with open_safetensors(file) as f:
        try:
            return f.get_slice(name)[rows.start:rows.stop]
        except Exception as err:
            raise ValueError(f"{file}: rows {rows.start}..{rows.stop} of tensor {name!r} cannot be read ({err}); "
                             f"the file is corrupt: re-download or re-export it") from err


def write_tensors(tensors: Iterable[tuple[str, torch.Tensor]], directory: Path,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write tensors as model.safetensors, or as numbered shards plus an index once they exceed max_shard_bytes.

    Holds at most one shard in memory.
    """
    shards: list[list[str]] = []  # tensor names of each flushed shard
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total_bytes = 0

    def flush() -> None:
        shard = directory / f"shard-{len(shards) + 1:05d}.tmp"
        try:
            save_file(pending, str(shard), metadata={"format": "pt"})
        except Exception as err:  # a full disk comes as safetensors' own type: the OSError, for WriteFailed
            full = os_error_in(err)  # no file name: the caller names the directory the user knows
            if full is None:
                raise
            raise full from None
        os.chmod(shard, umask_mode(0o666))  # safetensors creates its files 0600, unreadable to a team
        shards.append(list(pending))
        pending.clear()

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
            pending_bytes = 0
        pending[name] = tensor.detach().contiguous().cpu()
        pending_bytes += size
        total_bytes += size
    flush()
    if len(shards) == 1:
        os.replace(directory / "shard-00001.tmp", directory / WEIGHTS_NAME)
        return
    weight_map = {}
    for number, names in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        os.replace(directory / f"shard-{number:05d}.tmp", directory / file)
        weight_map.update(dict.fromkeys(names, file))
    write_json({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, directory / INDEX_NAME)


@contextlib.contextmanager
def atomic_directory(dst: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to `dst` that becomes `dst` only if the block completes.

    The rule of every directory burst writes (runtime/directories.py): one writer at a time, and an existing
    `dst` is refused unless `force`, and then unless burst wrote it as a model directory; it is replaced only
    after the new one is complete.
    """
    with exclusive_writer(dst, "model") as directory:
        directory.check_replaceable(force)
        with directory.staging() as tmp:
            yield tmp
