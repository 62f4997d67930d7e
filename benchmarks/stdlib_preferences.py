"""Preference pairs made from the default corpus: which line comes next in this module?

For every module of this interpreter's standard library of at most --max-chars characters, up to --per-module
places are drawn (with --seed) where a line of code of 20 to 120 characters follows at least --min-context
characters of the module. Each becomes one preference row in TRL's format, one JSON Lines row each:

    prompt:    "<the module up to that line>\\n\\nWhich line comes next?"
    chosen:    the line that comes next, as written
    rejected:  a line of the same length class from another module (never one the module itself holds)

The chosen answer is the continuation of the code in the prompt; the rejected one fits no context. The DPO example
of docs/preference-tuning.md uses it:

    python benchmarks/stdlib_preferences.py --out stdlib-prefs.jsonl
    burst prepare stdlib-prefs.jsonl --preference --tokenizer runs/pretrain --out stores/prefs --val-fraction 0.1
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from data.corpus import stdlib_sources

QUESTION = "\n\nWhich line comes next?"


def candidate_lines(source: str, min_context: int) -> list[tuple[int, str]]:
    """(offset, line) of each line of 20 to 120 characters past `min_context` characters, stripped of indentation."""
    found, offset = [], 0
    for line in source.splitlines(keepends=True):
        text = line.strip()
        if offset >= min_context and 20 <= len(text) <= 120 and not text.startswith("#"):
            found.append((offset, text))
        offset += len(line)
    return found


def rows(max_chars: int, per_module: int, min_context: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    modules = []
    for path in stdlib_sources():
        source = path.read_text(encoding="utf-8")
        if len(source) <= max_chars and source.strip():
            modules.append((source, candidate_lines(source, min_context)))
    every_line = [(i, text) for i, (_, lines) in enumerate(modules) for _, text in lines]
    out = []
    for i, (source, lines) in enumerate(modules):
        own = {text for _, text in lines}
        for offset, text in rng.sample(lines, min(per_module, len(lines))):
            while True:
                other, rejected = rng.choice(every_line)
                if other != i and rejected not in own:
                    break
            out.append({"prompt": source[:offset].rstrip() + QUESTION, "chosen": text, "rejected": rejected})
    rng.shuffle(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-chars", type=int, default=3000)
    parser.add_argument("--min-context", type=int, default=400)
    parser.add_argument("--per-module", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    made = rows(args.max_chars, args.per_module, args.min_context, args.seed)
    with open(args.out, "w") as f:
        for row in made:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(made):,} preference pairs to {args.out}")


if __name__ == "__main__":
    main()
