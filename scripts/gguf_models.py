"""What scripts/smollm2.py and scripts/gemma3.py share: a GGUF file read by transformers into a Hugging Face
model directory, and that directory made once into the cache however many processes ask for it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from models.hf_config import readable_by_transformers_4_and_5
from runtime.directories import exclusive_writer

COMPLETE = "model.safetensors"  # written last by write_hf_directory: the directory is whole


def write_hf_directory(gguf: Path, out: Path, model_class: str) -> None:
    """Write what `save_pretrained` writes for the GGUF's model (float32, tied embeddings, its tokenizer and
    generation config) into `out`; `model_class` names the transformers class (LlamaForCausalLM, ...)."""
    import torch
    try:
        import gguf as _  # noqa: F401  (transformers reads GGUF files through it)
        import transformers
        from transformers import AutoConfig, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as err:
        raise FileNotFoundError(f"reading the GGUF takes transformers and gguf ({err.name} is missing): "
                                f"pip install 'burst-attention[dev]', or pip install transformers gguf") from None

    model_type = getattr(transformers, model_class)
    # from_pretrained(gguf_file=...) for the model wants `accelerate`; the pieces it uses do not.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        model = model_type(config)
    weights = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    model = model_type(config)
    loaded = model.load_state_dict(weights, strict=False)
    if loaded.unexpected_keys or set(loaded.missing_keys) - {"lm_head.weight"}:
        raise ValueError(f"{gguf.name}: its tensors do not fit a {model_class} of its config: {loaded}")
    model.tie_weights()
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    model.save_pretrained(out)  # config.json and model.safetensors (COMPLETE) last
    # transformers 5.x saves RoPE as rope_parameters (per layer type for Gemma 3), which 4.x ignores (a LLaMA would
    # run at theta 10,000): both read the form written here
    config_file = out / "config.json"
    config_file.write_text(json.dumps(readable_by_transformers_4_and_5(json.loads(config_file.read_text())),
                                      indent=2) + "\n")


def made_once(directory: Path, make: Callable[[Path], None]) -> Path:
    """`directory`, made by make(staging) on first use and reused afterwards: one process makes it under the
    directory's writer lock, in a staging directory renamed into place when complete; the others wait."""
    if (directory / COMPLETE).is_file():  # complete directories are only ever installed whole: no lock to read
        return directory
    with exclusive_writer(directory, "model", wait=True) as writer:
        if not (directory / COMPLETE).is_file():
            writer.check_replaceable(force=True)
            with writer.staging() as tmp:
                make(tmp)
    return directory
