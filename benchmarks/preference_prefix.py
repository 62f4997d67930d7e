"""Prefix sharing against --no-prefix-sharing: long prompts, short answers, at cp 2.

Pairs are made from the default corpus (the standard library's code, tokenized): a document of at least
--prompt + 2 x --answer tokens gives the prompt (its first --prompt tokens), the chosen answer (the next --answer)
and the rejected one (the --answer after those), written straight into a preference store. Each layout packs one
pair per sequence, as short as it fits: --prompt + 2 --answer tokens with the prompt shared, 2 (--prompt +
--answer) without. For each it reports, per pair:

    tiles     128 x 128 tiles of attention work, summed over the ranks (burst.balance.plan_work), forward
    MiB sent  what each rank's ring sends in one attention call (burst.cost.plan_bytes, the --model's heads, float32),
              forward and backward, the largest rank
    step s    the median step time of `burst train --objective simpo` on those sequences (one pair a step; the
              first --skip steps left out), unless --plan-only

    python benchmarks/preference_prefix.py --prompt 8192 --answer 256 --cp 2 --steps 4 --out runs/prefix
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from burst.balance import plan_work
from burst.cost import plan_bytes
from data import SequenceLoader, TokenStore, default_store
from data.chat import PLAIN
from data.store import StoreWriter, token_dtype
from models import ModelConfig
from planner.attention import sequence_plan

MIB = 2**20


def make_pairs(out: Path, prompt: int, answer: int, pairs: int) -> Path:
    """A preference store of `pairs` pairs cut from the default corpus's longest documents."""
    corpus = TokenStore(default_store())
    lengths = corpus.document_lengths
    needed = prompt - 1 + 2 * answer  # the prompt starts with BOS
    longest = np.argsort(-lengths)[:pairs]
    if lengths[longest[-1]] < needed:
        raise ValueError(f"the default corpus has {int((lengths >= needed).sum())} documents of {needed:,} tokens; "
                         f"lower --prompt, --answer or --pairs")
    store = out / "pairs"
    store.mkdir(parents=True, exist_ok=True)
    writer = StoreWriter(store, token_dtype(corpus.vocab_size), preferences=True)
    for i, document in enumerate(longest.tolist()):
        ids = np.concatenate([[corpus.bos_id], corpus.document(document)[:needed]]).astype(np.int64)
        writer.append([ids], rows=[(0, i + 1)], pairs=[(prompt, answer)])
    corpus.copy_tokenizer(store)
    writer.finish(np.zeros(0, np.int64), {"tokenizer": corpus.metadata["tokenizer"],
                                          "preference_files": [str(corpus.directory)],
                                          "chat": {"template": PLAIN, "sha256": "", "generation_blocks": True,
                                                   "note": "cut from the corpus, not rendered"}})
    return store


def sequence_figures(store: Path, seq_len: int, cp: int, sharing: bool, model: ModelConfig) -> dict:
    """Tiles and bytes of one packed sequence of `store` under the balanced layout."""
    batch = next(SequenceLoader(TokenStore(store), seq_len, 1, cp_size=cp, reset_positions=True,
                                cp_layout="balanced", prefix_sharing=sharing))
    (boundaries,) = [b.tolist() for b in batch.doc_boundaries]  # batch 1: one sequence
    sees = None if batch.doc_sees is None else batch.doc_sees[0].tolist()
    plan = sequence_plan(seq_len, cp, boundaries, sees, "balanced")
    work = plan_work(plan)
    shard = seq_len // cp
    q = torch.empty(1, shard, model.n_heads, model.head_dim, device="meta")
    k = torch.empty(1, shard, model.n_kv_heads, model.head_dim, device="meta")
    sent = [plan_bytes(plan, "flat", q, k, "auto", cp, rank) for rank in range(cp)]
    return {"seq_len": seq_len, "pairs": batch.num_pairs, "tiles": sum(work.forward),
            "forward_mib": max(s[0] for s in sent) / MIB, "backward_mib": max(s[2] for s in sent) / MIB}


def step_times(store: Path, out: Path, seq_len: int, cp: int, sharing: bool, args: argparse.Namespace) -> list[float]:
    run = out / ("shared" if sharing else "separate")
    command = [sys.executable, "-m", "cli", "train", "--model", args.model, "--data", str(store), "--objective",
               "simpo", "--doc-mask", "--seq-len", str(seq_len), "--cp", str(cp), "--steps", str(args.steps),
               "--precision", args.precision, "--val-tokens", "0", "--out", str(run),
               "--prefix-sharing" if sharing else "--no-prefix-sharing"]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=Path(__file__).parents[1])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["step_time_s"] for row in rows if "step" in row][args.skip:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--answer", type=int, default=256)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the median (start-up)")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--plan-only", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    store = make_pairs(args.out, args.prompt, args.answer, args.steps)
    model = ModelConfig.from_name(args.model)
    step = 2 * args.cp
    lengths = {True: args.prompt + 2 * args.answer, False: 2 * (args.prompt + args.answer)}
    results = {}
    for sharing, seq_len in lengths.items():
        seq_len += -seq_len % step  # a multiple of 2 x cp; the pair fits (+ 1 label)
        figures = sequence_figures(store, seq_len, args.cp, sharing, model)
        if not args.plan_only:
            times = step_times(store, args.out, seq_len, args.cp, sharing, args)
            figures |= {"step_s": statistics.median(times), "step_times_s": times}
        results["shared prompt" if sharing else "--no-prefix-sharing"] = figures
    shared, separate = results["shared prompt"], results["--no-prefix-sharing"]
    print(f"prompt {args.prompt:,} tokens, answers {args.answer:,}, cp {args.cp}, {args.model}, one pair a sequence")
    print(f"{'':22} {'seq_len':>8} {'tiles':>8} {'fwd MiB':>8} {'bwd MiB':>8} {'step s':>8}")
    for name, r in results.items():
        print(f"{name:22} {r['seq_len']:>8,} {r['tiles']:>8,} {r['forward_mib']:>8.1f} {r['backward_mib']:>8.1f} "
              f"{r.get('step_s', float('nan')):>8.2f}")
    ratios = {"tiles": separate["tiles"] / shared["tiles"],
              "bytes": (separate["forward_mib"] + separate["backward_mib"]) /
                       (shared["forward_mib"] + shared["backward_mib"])}
    if "step_s" in shared:
        ratios["step"] = separate["step_s"] / shared["step_s"]
    print("no-prefix-sharing / shared: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    (args.out / "preference_prefix.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                                 "results": results, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
