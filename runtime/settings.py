"""A setting: a typed dataclass field that carries its help, so the command line is generated from the config.

    @dataclass(frozen=True)
    class Run:
        steps: int = setting(40, "Optimizer steps of the whole run.")
        out: str | None = setting(None, "Run directory.", shown="runs/DATE-TIME")

cli.py makes `--steps` and `--out` of these fields (`shown` is what `--help` says an unset None stands for), and a
config file's values are checked against the same types (`checked`). Plain Python: `burst --help` reads it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


def flag(name: str) -> str:
    """The command-line flag of the setting `name`: seq_len -> --seq-len."""
    return "--" + name.replace("_", "-")


def setting(default: Any, help: str, shown: str | None = None) -> Any:
    """A config field with its help text (and, for a None default, how `--help` describes it): the command's
    option is built from it, so each setting is declared once."""
    return dataclasses.field(default=default, metadata={"help": help, "shown": shown})


def shown_default(field: dataclasses.Field) -> str:
    """What `--help` gives as the default of `field`: its `shown`, else its default as a flag would spell it."""
    default = field.default
    return field.metadata["shown"] or (str(default).lower() if isinstance(default, bool) else str(default))


def value_kind(annotation: Any) -> Any:
    """The type a setting's value has when given: `int | None` -> int."""
    return next(t for t in typing.get_args(annotation) or (annotation,) if t is not type(None)) \
        if isinstance(annotation, types.UnionType) else annotation


def accepted_types(config_class: type, name: str) -> tuple[Any, ...]:
    """The types a value of field `name` may have (an int is a fine float; None only where allowed)."""
    annotation = typing.get_type_hints(config_class)[name]
    kinds = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return kinds + ((int,) if float in kinds else ())


def is_a(value: Any, kind: Any) -> bool:
    """isinstance for the field types: plain classes, and list[str] (a list of strings)."""
    if typing.get_origin(kind) is list:
        return isinstance(value, list) and all(is_a(item, typing.get_args(kind)[0]) for item in value)
    return (kind is bool or not isinstance(value, bool)) and isinstance(value, kind)


def checked(config_class: type, values: dict[str, Any], source: str) -> dict[str, Any]:
    """`values` if every key is a field of `config_class` holding a value of its type; else a ValueError naming it."""
    names = [field.name for field in dataclasses.fields(config_class)]
    for key, value in values.items():
        if key not in names:
            raise ValueError(f"unknown setting {key!r} in {source}; valid settings: {', '.join(names)}")
        accepted = accepted_types(config_class, key)
        if not any(is_a(value, kind) for kind in accepted):
            kinds = " or ".join("list of strings" if typing.get_origin(t) is list else t.__name__
                                for t in accepted if t is not type(None))
            raise ValueError(f"setting {key!r} in {source} is {value!r}, which is not a {kinds}")
    return values


DEVICE_HELP = ("Where the ranks run: cuda (a GPU per local rank, NCCL), cpu (gloo ranks on the CPU, even beside GPUs, "
               "which stay untouched) or auto (cuda where a GPU is visible, else cpu); the BURST_DEVICE environment "
               "variable when not given.")
KERNEL_HELP = ("Local attention kernel of BurstAttention's blocks: auto (the fastest installed one that agrees with "
               "the math kernel on a self-check), math, cpu, flash, efficient, cudnn, fa3, fa4, flash-attn or torch "
               "(docs/kernels.md).")


def device_setting() -> Any:
    """--device, as train, eval and bench declare it: the request (None: BURST_DEVICE, else auto)."""
    return setting(None, DEVICE_HELP, shown="$BURST_DEVICE, else auto")


def kernel_setting() -> Any:
    """--attention-kernel, as train, eval and bench declare it."""
    return setting("auto", KERNEL_HELP)
