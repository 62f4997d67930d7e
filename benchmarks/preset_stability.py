"""Whether each preset of 1B parameters or more trains stably at its defaults (its recipe: models/config.py), and
whether it did at the old defaults (tiny's: lr 2e-3, 5 warmup steps), on the default corpus.

A 1B model does not train on a 2-core CPU, so each preset is shrunk: the same family (heads per kv head, RoPE,
tied embeddings, MLP width relative to dim) at --dim and --layers, registered under NAME-shrunk with NAME's recipe,
and trained by the plain `train(config)` of `burst train`. Stable: no loss after the first step above the first
step's (about ln(vocabulary): the loss of guessing) by more than NOISE, a batch's difference at initialisation.

    python benchmarks/preset_stability.py --steps 50 --seq-len 256 --dim 256 --layers 4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from models.config import PRESETS, ModelConfig, Preset
from trainer.config import TrainConfig
from trainer.train import train

OLD_DEFAULTS = {"lr": 2e-3, "warmup": 5, "min_lr_ratio": 0.1}  # every preset's before the recipes
LARGE = 10**9  # parameters from which a preset is checked
# How far a later loss may rise above the first step's before the run counts as diverging: at initialisation the
# loss of one batch differs from another's by a few hundredths (the first steps' learning rates barely move it).
NOISE = 0.1


@dataclass(frozen=True)
class Outcome:
    preset: str
    defaults: str  # "recipe" or "old"
    steps: int
    lr: float
    first_loss: float
    max_loss_after_first: float
    last_loss: float

    @property
    def stable(self) -> bool:
        return self.max_loss_after_first <= self.first_loss + NOISE


def parameters(config: ModelConfig) -> int:
    """Weights of `config` (embeddings once when tied)."""
    kv = config.head_dim * config.n_kv_heads
    block = config.dim * (2 * config.dim + 2 * kv) + 3 * config.dim * config.ffn_hidden_dim + 2 * config.dim
    embeddings = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2)
    return config.n_layers * block + embeddings + config.dim


def large_presets() -> list[str]:
    return [name for name, preset in PRESETS.items() if parameters(preset.model) >= LARGE]


def shrunk(name: str, dim: int, layers: int) -> str:
    """Register NAME-shrunk: preset `name` at about `dim` (a whole number of its kv groups of heads half as wide as
    its own, at least 32) and `layers`, its heads per kv head and MLP width over dim kept, with `name`'s recipe;
    returns the new name."""
    preset = PRESETS[name].model
    group, head = preset.n_heads // preset.n_kv_heads, max(32, preset.head_dim // 2)
    kv_heads = max(1, round(dim / head / group))
    width = kv_heads * group * head
    ffn = round(preset.ffn_hidden_dim / preset.dim * width / 32) * 32
    small = dataclasses.replace(preset, dim=width, n_layers=layers, n_heads=kv_heads * group, n_kv_heads=kv_heads,
                                ffn_hidden_dim=ffn, ffn_dim_multiplier=None, head_dim=head)
    PRESETS[f"{name}-shrunk"] = Preset(small, PRESETS[name].recipe)
    return f"{name}-shrunk"


def run(model: str, steps: int, seq_len: int, batch_size: int, out: Path, **settings: float) -> list[dict]:
    """Train `model` for `steps` steps in this process; its metrics.jsonl's step rows."""
    config = TrainConfig(model=model, steps=steps, seq_len=seq_len, batch_size=batch_size, precision="fp32",
                         val_tokens=0, out=str(out), **settings)
    with contextlib.redirect_stdout(io.StringIO()):  # the settings table and live display of each run
        train(config)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row and "event" not in row]


def outcome(preset: str, defaults: str, rows: list[dict]) -> Outcome:
    losses = [row["loss"] for row in rows]
    return Outcome(preset, defaults, len(rows), max(row["lr"] for row in rows), losses[0], max(losses[1:]),
                   losses[-1])


def table(outcomes: list[Outcome]) -> str:
    lines = ["| preset (shrunk) | defaults | steps | peak lr reached | first loss | max loss, steps 2+ | last loss "
             "| stable |", "|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.preset} | {o.defaults} | {o.steps} | {o.lr:.2e} | {o.first_loss:.3f} | "
                     f"{o.max_loss_after_first:.3f} | {o.last_loss:.3f} | {'yes' if o.stable else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--presets", default=None, help="Comma-separated; default: every preset of 1B or more.")
    parser.add_argument("--no-old", action="store_true", help="Skip the runs at the old defaults.")
    args = parser.parse_args()
    names = args.presets.split(",") if args.presets else large_presets()
    outcomes = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            model = shrunk(name, args.dim, args.layers)
            for defaults, settings in (("recipe", {}), ("old", OLD_DEFAULTS))[:1 if args.no_old else 2]:
                rows = run(model, args.steps, args.seq_len, args.batch_size, Path(scratch) / f"{name}-{defaults}",
                           **settings)
                outcomes.append(outcome(name, defaults, rows))
                print(table(outcomes[-1:]).splitlines()[-1], flush=True)
    print(table(outcomes))


if __name__ == "__main__":
    main()
