"""Training steps of one setting's values side by side: wall and CPU seconds per step, and the losses.

Every rank builds one model per value (same weights, same batches) and takes their steps in turn,
so the values share whatever else the machine is doing; CPU seconds (this process's, rank 0)
are the steadier figure on a shared machine. Peak memory needs one process per value: use
`burst train` for it (its metrics.jsonl holds peak_mem_mib).

    python benchmarks/step_modes.py --model tiny --seq-len 8192 --cp 2 --setting activation_checkpointing \
        --values none,selective,full --steps 2
    python benchmarks/step_modes.py --model tiny --seq-len 2048 --setting compile --values false,true --steps 6
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from data import SequenceLoader, TokenStore
from runtime.launch import run_local
from trainer.config import TrainConfig
from trainer.distributed import init_distributed
from trainer.parallelize import build_model
from trainer.preflight import check_run
from trainer.step import train_step


def steps_of_each(config: TrainConfig, setting: str, values: list, steps: int) -> dict[str, list[tuple]]:
    """{value: [(wall s, CPU s, loss) per step]} on this rank."""
    checked = check_run(config, config.world_size)
    env = init_distributed(checked.config)
    runs = {}
    for value in values:
        run_config = dataclasses.replace(checked.config, precision=checked.precision.name, **{setting: value})
        model = build_model(checked.model_config, env.mesh, run_config, env.device)
        loader = SequenceLoader(TokenStore(run_config.data).split("train"), run_config.seq_len, 1,
                                cp_rank=env.cp_rank, cp_size=run_config.cp, seed=run_config.seed)
        runs[str(value)] = (run_config, model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader, [])
    for _ in range(steps):
        for run_config, model, optimizer, loader, times in runs.values():
            wall, cpu = time.perf_counter(), time.process_time()
            loss = train_step(model, optimizer, [next(loader)], run_config, env, check_ranks=False).loss
            times.append((time.perf_counter() - wall, time.process_time() - cpu, loss))
    return {value: run[-1] for value, run in runs.items()}


def parse_value(text: str):
    return {"true": True, "false": False}.get(text, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--setting", required=True, help="a TrainConfig field, e.g. activation_checkpointing")
    parser.add_argument("--values", required=True, help="comma-separated values of the setting")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    config = TrainConfig(model=args.model, seq_len=args.seq_len, cp=args.cp, precision=args.precision,
                         out="runs/step-modes-unused")
    values = [parse_value(v) for v in args.values.split(",")]
    results = run_local(steps_of_each, args.cp, (config, args.setting, values, args.steps))[0]
    for value, times in results.items():
        print(f"{args.setting}={value}: " + " | ".join(f"wall {w:.1f} s, CPU {c:.1f} s, loss {loss:.6f}"
                                                      for w, c, loss in times))


if __name__ == "__main__":
    main()
