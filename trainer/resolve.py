"""What "auto" and an unset setting mean in one run on this machine: decided here, once, each with its reason.

    device = run_device(config, world_size)              # before any data is prepared: a run that cannot start
    resolved = resolve(config, stores, device)           # once the stores are open
    resolved.precision.name, resolved.precision.reason   # "bf16", "auto: this CPU computes in bf16 natively (...)"
    resolved.doc_mask.value, resolved.doc_mask.reason    # True, "preference store: required"

The device and precision rules are runtime/device.py's and runtime/precision.py's, the recipe's is TrainConfig's
(`resolve_recipe`, when the config is made); `burst train` resolves in trainer/preflight.py's check_run and `burst
plan` in trainer/plan.py, from the same functions, so a plan and the run it plans cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime.device import Device, resolve_device
from runtime.launch import local_world_size
from runtime.precision import Precision, resolve_precision
from trainer.sections import Choice, sequence_layout

if TYPE_CHECKING:
    from data.store import TokenStore
    from trainer.config import TrainConfig


@dataclass(frozen=True)
class Resolved:
    """Every setting "auto" or unset leaves open, with why it has its value."""

    device: Device
    precision: Precision
    doc_mask: Choice
    layout: Choice


def run_device(config: TrainConfig, world_size: int) -> Device:
    """Where the ranks of this machine run: under torchrun its LOCAL_WORLD_SIZE ranks, else all `world_size`."""
    return resolve_device(config.device, local_world_size(world_size))


def document_mask(requested: bool | None, stores: list[TokenStore]) -> Choice:
    """--doc-mask: as given, else on where a store packs conversations or preference pairs (each must see only
    itself: the only valid setting, so it need not be asked for), else off (a stream of documents trains across their
    boundaries, as LLaMA's pretraining did). A --no-doc-mask given is kept, to be refused by the checks."""
    kinds = [kind for kind, holds in (("instruction", "is_conversations"), ("preference", "is_preferences"))
             if any(getattr(store, holds) for store in stores)]
    reason = f"{' and '.join(kinds)} store: required" if kinds else ""
    return Choice(bool(kinds) if requested is None else requested, reason)


def resolve(config: TrainConfig, stores: list[TokenStore], device: Device) -> Resolved:
    """The settings `config` leaves open, for its `stores` on `device` (`run_device`)."""
    doc_mask = document_mask(config.doc_mask, stores)
    return Resolved(device, resolve_precision(config.precision, torch.device(device.kind)), doc_mask,
                    sequence_layout(config.cp_layout, doc_mask.value))
