"""Convert model checkpoints between Hugging Face directories (every family of models/hf_config.py) and the native
format.

Every source format is read into one `Checkpoint` (a ModelConfig plus a stream of tensors under
native names) and every target format is written from one; each source format (Hugging Face, native)
is one detector and one reader in SOURCE_FORMATS. Callers that know more formats pass a larger table
(checkpoints/sources.py adds the trainer's checkpoints and run directories). Tensor names
translate through the single HF_TO_NATIVE table; the native model uses Hugging Face's rotary layout, so no q/k
permutation is needed. Everything is validated from file headers before any tensor is read.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from models.checkpoint import CONFIG_NAME, check_tensor_shapes, expected_shapes, is_native_checkpoint, read_config
from models.config import ModelConfig
from models.hf_config import FAMILIES, config_from_hf, config_to_hf, generation_config_to_hf
from models.hf_tokenizer import check_tokenizer, copy_tokenizer_files, tokenizer_beside, write_hf_tokenizer
from models.lora import (
    PEFT_CONFIG,
    PEFT_TIED_HEAD,
    PEFT_WEIGHTS,
    TARGETS,
    Adapter,
    LoRAConfig,
    config_from_peft,
    is_trainable,
    native_name,
    peft_config,
    peft_name,
)
from models.storage import (
    DEFAULT_MAX_SHARD_BYTES,
    read_json,
    read_rows,
    read_tensors,
    tensor_files,
    tensor_shapes,
    write_json,
    write_tensors,
)
from runtime.directories import exclusive_writer
from runtime.failure import writing

# Hugging Face *ForCausalLM name -> native Transformer name; {} is the layer index. Every family shares it but Gemma 3,
# whose post_attention_layernorm norms the attention's output (sandwich norms), not the MLP's input.
HF_TO_NATIVE = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    **{f"model.layers.{{}}.self_attn.{hf}_proj.{kind}": f"layers.{{}}.attention.w{native}.{kind}"
       for hf, native in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o")) for kind in ("weight", "bias")},
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
NATIVE_TO_HF = {native: hf for hf, native in HF_TO_NATIVE.items()}
SANDWICH_HF_TO_NATIVE = {
    **HF_TO_NATIVE,
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.attention_out_norm.weight",
    "model.layers.{}.pre_feedforward_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.post_feedforward_layernorm.weight": "layers.{}.ffn_out_norm.weight",
}


def name_tables(config: ModelConfig) -> tuple[dict[str, str], dict[str, str]]:
    """(Hugging Face -> native, native -> Hugging Face) tensor names for `config`'s family."""
    hf_to_native = SANDWICH_HF_TO_NATIVE if config.sandwich_norms else HF_TO_NATIVE
    return hf_to_native, {native: hf for hf, native in hf_to_native.items()}

# Older transformers saved the rotary inverse frequencies as weights; they follow from the config.
HF_DERIVED_SUFFIX = "rotary_emb.inv_freq"
# Copied unchanged from source to destination when present (the tokenizer's files: hf_tokenizer.py).
GENERATION_CONFIG = "generation_config.json"


def rename(name: str, table: dict[str, str]) -> str:
    """Translate a tensor name through `table`; a name the table does not know comes back unchanged."""
    layer = re.search(r"\.(\d+)\.", name)
    key = name.replace(layer.group(0), ".{}.", 1) if layer else name
    if key not in table:
        return name
    return table[key].format(layer.group(1)) if layer else table[key]


@dataclass
class Checkpoint:
    """A validated source checkpoint: its config, its tensors, streamed under native names, and its tokenizer.

    `rows(name, rows)` reads only rows `rows` (dim 0) of one tensor, by native name, for a rank that
    keeps a shard of it; None where the format cannot (training checkpoints: resume those instead).
    """

    config: ModelConfig
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]  # a LoRA run's merged into its base (models/lora.py)
    tokenizer: Path | None = None  # the directory keeping the tokenizer the model was trained with, if any
    rows: Callable[[str, range], torch.Tensor] | None = None
    adapter: Callable[[], Adapter] | None = None  # a LoRA run's adapter alone (read when called)
    generation_config: Path | None = None  # the generation_config.json it came with (sampling settings), if any


def generation_config_beside(directory: Path) -> Path | None:
    """`directory`'s generation_config.json, or None."""
    return directory / GENERATION_CONFIG if (directory / GENERATION_CONFIG).is_file() else None


# ---- Hugging Face side -----------------------------------------------------------------------------------------

def is_hf_checkpoint(path: Path) -> bool:
    config = path / CONFIG_NAME
    return config.is_file() and bool({"model_type", "architectures"} & set(read_json(config)))


def read_hf(src: Path) -> Checkpoint:
    config = config_from_hf(read_json(src / CONFIG_NAME), src / CONFIG_NAME)
    files = tensor_files(src)
    # A tied checkpoint may still store lm_head.weight: it is the embedding matrix again.
    derived = {name for name in files if name.endswith(HF_DERIVED_SUFFIX)
               or (config.tie_embeddings and name == "lm_head.weight")}
    files = {name: file for name, file in files.items() if name not in derived}
    hf_to_native, native_to_hf = name_tables(config)
    expected = {rename(name, native_to_hf): shape for name, shape in expected_shapes(config).items()}
    check_tensor_shapes(tensor_shapes(files), expected, str(src))
    return Checkpoint(config, lambda: ((rename(name, hf_to_native), t) for name, t in read_tensors(files)),
                      tokenizer_beside(src),
                      lambda name, rows: read_rows(files[rename(name, native_to_hf)], rename(name, native_to_hf), rows),
                      generation_config=generation_config_beside(src))


def write_hf(checkpoint: Checkpoint, dst: Path, max_shard_bytes: int) -> None:
    dtypes = []
    native_to_hf = name_tables(checkpoint.config)[1]
    config_to_hf(checkpoint.config, torch.float32)  # a model its family cannot express is refused before any write

    def hf_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in checkpoint.tensors():
            dtypes.append(tensor.dtype)
            yield rename(name, native_to_hf), tensor

    write_tensors(hf_tensors(), dst, max_shard_bytes)
    write_json(config_to_hf(checkpoint.config, dtypes[0]), dst / CONFIG_NAME)


# ---- PEFT adapters ------------------------------------------------------------------------------------------------

def read_peft(src: Path, config: ModelConfig) -> Adapter:
    """The PEFT LoRA adapter in `src` (adapter_config.json, adapter_model.safetensors) under native names, checked
    against the base model `config` it is to load onto (--init-adapter)."""
    lora = config_from_peft(read_json(src / PEFT_CONFIG), str(src / PEFT_CONFIG))
    if not (src / PEFT_WEIGHTS).is_file():
        raise ValueError(f"{src} holds no {PEFT_WEIGHTS}; pass a PEFT adapter directory (save_pretrained writes one)")
    tensors = {native_name(name, lambda hf: rename(hf, HF_TO_NATIVE)): tensor
               for name, tensor in load_file(str(src / PEFT_WEIGHTS)).items()
               if not (config.tie_embeddings and name == PEFT_TIED_HEAD)}  # the embeddings' copy (write_peft)
    expected = expected_adapter_shapes(config, lora)
    trained = {name: shape for name, shape in expected_shapes(config).items()
               if lora.train_embeddings_and_norms and is_trainable(name, lora)}
    found = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    missing = sorted(set(expected) - set(found))
    wrong = sorted(name for name, shape in found.items() if {**expected, **trained}.get(name) != shape)
    if missing or wrong:
        raise ValueError(f"{src} does not fit the base model (dim {config.dim}, {config.n_layers} layers): "
                         + (f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(wrong[:3])}")
                         + "; pass the adapter trained on this base model")
    return Adapter(lora, tensors)


def expected_adapter_shapes(config: ModelConfig, lora: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """Each adapter tensor's native name and shape for `lora` on a model of `config`."""
    shapes = {}
    for name, shape in expected_shapes(config).items():
        target = next((t for t, (path, _) in TARGETS.items() if name.endswith(f".{path}.weight")), None)
        if target in lora.targets and name.startswith("layers."):
            (out_features, in_features), stem = shape, name.removesuffix(".weight")
            shapes[f"{stem}.lora_a"], shapes[f"{stem}.lora_b"] = (lora.rank, in_features), (out_features, lora.rank)
    return shapes


def write_peft(checkpoint: Checkpoint, dst: Path, max_shard_bytes: int) -> None:
    """The checkpoint's adapter as a PEFT directory that `PeftModel.from_pretrained` loads onto the base."""
    adapter = checkpoint.adapter()
    tensors = [(peft_name(name, lambda native: rename(native, NATIVE_TO_HF)), tensor.contiguous())
               for name, tensor in adapter.tensors.items()]
    tied = checkpoint.config.tie_embeddings
    if tied and adapter.lora.train_embeddings_and_norms:  # PEFT ties its lm_head to a saved copy it reads here
        tensors.append((PEFT_TIED_HEAD, adapter.tensors["tok_embeddings.weight"].clone()))
    write_json(peft_config(adapter.lora, None, tied), dst / PEFT_CONFIG)
    save_file(dict(tensors), str(dst / PEFT_WEIGHTS), metadata={"format": "pt"})


# ---- native side -----------------------------------------------------------------------------------------------

def read_native(src: Path) -> Checkpoint:
    config = read_config(src)
    files = tensor_files(src)
    check_tensor_shapes(tensor_shapes(files), expected_shapes(config), str(src))
    return Checkpoint(config, lambda: read_tensors(files), tokenizer_beside(src),
                      lambda name, rows: read_rows(files[name], name, rows),
                      generation_config=generation_config_beside(src))


def write_native(checkpoint: Checkpoint, dst: Path, max_shard_bytes: int) -> None:
    write_json(checkpoint.config.to_dict(), dst / CONFIG_NAME)
    write_tensors(checkpoint.tensors(), dst, max_shard_bytes)


# ---- detection and conversion ----------------------------------------------------------------------------------

class SourceFormat(NamedTuple):
    description: str  # what the user should pass, for the error that finds none
    detect: Callable[[Path], bool]
    read: Callable[[Path], Checkpoint]


SourceFormats = dict[str, SourceFormat]  # name -> format, tried in order
SOURCE_FORMATS: SourceFormats = {
    "hf": SourceFormat("a Hugging Face directory of LLaMA, Qwen2/2.5, Qwen3, Mistral or Gemma 3 (config.json with "
                       "model_type)", is_hf_checkpoint, read_hf),
    "burst": SourceFormat("a burst checkpoint (config.json with dim, n_layers)", is_native_checkpoint, read_native),
}
TARGET_FORMATS: dict[str, Callable[[Checkpoint, Path, int], None]] = {"hf": write_hf, "burst": write_native,
                                                                      "peft": write_peft}


def detect_format(path: Path, formats: SourceFormats = SOURCE_FORMATS) -> str:
    """The name of the source format of the checkpoint directory `path` (a key of `formats`)."""
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory; pass a checkpoint directory")
    for name, source in formats.items():
        if source.detect(path):
            return name
    raise ValueError(f"{path} is not a recognised checkpoint: expected "
                     + ", or ".join(source.description for source in formats.values()))


def read_checkpoint(path: str | Path, formats: SourceFormats = SOURCE_FORMATS) -> Checkpoint:
    """The checkpoint directory `path`, format detected, validated from file headers; tensors are read lazily."""
    path = Path(path)
    return formats[detect_format(path, formats)].read(path)


def _recognize(path: Path, formats: SourceFormats) -> str | None:
    """What checkpoint `path` holds, for a refusal to replace it (a run of `burst train`, a Hugging Face model)."""
    for name, source in formats.items():
        try:
            if source.detect(path):
                return hf_description(path) if name == "hf" else source.description
        except ValueError:  # a damaged config.json: not a format we can name
            continue
    return None


def hf_description(path: Path) -> str:
    """The Hugging Face directory `path` named by the family its config.json says it holds."""
    config = read_json(path / CONFIG_NAME)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    family = next((f.name for f in FAMILIES.values() if f.model_type == model_type), None)
    return (f"a Hugging Face {family or 'model'} directory (config.json with model_type {model_type!r})"
            if model_type else SOURCE_FORMATS["hf"].description)


def convert_checkpoint(src: str | Path, dst: str | Path, to: str, force: bool = False,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, formats: SourceFormats = SOURCE_FORMATS) -> Path:
    """Convert the checkpoint directory `src` (format detected) into `dst` in format `to` ("burst" or "hf").

    Tensors are streamed one at a time; `dst` appears only when complete (runtime/directories.py: one
    writer at a time, staged beside it). An existing `dst` is replaced only with force=True, only when burst
    wrote it as a model directory (never a run, a token store or a directory of the user's), and never when
    it holds `src`. The model's tokenizer comes along, written first, so a tokenizer that cannot be exported
    is refused before any weight is; a Hugging Face export gets the files `AutoTokenizer` loads
    (hf_tokenizer.py). A write that fails midway (disk full) raises WriteFailed. Returns `dst`.
    """
    if to not in TARGET_FORMATS:
        raise ValueError(f"unknown target format {to!r}; choose one of {', '.join(TARGET_FORMATS)}")
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve() or dst.resolve() in src.resolve().parents:
        raise ValueError(f"the destination {dst} holds the source {src}, which --force would delete; "
                         f"choose a destination outside it")
    with exclusive_writer(dst, "model") as directory:  # refused while another process writes `dst`
        directory.check_replaceable(force, recognize=lambda path: _recognize(path, formats))  # by name
        checkpoint = read_checkpoint(src, formats)
        if to == "peft" and checkpoint.adapter is None:
            raise ValueError(f"{src} holds no LoRA adapter: --to peft exports the adapter of a run trained with "
                             f"--lora-rank; --to hf or burst converts a whole model")
        if checkpoint.tokenizer is not None:
            check_tokenizer(checkpoint.tokenizer)  # a damaged one is refused here, before DST is touched
        kept = f"; {dst} is as it was before" if dst.exists() else f"; {dst} was not created"
        with directory.staging() as tmp, writing(dst, kept):
            if checkpoint.tokenizer is not None and to == "hf":
                write_hf_tokenizer(checkpoint.tokenizer, tmp, checkpoint.config)
            elif checkpoint.tokenizer is not None:
                copy_tokenizer_files(checkpoint.tokenizer, tmp)
            TARGET_FORMATS[to](checkpoint, tmp, max_shard_bytes)
            if checkpoint.generation_config is not None:  # its sampling settings, from the model a run started from
                shutil.copy2(checkpoint.generation_config, tmp / GENERATION_CONFIG)
            elif to == "hf" and generation_config_to_hf(checkpoint.config) is not None:  # a run from scratch has none
                write_json(generation_config_to_hf(checkpoint.config), tmp / GENERATION_CONFIG)
    return dst
