"""Rotary position embeddings: the scaling types transformers' LLaMA implements, typed, and their frequencies.

One frozen dataclass per type, each holding exactly the parameters Hugging Face's `rope_parameters`
(transformers 5.x) or `rope_scaling` (4.x) give it; no scaling at all ("default") is None:

    linear     LinearRope(factor)                                   positions divided by factor
    dynamic    DynamicRope(factor, original_max_position_embeddings)   NTK: the base grows with the length
    yarn       YarnRope(factor, original_max_position_embeddings, attention_factor, beta_fast, ...)
    longrope   LongRope(short_factor, long_factor, original_max_position_embeddings, factor, attention_factor)
    llama3     Llama3Rope(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)

`rope_frequencies` computes each type's inverse frequencies and the factor yarn and longrope scale
cos/sin by, with the arithmetic of transformers' modeling_rope_utils.py (5.x), so converted models
agree with LlamaForCausalLM to float rounding.

Two types depend on the sequence length, as transformers computes it from the forward's position ids
(max(position_ids) + 1): dynamic NTK (the base grows past the original length) and longrope (long
factors past it, short ones below). The model takes that length as `rope_length` from its caller;
under sequence parallelism each rank holds a shard, so the loader computes it over the whole sequence
(`Batch.rope_length`), the same on every rank. transformers' dynamic rotary embedding also remembers
the longest length it has seen and keeps its frequencies for shorter sequences above the original
length; here every forward uses its own length, which is what a freshly loaded transformers model does.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

ORIGINAL_LENGTH = "original_max_position_embeddings"


@dataclass(frozen=True)
class RopeScaling:
    """A rotary scaling type (the subclasses below). Fields are type-checked on construction: a string
    factor, a fraction where a whole number belongs or a missing field is a ValueError naming it."""

    rope_type: ClassVar[str]
    depends_on_length: ClassVar[bool] = False  # whether the frequencies depend on the sequence length
    positive: ClassVar[tuple[str, ...]] = ("attention_factor",)  # parameters that must be above 0 when set

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kinds = typing.get_args(hints[field.name]) if isinstance(hints[field.name], types.UnionType) \
                else (hints[field.name],)
            if value is None and type(None) in kinds:
                continue
            object.__setattr__(self, field.name, _typed(self.rope_type, field.name, value, kinds[0]))
        self.check()

    def check(self) -> None:
        """Refuse values of the right type but outside their range (each type adds its own)."""
        factor = getattr(self, "factor", None)
        if factor is not None and factor < 1:
            raise ValueError(self._message("factor", factor, "must be at least 1 (the context grows by it)"))
        original = getattr(self, ORIGINAL_LENGTH, None)
        if original is not None and original < 2:
            raise ValueError(self._message(ORIGINAL_LENGTH, original, "must be at least 2 (the context the model "
                                                                       "was trained at)"))
        for name in self.positive:
            value = getattr(self, name, None)
            if value is not None and value <= 0:
                raise ValueError(self._message(name, value, "must be positive"))

    def check_head_dim(self, head_dim: int) -> None:
        """Refuse parameters that do not fit the model's head dimension (longrope's per-frequency factors)."""

    def _message(self, name: str, value: Any, problem: str) -> str:
        return f"rope scaling {self.rope_type!r}: {name} = {value!r} {problem}"

    def to_dict(self) -> dict[str, Any]:
        """The Hugging Face form: rope_type and every set parameter (lists for longrope's factors)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        return {"rope_type": self.rope_type, **{k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}}

    def frequencies(self, theta: float, head_dim: int, length: int | None,
                    device: torch.device | str | None) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [head_dim // 2] float32, cos/sin scale) for sequences of `length` positions."""
        raise NotImplementedError


def check_theta(theta: float, name: str) -> None:
    """Refuse a RoPE base that is not a finite number above 1 (`name` says where it came from): the wavelengths are
    2 pi x theta^(2i / head_dim), so a base of 1 or less rotates every dimension at least as fast as the first, and
    YaRN divides by its logarithm."""
    if not 1 < theta < math.inf:
        raise ValueError(f"{name} {theta:g} must be a number above 1, the base whose powers set the wavelengths "
                         f"(10000 in LLaMA-2, 500000 in LLaMA-3, e.g. 8e6 to extend a LLaMA-3 to 64K tokens)")


def _typed(rope_type: str, name: str, value: Any, kind: type) -> Any:
    """`value` as a field of type `kind` (float, int, bool or tuple[float, ...]); a ValueError naming the field."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if kind is float and number(value):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is bool and isinstance(value, bool):
        return value
    if typing.get_origin(kind) is tuple and isinstance(value, (list, tuple)) and value and all(map(number, value)):
        return tuple(float(x) for x in value)
    wanted = {float: "a number", int: "a whole number", bool: "true or false"}.get(kind, "a list of numbers")
    raise ValueError(f"rope scaling {rope_type!r}: {name} = {value!r} must be {wanted}")


def _base_inv_freq(theta: float, head_dim: int, device: torch.device | str | None) -> torch.Tensor:
    """theta^(-2i / head_dim) for i < head_dim / 2, float32, as transformers computes it."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
    return 1.0 / (theta ** exponents)


@dataclass(frozen=True)
class LinearRope(RopeScaling):
    """Position interpolation: every frequency divided by `factor`."""

    factor: float
    rope_type: ClassVar[str] = "linear"

    def frequencies(self, theta, head_dim, length, device):
        inv_freq = _base_inv_freq(theta, head_dim, device)
        inv_freq /= self.factor
        return inv_freq, 1.0


@dataclass(frozen=True)
class DynamicRope(RopeScaling):
    """Dynamic NTK: beyond `original_max_position_embeddings` (transformers' max_position_embeddings) positions
    the base grows with the sequence length; below it the frequencies are the plain ones."""

    factor: float
    original_max_position_embeddings: int
    rope_type: ClassVar[str] = "dynamic"
    depends_on_length: ClassVar[bool] = True

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim <= 2:  # the base grows by a power head_dim / (head_dim - 2)
            raise ValueError(self._message("factor", self.factor, f"needs a head dimension above 2, not {head_dim}"))

    def frequencies(self, theta, head_dim, length, device):
        original = self.original_max_position_embeddings
        # transformers' two paths: at initialisation (and below the original length) a Python int; in a forward
        # that grows past it, max(position_ids) + 1 as a tensor, so the base is computed in float32.
        seq_len = original if length is None or length <= original else torch.tensor(length, device=device)
        base = theta * ((self.factor * seq_len / original) - (self.factor - 1)) ** (head_dim / (head_dim - 2))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
        return 1.0 / (base ** exponents), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, Eq. 21 of the paper: 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnRope(RopeScaling):
    """YaRN: frequencies interpolated by `factor` below the wavelength band set by beta_fast/beta_slow, kept above
    it, ramped between; cos/sin scaled by `attention_factor` (default from factor, mscale and mscale_all_dim)."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float | None = None
    beta_fast: float | None = None  # None: 32
    beta_slow: float | None = None  # None: 1
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None  # None: True (round the correction range outwards)
    rope_type: ClassVar[str] = "yarn"
    # beta_*: rotations, whose logarithm sets the ramp; mscale*: a negative one would flip or zero cos/sin's scale
    positive: ClassVar[tuple[str, ...]] = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")

    def check(self) -> None:
        super().check()
        if (self.beta_fast or 32) < (self.beta_slow or 1):
            raise ValueError(self._message("beta_fast", self.beta_fast,
                                           f"must not be below beta_slow {self.beta_slow}"))

    def frequencies(self, theta, head_dim, length, device):
        factor, dim = self.factor, head_dim
        attention_factor = self.attention_factor
        if attention_factor is None:
            if self.mscale and self.mscale_all_dim:
                attention_factor = float(yarn_mscale(factor, self.mscale) / yarn_mscale(factor, self.mscale_all_dim))
            else:
                attention_factor = yarn_mscale(factor)
        beta_fast, beta_slow = self.beta_fast or 32, self.beta_slow or 1

        def correction_dim(rotations: float) -> float:  # the dimension whose wavelength makes `rotations` turns
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) \
                / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate is None or self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        extrapolation_share = 1 - ramp.to(device=device, dtype=torch.float)
        return interpolation * (1 - extrapolation_share) + extrapolation * extrapolation_share, attention_factor


@dataclass(frozen=True)
class LongRope(RopeScaling):
    """LongRoPE (Phi-3): one factor per frequency, `long_factor` for sequences longer than
    original_max_position_embeddings, `short_factor` otherwise; cos/sin scaled by `attention_factor`
    (default sqrt(1 + ln(factor) / ln(original_max_position_embeddings)))."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    factor: float | None = None  # only sets the default attention_factor
    attention_factor: float | None = None
    rope_type: ClassVar[str] = "longrope"
    depends_on_length: ClassVar[bool] = True

    def check(self) -> None:
        super().check()
        if self.factor is None and self.attention_factor is None:
            raise ValueError(self._message("factor", None, "must be given when attention_factor is not (transformers "
                                                           "derives it from max_position_embeddings)"))
        for name in ("short_factor", "long_factor"):
            if min(getattr(self, name)) <= 0:
                raise ValueError(self._message(name, list(getattr(self, name)), "must hold positive numbers"))

    def check_head_dim(self, head_dim: int) -> None:
        for name in ("short_factor", "long_factor"):
            if len(getattr(self, name)) != head_dim // 2:
                raise ValueError(self._message(name, f"[{len(getattr(self, name))} numbers]",
                                               f"must hold head_dim / 2 = {head_dim // 2} numbers, one per frequency"))

    def frequencies(self, theta, head_dim, length, device):
        original = self.original_max_position_embeddings
        attention_factor = self.attention_factor
        if attention_factor is None:
            attention_factor = 1.0 if self.factor <= 1 else math.sqrt(1 + math.log(self.factor) / math.log(original))
        factors = self.long_factor if length is not None and length > original else self.short_factor
        ext_factors = torch.tensor(factors, dtype=torch.float32, device=device)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        return 1.0 / (ext_factors * theta ** exponents), attention_factor


@dataclass(frozen=True)
class Llama3Rope(RopeScaling):
    """LLaMA-3.1: wavelengths shorter than original_max_position_embeddings / high_freq_factor are kept, longer
    than original_max_position_embeddings / low_freq_factor divided by `factor`, the band between interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: ClassVar[str] = "llama3"
    positive: ClassVar[tuple[str, ...]] = ("low_freq_factor", "high_freq_factor")  # the wavelengths divide by them

    def check(self) -> None:
        super().check()
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(self._message("high_freq_factor", self.high_freq_factor,
                                           f"must be above low_freq_factor {self.low_freq_factor}"))

    def frequencies(self, theta, head_dim, length, device):
        inv_freq = _base_inv_freq(theta, head_dim, device)
        old_context = self.original_max_position_embeddings
        low_freq_wavelen, high_freq_wavelen = old_context / self.low_freq_factor, old_context / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_context / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0


ROPE_TYPES: dict[str, type[RopeScaling]] = {cls.rope_type: cls for cls in
                                             (LinearRope, DynamicRope, YarnRope, LongRope, Llama3Rope)}
TYPE_NAMES = ", ".join(["default", *ROPE_TYPES])


def rope_frequencies(theta: float, head_dim: int, scaling: RopeScaling | None, length: int | None = None,
                     device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] float32, the factor cos and sin are scaled by) for sequences of
    `length` positions (only dynamic and longrope read it; None: the original length)."""
    if scaling is None:
        return _base_inv_freq(theta, head_dim, device), 1.0
    return scaling.frequencies(theta, head_dim, length, device)


def rope_scaling_from_dict(fields: Mapping[str, Any], where: str, default_type: str = "default",
                           original_length: int | None = None) -> RopeScaling | None:
    """The scaling a Hugging Face style dict describes (rope_type or type, and the type's parameters); None for
    "default". `default_type` applies when the dict names no type; `original_length` fills a missing
    original_max_position_embeddings (transformers uses max_position_embeddings). Anything unknown, missing or
    mistyped is a ValueError that names `where` and the field."""
    if not isinstance(fields, Mapping):
        raise ValueError(f"{where}: rope scaling {fields!r} must be a JSON object with a rope_type")
    fields = dict(fields)
    named = {key: fields.pop(key) for key in ("rope_type", "type") if key in fields}
    if len(set(map(str, named.values()))) > 1:
        raise ValueError(f"{where}: rope_type {named['rope_type']!r} and type {named['type']!r} name different rope "
                         f"types; keep one")
    rope_type = named.get("rope_type", named.get("type", default_type))
    if fields.get("partial_rotary_factor", 1.0) == 1.0:  # every dimension rotated: the only way LLaMA works
        fields.pop("partial_rotary_factor", None)
    if rope_type == "default":
        if fields:
            raise ValueError(f"{where}: rope type 'default' takes no parameters, but {sorted(fields)} are given")
        return None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}: unknown rope type {rope_type!r}; the types transformers' LLaMA implements are "
                         f"{TYPE_NAMES}")
    cls = ROPE_TYPES[rope_type]
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ValueError(f"{where}: rope type {rope_type!r} has no parameter {', '.join(unknown)}; its parameters "
                         f"are {', '.join(names)}")
    if ORIGINAL_LENGTH in names and fields.get(ORIGINAL_LENGTH) is None and original_length is not None:
        fields[ORIGINAL_LENGTH] = original_length
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if fields.get(name) is None]
    if missing:
        raise ValueError(f"{where}: rope type {rope_type!r} needs {', '.join(missing)}")
    try:
        return cls(**fields)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def parse_rope_scaling(spec: str, where: str, original_length: int | None = None) -> RopeScaling | None:
    """`--rope-scaling TYPE[:key=value,...]` -> its scaling (None for "none"/"default").

    Values are numbers, true/false, or several comma-separated numbers after one key (a list: longrope's
    short_factor and long_factor), e.g. `yarn:factor=4,original_max_position_embeddings=8192` or
    `longrope:short_factor=1,1,long_factor=2,3,factor=4`.
    """
    rope_type, _, rest = spec.strip().partition(":")
    fields: dict[str, Any] = {"rope_type": "default" if rope_type == "none" else rope_type}
    key = None
    for item in filter(None, (part.strip() for part in rest.split(","))):
        if "=" in item:
            key, _, text = item.partition("=")
            key = key.strip()
            if key in ("rope_type", "type"):
                raise ValueError(f"{where}: {item!r}: the rope type is the word before the colon ({rope_type!r} "
                                 f"here); write TYPE:key=value,..., e.g. {text.strip() or 'yarn'}:factor=2")
            if key in fields:
                raise ValueError(f"{where}: {key} is given twice; give each parameter once")
            fields[key] = _value(text.strip())
        elif key is None:
            raise ValueError(f"{where}: {item!r} is not key=value; write TYPE:key=value,key=value")
        else:  # a further value of the previous key: a list
            fields[key] = [*(fields[key] if isinstance(fields[key], list) else [fields[key]]), _value(item)]
    return rope_scaling_from_dict(fields, where, original_length=original_length)


def _value(text: str) -> Any:
    """A flag's value: true/false, a whole number, a number, or else the text (refused by the type check)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
