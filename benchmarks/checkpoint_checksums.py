"""What checkpoint checksums cost: DCP's save with and without hashing the shards as they are written, side by
side, and the check a reader makes (every file read and hashed once), in one process.

    python benchmarks/checkpoint_checksums.py --mib 512 --repeats 5 --dir /tmp/ckpt-bench

The two saves alternate, so they share whatever else the machine is doing; wall and CPU seconds of this
process are printed for each, and the medians. The files are written with fsync, as training saves them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from checkpoints.training import CHECKSUMS, MARKER, VERIFIED_ENV, check_checksums
from models.storage import write_json
from trainer.saving import _ChecksummedWriter, checksums


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="size of the state saved, MiB (fp32 tensors of 16 MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ckpt-bench"))
    args = parser.parse_args()
    state = {"model": {f"w{i}": torch.randn(4 * 2**20) for i in range(args.mib // 16)}}
    results: dict[str, list[tuple[float, float]]] = {"plain": [], "checksummed": [], "check": []}
    for _ in range(args.repeats):
        for kind in ("plain", "checksummed"):
            path = args.dir / kind
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            if kind == "plain":
                results[kind].append(timed(lambda p=path: dcp.save(state, checkpoint_id=str(p), no_dist=True)))
            else:
                def save(p=path) -> None:
                    dcp.save(state, storage_writer=_ChecksummedWriter(p, 0), no_dist=True)
                    write_json({"step": 0, CHECKSUMS: checksums(p)}, p / MARKER)
                results[kind].append(timed(save))
        results["check"].append(timed(lambda: check_checksums(args.dir / "checksummed")))
        os.environ.pop(VERIFIED_ENV, None)  # check again next time
    for kind, runs in results.items():
        print(f"{kind:12s} wall {statistics.median(w for w, _ in runs):6.3f} s  cpu "
              f"{statistics.median(c for _, c in runs):6.3f} s   (each: "
              + ", ".join(f"{w:.2f}/{c:.2f}" for w, c in runs) + ")")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
