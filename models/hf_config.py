"""A Hugging Face config.json <-> ModelConfig, every field read type-checked, for each family of FAMILIES:
LLaMA, Qwen2 / Qwen2.5, Qwen3, Mistral and Gemma 3 (text). Each family's fields are read with the defaults its
transformers config class has (Qwen3's head_dim 128, Mistral's sliding_window 4096, ...), and its windows
resolved as that class resolves them (Qwen's use_sliding_window and max_window_layers, Gemma 3's layer_types).

transformers 4.x writes RoPE as `rope_theta` and `rope_scaling`, 5.x as `rope_parameters` (theta inside);
both are read, as transformers reads them (`rope_scaling` wins when both are there), with every rope type
transformers' LLaMA implements (models/rope.py). Exports are written in the 4.x form, which 5.x reads too.

A value of the wrong type is refused with the file and the field named, before any tensor is read:
`"tie_word_embeddings": "false"` is a string, not false, and would otherwise drop lm_head.weight.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

import torch

from models.config import FAMILIES as FAMILY_NAMES
from models.config import ModelConfig
from models.rope import ORIGINAL_LENGTH, DynamicRope, rope_scaling_from_dict

REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
# Each field read, its kind and its default when absent (LlamaConfig's; FAMILIES overrides some); kinds are checked
# by `_typed`.
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
    # sliding windows: Qwen2/Qwen3 (use_sliding_window, max_window_layers), Mistral (every layer), Gemma 3
    "sliding_window": ("whole or null", None), "use_sliding_window": ("bool", False),
    "max_window_layers": ("whole", 28), "layer_types": ("texts or null", None),
    "sliding_window_pattern": ("whole", 6),  # Gemma 3 before layer_types: every 6th layer global
    # Gemma 3
    "hidden_activation": ("text", "gelu_pytorch_tanh"), "query_pre_attn_scalar": ("number", 256),
    "rope_local_base_freq": ("number", 10000.0), "final_logit_softcapping": ("number or null", None),
    "attn_logit_softcapping": ("number or null", None), "use_bidirectional_attention": ("bool or null", None),
}
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")  # kept through a conversion
KIND_NAMES = {"whole": "a whole number", "number": "a number", "text": "a string", "bool": "true or false",
              "object": "a JSON object", "id": "a token id (a whole number >= 0)",
              "ids": "a token id or a list of them", "texts": "a list of strings"}


class Family(NamedTuple):
    """How one architecture is spelled in a Hugging Face directory."""

    model_type: str
    architecture: str
    name: str  # for messages and docs
    defaults: dict[str, Any]  # its config class's defaults where they differ from FIELDS'


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", "LLaMA", {}),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", "Qwen2 / Qwen2.5", {"max_position_embeddings": 32768}),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", "Qwen3", {"max_position_embeddings": 32768, "head_dim": 128}),
    "mistral": Family("mistral", "MistralForCausalLM", "Mistral",
                      {"max_position_embeddings": 131072, "sliding_window": 4096}),
    "gemma3": Family("gemma3_text", "Gemma3ForCausalLM", "Gemma 3 (text)",
                     {"max_position_embeddings": 131072, "head_dim": 256, "tie_word_embeddings": True,
                      "rope_theta": 1_000_000.0, "sliding_window": 4096, "bos_token_id": 2, "eos_token_id": 1,
                      "pad_token_id": 0}),
}
assert tuple(FAMILIES) == FAMILY_NAMES
ACCEPTED = ", ".join(f"{f.name} ({f.architecture}, model_type {f.model_type!r})" for f in FAMILIES.values())


def _is(kind: str, value: Any) -> bool:
    """Whether `value` is of `kind` (a key of KIND_NAMES); a bool is not a number."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return (whole or isinstance(value, float)) and math.isfinite(value)
    if kind == "id":
        return whole and value >= 0
    if kind == "ids":
        return _is("id", value) or isinstance(value, list) and bool(value) and all(_is("id", v) for v in value)
    if kind == "texts":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return {"whole": whole, "text": isinstance(value, str), "bool": isinstance(value, bool),
            "object": isinstance(value, dict)}[kind]


def _typed(hf: dict, where: Path | str, family: Family) -> dict[str, Any]:
    """The fields of FIELDS in `hf`, `family`'s defaults filled in; a ValueError naming the first of the wrong type."""
    values = {}
    for key, (kind, default) in FIELDS.items():
        value = hf.get(key, family.defaults.get(key, default))
        kinds = kind.removesuffix(" or null").split(" or ")
        if not (value is None and kind.endswith("or null")) and not any(_is(k, value) for k in kinds):
            wanted = " or ".join(KIND_NAMES[k] for k in kinds) + (" (or null)" if kind.endswith("or null") else "")
            raise ValueError(f"{where}: {key} = {value!r} must be {wanted}")
        values[key] = value
    return values


def family_of(hf: dict, where: Path | str) -> str:
    """The key of FAMILIES that config.json `hf` describes; a ValueError saying which architectures are accepted."""
    architectures = hf.get("architectures") or []
    for key, family in FAMILIES.items():
        if hf.get("model_type") == family.model_type or family.architecture in architectures:
            return key
    hint = ""
    if hf.get("model_type") == "gemma3" or "Gemma3ForConditionalGeneration" in architectures:
        hint = ("; this is Gemma 3's vision-language checkpoint: save its language model alone "
                "(Gemma3ForCausalLM, model_type 'gemma3_text') and pass that directory")
    raise ValueError(f"{where} describes model_type {hf.get('model_type')!r} {architectures}, which burst does not "
                     f"read; it accepts {ACCEPTED}{hint}")


def config_from_hf(hf: dict, where: Path | str) -> ModelConfig:
    """ModelConfig from a transformers 4.x (rope_theta, rope_scaling) or 5.x (rope_parameters) config.json of any
    family of FAMILIES."""
    if not isinstance(hf, dict):
        raise ValueError(f"{where} holds {type(hf).__name__}, not a JSON object: it is not a config.json")
    family = family_of(hf, where)
    missing = [key for key in REQUIRED_SIZES if key not in hf]
    if missing:
        raise ValueError(f"{where} lacks {missing}; it is not a complete {FAMILIES[family].architecture} config")
    hf_fields = _typed(hf, where, FAMILIES[family])
    if hf_fields["num_attention_heads"] < 1:
        raise ValueError(f"{where}: num_attention_heads = {hf['num_attention_heads']} must be at least 1")
    if hf_fields["mlp_bias"]:
        raise ValueError(f"{where}: mlp_bias=true is not supported (the native model's MLP has no biases)")
    try:
        return ModelConfig(
            dim=hf_fields["hidden_size"], n_layers=hf_fields["num_hidden_layers"],
            n_heads=hf_fields["num_attention_heads"],
            n_kv_heads=hf_fields["num_key_value_heads"] or hf_fields["num_attention_heads"],
            head_dim=hf_fields["head_dim"] or hf_fields["hidden_size"] // hf_fields["num_attention_heads"],
            vocab_size=hf_fields["vocab_size"], ffn_hidden_dim=hf_fields["intermediate_size"],
            norm_eps=hf_fields["rms_norm_eps"], **_rope(hf_fields, where, family),
            max_seq_len=hf_fields["max_position_embeddings"], tie_embeddings=hf_fields["tie_word_embeddings"],
            init_std=hf_fields["initializer_range"], bos_token_id=hf_fields["bos_token_id"],
            eos_token_id=hf_fields["eos_token_id"], pad_token_id=hf_fields["pad_token_id"],
            unk_token_id=hf_fields["unk_token_id"], family=family,
            **_family_fields(hf_fields, where, family), **_windows(hf_fields, family))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _family_fields(hf: dict[str, Any], where: Path | str, family: str) -> dict[str, Any]:
    """The ModelConfig fields that set `family` apart, refusing what the native model cannot run."""
    if family == "gemma3":
        for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
            if hf[key]:
                raise ValueError(f"{where}: {key} = {hf[key]!r} is not supported (Gemma 3's text models have none)")
        if hf["hidden_activation"] != "gelu_pytorch_tanh":
            raise ValueError(f"{where}: hidden_activation = {hf['hidden_activation']!r} is not supported "
                             f"(the native Gemma 3 MLP is 'gelu_pytorch_tanh')")
        return {"qkv_bias": hf["attention_bias"], "out_bias": hf["attention_bias"], "qk_norm": True,
                "norm_plus_one": True, "sandwich_norms": True, "scale_embeddings": True, "activation": "gelu_tanh",
                "query_pre_attn_scalar": hf["query_pre_attn_scalar"]}
    if hf["hidden_act"] != "silu":
        raise ValueError(f"{where}: hidden_act = {hf['hidden_act']!r} is not supported (the native model has 'silu')")
    if family == "qwen2":  # Qwen2Attention: q, k and v always biased, o never
        return {"qkv_bias": True}
    bias = hf["attention_bias"] and family != "mistral"  # MistralAttention has no biases
    return {"qkv_bias": bias, "out_bias": bias, "qk_norm": family == "qwen3"}


def _windows(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """sliding_window and layer_types as transformers' config classes resolve them."""
    window, layer_types = hf["sliding_window"], hf["layer_types"]
    if family in ("qwen2", "qwen3"):
        window = window if hf["use_sliding_window"] else None
        if layer_types is None:  # Qwen: the layers from max_window_layers on slide
            layer_types = ["sliding_attention" if i >= hf["max_window_layers"] else "full_attention"
                           for i in range(hf["num_hidden_layers"])]
    elif family == "gemma3" and layer_types is None:
        pattern = hf["sliding_window_pattern"]
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(hf["num_hidden_layers"])]
    elif family in ("llama", "mistral"):
        window = window if family == "mistral" else None
        layer_types = None  # Mistral: the window is on every layer
    if window is None:
        return {}
    if layer_types is not None and "sliding_attention" not in layer_types:
        return {}
    return {"sliding_window": window, "layer_types": layer_types}


def _rope(hf: dict[str, Any], where: Path | str, family: str = "llama") -> dict[str, Any]:
    """rope_theta and rope_scaling of a typed HF config, as transformers standardises them; for Gemma 3 also its
    local layers' base (4.x: rope_local_base_freq; 5.x: rope_parameters per layer type)."""
    if family == "gemma3":
        return _gemma3_rope(hf, where)
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


def _gemma3_rope(hf: dict[str, Any], where: Path | str) -> dict[str, Any]:
    """Gemma 3's two RoPEs: the global layers' (scaled as rope_scaling says) and the local layers' plain one."""
    per_type = hf["rope_parameters"] or {}
    local_theta = hf["rope_local_base_freq"]
    if "full_attention" in per_type or "sliding_attention" in per_type:  # 5.x
        local = dict(per_type.get("sliding_attention") or {})
        local_theta = local.pop("rope_theta", local_theta)
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ValueError(f"{where}: the sliding layers' rope {local!r} is not supported (Gemma 3's is plain)")
        per_type = per_type.get("full_attention") or {}
    if not _is("number", local_theta) or local_theta <= 0:
        raise ValueError(f"{where}: the sliding layers' rope_theta = {local_theta!r} must be a number > 0")
    global_rope = _rope({**hf, "rope_parameters": per_type}, where)
    return {**global_rope, "rope_local_theta": local_theta}


def config_to_hf(config: ModelConfig, dtype: torch.dtype) -> dict:
    """A config.json that transformers 4.x and 5.x load as the family's *ForCausalLM (LlamaForCausalLM, ...).

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
    family = FAMILIES[config.family]
    return {
        **longrope, "architectures": [family.architecture], "model_type": family.model_type,
        **_family_to_hf(config), "hidden_size": config.dim, "intermediate_size": config.ffn_hidden_dim,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim, "vocab_size": config.vocab_size,
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta, "rope_scaling": rope_scaling,
        "max_position_embeddings": max_length, "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std, "torch_dtype": str(dtype).removeprefix("torch."), **specials,
    }


def _family_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json fields of `config`'s family that say what sets it apart; a ValueError when that family's
    Hugging Face architecture cannot express `config` (a window on some layers of a Mistral, say)."""
    expected = config_from_hf(_family_fields_probe(config), "probe")  # what the family's own reader would build
    kinds = ("qkv_bias", "out_bias", "qk_norm", "norm_plus_one", "sandwich_norms", "scale_embeddings", "activation")
    differing = [name for name in kinds if getattr(expected, name) != getattr(config, name)]
    windows = [config.window(i) for i in range(config.n_layers)]
    if config.family == "mistral" and len(set(windows)) > 1:
        differing.append("layer_types")
    if config.family == "llama" and config.sliding_window is not None:
        differing.append("sliding_window")
    if differing:
        raise ValueError(f"a {FAMILIES[config.family].name} model cannot have the {', '.join(differing)} of this "
                         f"one; it cannot be exported as {FAMILIES[config.family].architecture}")
    layer_types = ["full_attention" if window is None else "sliding_attention" for window in windows]
    if config.family == "gemma3":
        return {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": config.qkv_bias,
                "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim,
                "rope_local_base_freq": config.rope_local_theta or config.rope_theta,
                "sliding_window": config.sliding_window, "layer_types": layer_types,
                "final_logit_softcapping": None, "attn_logit_softcapping": None}
    fields = {"hidden_act": "silu"}
    if config.family in ("llama", "qwen3"):
        fields.update(attention_bias=config.qkv_bias, mlp_bias=False)
    if config.family == "mistral":
        fields["sliding_window"] = config.sliding_window
    if config.family in ("qwen2", "qwen3"):
        sliding = [i for i, window in enumerate(windows) if window is not None]
        fields.update(use_sliding_window=bool(sliding), sliding_window=config.sliding_window,
                      max_window_layers=sliding[0] if sliding else config.n_layers, layer_types=layer_types)
    return fields


def _family_fields_probe(config: ModelConfig) -> dict[str, Any]:
    """The smallest config.json of `config`'s family, with its biases, for `_family_to_hf` to compare against."""
    family = FAMILIES[config.family]
    return {"model_type": family.model_type, "hidden_size": 2, "num_hidden_layers": 1, "num_attention_heads": 1,
            "head_dim": 2, "vocab_size": 1, "intermediate_size": 1, "attention_bias": config.qkv_bias,
            "hidden_activation": "gelu_pytorch_tanh"}


def generation_config_to_hf(config: ModelConfig) -> dict | None:
    """The generation_config.json transformers derives from a model's config (its special ids), for an export whose
    source had none (a run); None when the model names no special id."""
    specials = {name: getattr(config, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")
                if getattr(config, name) is not None}
    return {**specials, "_from_model_config": True} if specials else None


def readable_by_transformers_4_and_5(fields: dict[str, Any]) -> dict[str, Any]:
    """A config.json's `fields` with RoPE in transformers 4.x's form (rope_theta, rope_scaling; torch_dtype; Gemma 3's
    rope_local_base_freq), which 5.x reads too. 4.x ignores 5.x's `rope_parameters`: a model saved by 5.x would run
    there at the default theta, unscaled, without a word. A rope_scaling already there stays (it wins, as burst and
    transformers read it)."""
    fields = dict(fields)
    rope = dict(fields.pop("rope_parameters", None) or {})
    if "full_attention" in rope:  # Gemma 3's per layer type: 4.x keeps the local layers' base beside
        fields["rope_local_base_freq"] = (rope.get("sliding_attention") or {}).get("rope_theta", 10000.0)
        rope = dict(rope["full_attention"])
    if "rope_theta" in rope:
        fields["rope_theta"] = rope.pop("rope_theta")
    if fields.get("rope_scaling") is None:
        fields["rope_scaling"] = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    if "dtype" in fields:
        fields["torch_dtype"] = fields.pop("dtype")
    return fields
