"""Write a native checkpoint of fresh weights of any size, one tensor at a time (for start-up benchmarks).

    python benchmarks/make_checkpoint.py /tmp/model-1b --dim 2048 --layers 16 --heads 16 --kv-heads 8 \
        --ffn 8192 --vocab 4096
    burst train --model /tmp/model-1b --cp 2 --steps 1 --seq-len 256 --precision fp32

The model is never whole in memory: each tensor is drawn (models/init.py, seed 0) and written to
safetensors files of at most --shard-mib, so a model larger than this machine's memory can be made.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import torch

from models import ModelConfig
from models.checkpoint import expected_shapes
from models.convert import Checkpoint, write_native
from models.init import initial_rows
from models.storage import atomic_directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--kv-heads", type=int, required=True)
    parser.add_argument("--ffn", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--shard-mib", type=int, default=1024)
    args = parser.parse_args()
    config = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                         ffn_hidden_dim=args.ffn, vocab_size=args.vocab)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in expected_shapes(config).items():
            yield name, initial_rows(config, name, shape, seed=0, rows=range(shape[0]))

    with atomic_directory(args.out) as tmp:
        write_native(Checkpoint(config, tensors), tmp, args.shard_mib * 2**20)
    count = sum(torch.Size(shape).numel() for shape in expected_shapes(config).values())
    print(f"wrote {args.out}: {count:,} parameters, {count * 4 / 2**30:.2f} GiB in float32")


if __name__ == "__main__":
    main()
