"""transformers 4.x and 5.x, as the tests meet them: the two forms of a config.json's RoPE, and a loaded config's RoPE.

4.x writes and reads `rope_theta` + `rope_scaling` (and `torch_dtype`); 5.x writes `rope_parameters` (theta inside,
and `dtype`) and reads both. burst reads both forms under either release and writes the 4.x form; the tests build
Hugging Face models with the 4.x keyword arguments, which both releases accept.
"""

from __future__ import annotations

from typing import Any

import transformers

from models.hf_config import readable_by_transformers_4_and_5

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def transformers4_form(fields: dict[str, Any]) -> dict[str, Any]:
    """A config.json's fields as transformers 4.x writes them, whichever release wrote them."""
    return readable_by_transformers_4_and_5(fields)


def transformers5_form(fields: dict[str, Any]) -> dict[str, Any]:
    """A config.json's fields as transformers 5.x writes them, whichever release wrote them."""
    fields = transformers4_form(fields)
    theta, scaling = fields.pop("rope_theta"), fields.pop("rope_scaling")
    fields["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": theta}
    if "rope_local_base_freq" in fields:  # Gemma 3: one RoPE per layer type
        fields["rope_parameters"] = {"full_attention": fields["rope_parameters"], "sliding_attention":
                                     {"rope_type": "default", "rope_theta": fields.pop("rope_local_base_freq")}}
    if "torch_dtype" in fields:
        fields["dtype"] = fields.pop("torch_dtype")
    return fields


def rope_of(config: transformers.PretrainedConfig) -> dict[str, Any]:
    """A loaded config's RoPE as 5.x holds it ({rope_type, rope_theta, ...}): 4.x keeps it in rope_theta and
    rope_scaling (None for the default rope), 5.x in rope_parameters."""
    if TRANSFORMERS_MAJOR >= 5:
        return dict(config.rope_parameters)
    scaling = {key: value for key, value in (config.rope_scaling or {}).items() if key != "type"}  # 4.x adds `type`
    return {"rope_type": "default", **scaling, "rope_theta": config.rope_theta}
