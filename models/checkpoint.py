"""The native model checkpoint: a directory with config.json (ModelConfig fields) and safetensors weights.

Tensor names are the Transformer's own state_dict names (`layers.0.attention.wq.weight`, ...);
sharding and the index follow Hugging Face (see models/storage.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from models.config import ModelConfig
from models.llama import Transformer
from models.storage import (
    DEFAULT_MAX_SHARD_BYTES,
    atomic_directory,
    read_json,
    read_tensors,
    tensor_files,
    tensor_shapes,
    write_json,
    write_tensors,
)

CONFIG_NAME = "config.json"


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The state_dict names and shapes of Transformer(config), computed on the meta device."""
    with torch.device("meta"):
        model = Transformer(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def check_tensor_shapes(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str) -> None:
    """Raise a ValueError naming the first missing, extra or mis-shaped tensor found in `where`."""
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ValueError(f"{where} is missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                         f"({len(missing)} in all); the checkpoint is incomplete or its config.json describes "
                         f"a different model")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ValueError(f"{where} has unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''} "
                         f"({len(extra)} in all); its config.json describes a different model")
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {list(found[name])} but the config implies "
                             f"{list(shape)}; config.json and the weights do not belong together")


def is_native_checkpoint(path: Path) -> bool:
    config = Path(path) / CONFIG_NAME
    return config.is_file() and {"dim", "n_layers"} <= set(read_json(config))


def read_config(path: Path) -> ModelConfig:
    """The ModelConfig stored in a native checkpoint directory."""
    config_file = Path(path) / CONFIG_NAME
    try:
        return ModelConfig.from_dict(read_json(config_file))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{config_file}: {err}") from err


def save_model(model_or_state_dict: nn.Module | dict[str, torch.Tensor], config: ModelConfig, path: str | Path,
               force: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write a native checkpoint directory at `path` (atomically; an existing one only with force=True).

    The state dict must hold full tensors (gather FSDP shards first).
    """
    state_dict = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, nn.Module) \
        else model_or_state_dict
    check_tensor_shapes({name: tuple(t.shape) for name, t in state_dict.items()}, expected_shapes(config),
                        "the state dict to save")
    with atomic_directory(Path(path), force) as tmp:
        write_json(config.to_dict(), tmp / CONFIG_NAME)
        write_tensors(state_dict.items(), tmp, max_shard_bytes)


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Transformer:
    """A Transformer from a native checkpoint directory, ready for `model(tokens) -> logits`.

    dtype: cast the weights to it (default: keep the stored dtype).
    """
    path = Path(path)
    config = read_config(path)
    files = tensor_files(path)
    check_tensor_shapes(tensor_shapes(files), expected_shapes(config), str(path))
    return model_from_tensors(config, read_tensors(files, device), device, dtype)


def model_from_tensors(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]],
                       device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Transformer:
    """Transformer(config) in eval mode holding `tensors` (native names, shapes already checked), moved to
    `device` and cast to `dtype` if given; built on the meta device, so no weight is initialised first."""
    with torch.device("meta"):
        model = Transformer(config)
    state_dict = {name: tensor.to(device=device, dtype=dtype or tensor.dtype) for name, tensor in tensors}
    model.load_state_dict(state_dict, assign=True)
    return model.eval()


def non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors holding a value that is not finite, read from each one's minimum and maximum (a NaN
    anywhere makes both NaN, an infinity one of them): one reduction a tensor and one device sync for all, where
    isfinite().all() writes a boolean copy of each first (16x slower on a CPU: 0.8 s for Gemma-3's 168M-entry
    embedding, at every start, save and evaluation)."""
    named = list(tensors)
    if not named:
        return []
    device = named[0][1].device
    extremes = torch.stack([torch.stack(torch.aminmax(tensor.reshape(-1))).float().to(device) if tensor.numel()
                            else torch.zeros(2, device=device) for _, tensor in named])  # an FSDP shard can be empty
    return [name for (name, _), finite in zip(named, torch.isfinite(extremes).all(dim=1).tolist(), strict=True)
            if not finite]
