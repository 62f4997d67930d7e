"""A Hugging Face LLaMA config.json <-> ModelConfig, every field read type-checked.

transformers 4.x writes RoPE as `rope_theta` and `rope_scaling`, 5.x as `rope_parameters` (theta inside);
both are read, as transformers reads them (`rope_scaling` wins when both are there), with every rope type
transformers' LLaMA implements (models/rope.py). Exports are written in the 4.x form, which 5.x reads too.

A value of the wrong type is refused with the file and the field named, before any tensor is read:
`"tie_word_embeddings": "false"` is a string, not false, and would otherwise drop lm_head.weight.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from models.config import ModelConfig
from models.rope import ORIGINAL_LENGTH, DynamicRope, rope_scaling_from_dict

REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
# Each field read, its kind and its default when absent (LlamaConfig's); kinds are checked by `_typed`.
FIELDS: dict[str, tuple[str, Any]] = {
    **{key: ("whole", None) for key in REQUIRED_SIZES},
    "num_key_value_heads": ("whole or null", None), "head_dim": ("whole or null", None),
    "hidden_act": ("text", "silu"), "attention_bias": ("bool", False), "mlp_bias": ("bool", False),
    "rms_norm_eps": ("number", 1e-6), "initializer_range": ("number", 0.02),
    "rope_theta": ("number", 10000.0), "rope_scaling": ("object or null", None),
    "rope_parameters": ("object or null", None), "max_position_embeddings": ("whole", 2048),
    ORIGINAL_LENGTH: ("whole or null", None),  # Phi-3 style: beside rope_scaling, and then it wins
    "tie_word_embeddings": ("bool", False), "bos_token_id": ("id or null", None),
    "eos_token_id": ("ids or null", None), "pad_token_id": ("id or null", None), "unk_token_id": ("id or null", None),
}
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")  # kept through a conversion
KIND_NAMES = {"whole": "a whole number", "number": "a number", "text": "a string", "bool": "true or false",
              "object": "a JSON object", "id": "a token id (a whole number >= 0)",
              "ids": "a token id or a list of them"}


def _is(kind: str, value: Any) -> bool:
    """Whether `value` is of `kind` (a key of KIND_NAMES); a bool is not a number."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return (whole or isinstance(value, float)) and math.isfinite(value)
    if kind == "id":
        return whole and value >= 0
    if kind == "ids":
        return _is("id", value) or isinstance(value, list) and bool(value) and all(_is("id", v) for v in value)
    return {"whole": whole, "text": isinstance(value, str), "bool": isinstance(value, bool),
            "object": isinstance(value, dict)}[kind]


def _typed(hf: dict, where: Path | str) -> dict[str, Any]:
    """The fields of FIELDS in `hf`, defaults filled in; a ValueError naming the first of the wrong type."""
    values = {}
    for key, (kind, default) in FIELDS.items():
        value = hf.get(key, default)
        kinds = kind.removesuffix(" or null").split(" or ")
        if not (value is None and kind.endswith("or null")) and not any(_is(k, value) for k in kinds):
            wanted = " or ".join(KIND_NAMES[k] for k in kinds) + (" (or null)" if kind.endswith("or null") else "")
            raise ValueError(f"{where}: {key} = {value!r} must be {wanted}")
        values[key] = value
    return values


def config_from_hf(hf: dict, where: Path | str) -> ModelConfig:
    """ModelConfig from a transformers 4.x (rope_theta, rope_scaling) or 5.x (rope_parameters) config.json."""
    if not isinstance(hf, dict):
        raise ValueError(f"{where} holds {type(hf).__name__}, not a JSON object: it is not a config.json")
    architectures = hf.get("architectures") or []
    if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in architectures:
        raise ValueError(f"{where} describes model_type {hf.get('model_type')!r} {architectures}, not LLaMA "
                         f"(model_type 'llama', LlamaForCausalLM); only LLaMA checkpoints can be converted")
    missing = [key for key in REQUIRED_SIZES if key not in hf]
    if missing:
        raise ValueError(f"{where} lacks {missing}; it is not a complete LlamaConfig")
    hf_fields = _typed(hf, where)
    if hf_fields["num_attention_heads"] < 1:
        raise ValueError(f"{where}: num_attention_heads = {hf['num_attention_heads']} must be at least 1")
    natural_head_dim = hf_fields["hidden_size"] // hf_fields["num_attention_heads"]
    for key, supported in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                           ("head_dim", natural_head_dim)):
        if hf_fields[key] not in (supported, None):
            raise ValueError(f"{where}: {key}={hf[key]!r} is not supported (the native model has {key}={supported!r})")
    rope = _rope(hf_fields, where)
    try:
        return ModelConfig(
            dim=hf_fields["hidden_size"], n_layers=hf_fields["num_hidden_layers"],
            n_heads=hf_fields["num_attention_heads"],
            n_kv_heads=hf_fields["num_key_value_heads"] or hf_fields["num_attention_heads"],
            vocab_size=hf_fields["vocab_size"], ffn_hidden_dim=hf_fields["intermediate_size"],
            norm_eps=hf_fields["rms_norm_eps"], **rope,
            max_seq_len=hf_fields["max_position_embeddings"], tie_embeddings=hf_fields["tie_word_embeddings"],
            init_std=hf_fields["initializer_range"], bos_token_id=hf_fields["bos_token_id"],
            eos_token_id=hf_fields["eos_token_id"], pad_token_id=hf_fields["pad_token_id"],
            unk_token_id=hf_fields["unk_token_id"])
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _rope(hf: dict[str, Any], where: Path | str) -> dict[str, Any]:
    """rope_theta and rope_scaling of a typed HF config, as transformers standardises them."""
    rope = dict(hf["rope_scaling"] or hf["rope_parameters"] or {})
    # 4.x keeps theta beside rope_scaling, 5.x inside rope_parameters: a file with both forms has it in either
    theta = rope.pop("rope_theta", (hf["rope_parameters"] or {}).get("rope_theta", hf["rope_theta"]))
    if not _is("number", theta):
        raise ValueError(f"{where}: rope_theta = {theta!r} must be a number")
    max_length = hf["max_position_embeddings"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("llama3", "yarn", "longrope") and hf[ORIGINAL_LENGTH] is not None:
        rope[ORIGINAL_LENGTH] = hf[ORIGINAL_LENGTH]
    if rope_type == "dynamic":  # transformers' dynamic NTK grows from max_position_embeddings
        if rope.get(ORIGINAL_LENGTH, max_length) != max_length:
            raise ValueError(f"{where}: a dynamic rope's {ORIGINAL_LENGTH} = {rope[ORIGINAL_LENGTH]!r} differs from "
                             f"max_position_embeddings {max_length}, which transformers uses instead; remove it")
        rope[ORIGINAL_LENGTH] = max_length
    if rope_type in ("yarn", "longrope") and rope.get("factor") is None and _is("whole", rope.get(ORIGINAL_LENGTH)):
        rope["factor"] = max_length / rope[ORIGINAL_LENGTH]  # transformers' default for both
    scaling = rope_scaling_from_dict(rope, f"{where}: rope_scaling", original_length=max_length)
    return {"rope_theta": theta, "rope_scaling": scaling}


def config_to_hf(config: ModelConfig, dtype: torch.dtype) -> dict:
    """A config.json that transformers 4.x and 5.x load as LlamaForCausalLM.

    A dynamic rope's max_position_embeddings is its original length (transformers grows the base past it);
    every other model's is its max_seq_len.
    """
    rope_scaling = None if config.rope_scaling is None else config.rope_scaling.to_dict()
    max_length = config.max_seq_len
    if isinstance(config.rope_scaling, DynamicRope):
        max_length = rope_scaling.pop(ORIGINAL_LENGTH)
    longrope = {}
    if rope_scaling is not None and rope_scaling.get("rope_type") == "longrope":
        # transformers 4.x reads a longrope's original length only beside rope_scaling (else it takes
        # max_position_embeddings), and there replaces `factor` by max_position_embeddings / that length
        original = rope_scaling[ORIGINAL_LENGTH]
        longrope = {ORIGINAL_LENGTH: original}
        factor = rope_scaling.get("factor")
        if rope_scaling.get("attention_factor") is None and factor is not None and factor != max_length / original:
            # a factor 4.x would not compute: give the attention factor it implies, which both releases read
            scale = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
            rope_scaling["attention_factor"] = scale
    specials = {name: getattr(config, name) for name in SPECIAL_IDS if getattr(config, name) is not None}
    return {
        **longrope, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": config.dim, "intermediate_size": config.ffn_hidden_dim,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim, "vocab_size": config.vocab_size,
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta, "rope_scaling": rope_scaling,
        "max_position_embeddings": max_length, "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."), **specials,
    }


def generation_config_to_hf(config: ModelConfig) -> dict | None:
    """The generation_config.json transformers derives from a model's config (its special ids), for an export whose
    source had none (a run); None when the model names no special id."""
    specials = {name: getattr(config, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")
                if getattr(config, name) is not None}
    return {**specials, "_from_model_config": True} if specials else None


def readable_by_transformers_4_and_5(fields: dict[str, Any]) -> dict[str, Any]:
    """A config.json's `fields` with RoPE in transformers 4.x's form (rope_theta, rope_scaling; torch_dtype), which
    5.x reads too. 4.x ignores 5.x's `rope_parameters`: a model saved by 5.x would run there at the default theta,
    unscaled, without a word. A rope_scaling already there stays (it wins, as burst and transformers read it)."""
    fields = dict(fields)
    rope = dict(fields.pop("rope_parameters", None) or {})
    if "rope_theta" in rope:
        fields["rope_theta"] = rope.pop("rope_theta")
    if fields.get("rope_scaling") is None:
        fields["rope_scaling"] = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    if "dtype" in fields:
        fields["torch_dtype"] = fields.pop("dtype")
    return fields
