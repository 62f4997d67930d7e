"""Re-score a `burst eval --ruler --samples-out` file with transformers' greedy generation, and say whether every
task's score equals burst's.

    python scripts/ruler_rescore.py SAMPLES.jsonl MODEL_DIR           # a Hugging Face model directory
    python scripts/ruler_rescore.py SAMPLES.jsonl MODEL_DIR --batch 8 # 8 prompts at a time (left-padded)
    python scripts/ruler_rescore.py SAMPLES.jsonl MODEL_DIR --dtype bf16  # a run made with --precision bf16

Each sample's `prompt_token_ids` go to `AutoModelForCausalLM.generate` (float32 or bf16, do_sample=False,
`max_new_tokens` of the sample); the output is cut before the first end token (the tokenizer's EOS and
generation_config.json's), decoded, and scored by RULER's own string match (scripts/eval/synthetic/constants.py,
re-implemented here from its source, not from burst's): `string_match_all` for the synthetic tasks,
`string_match_part` for qa. It prints one line per task and length, transformers' score beside burst's, how many
outputs differ from burst's text, and exits 1 when a score differs. tests/test_ruler.py calls `rescore` on a small run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path


def ruler_postprocess(output: str) -> str:
    """RULER's postprocess_pred: control characters become newlines, the ends stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", output.strip()).strip()


def string_match(output: str, answers: list[str], part: bool) -> float:
    """RULER's string_match_all (the share of answers in the output) or string_match_part (100 if any is), each
    case-insensitive, for one sample, 0-100."""
    output = ruler_postprocess(output).lower()
    found = [answer.lower() in output for answer in answers]
    return 100.0 * (float(any(found)) if part else sum(found) / len(found))


@dataclass
class TaskScores:
    """One task at one length: burst's scores and transformers' of its samples, and the outputs that differ."""

    burst: list[float] = field(default_factory=list)
    transformers: list[float] = field(default_factory=list)
    differing_outputs: int = 0

    @staticmethod
    def average(scores: list[float]) -> float:
        return round(sum(scores) / len(scores), 2)

    @property
    def equal(self) -> bool:
        return self.average(self.burst) == self.average(self.transformers)


def transformers_outputs(model, tokenizer, end_ids: set[int], samples: list[dict], batch: int) -> list[str]:
    """transformers' greedy answer to each sample: `batch` prompts of the same max_new_tokens at a time, padded on
    the left (position ids follow the attention mask), each cut before its first end token."""
    import torch

    texts: dict[int, str] = {}
    by_new_tokens: dict[int, list[int]] = {}
    for index, sample in enumerate(samples):
        by_new_tokens.setdefault(sample["max_new_tokens"], []).append(index)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(end_ids)
    for new_tokens, indices in by_new_tokens.items():
        for start in range(0, len(indices), batch):
            chunk = indices[start:start + batch]
            prompts = [samples[i]["prompt_token_ids"] for i in chunk]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.no_grad():
                generated = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                           pad_token_id=pad)[:, width:].tolist()
            for index, row in zip(chunk, generated, strict=True):
                ends = [position for position, token in enumerate(row) if token in end_ids]
                texts[index] = tokenizer.decode(row[:ends[0]] if ends else row)
    return [texts[i] for i in range(len(samples))]


DTYPES = ("fp32", "bf16")


def rescore(samples: list[dict], model_dir: Path, batch: int = 1, dtype: str = "fp32"
            ) -> dict[tuple[str, int], TaskScores]:
    """Every (task, length) of `samples` (a --samples-out file's rows) re-scored with transformers' greedy
    generation from `model_dir` with weights in `dtype` (fp32 or bf16: the --precision burst ran with)."""
    import torch
    import transformers

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    end_ids = {tokenizer.eos_token_id}
    eos = model.generation_config.eos_token_id
    end_ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    outputs = transformers_outputs(model, tokenizer, end_ids, samples, batch)
    results: dict[tuple[str, int], TaskScores] = {}
    for sample, output in zip(samples, outputs, strict=True):
        scores = results.setdefault((sample["task"], sample["length"]), TaskScores())
        scores.burst.append(sample["score"])
        scores.transformers.append(string_match(output, sample["answers"], part=sample["task"] == "qa"))
        scores.differing_outputs += output != sample["output"]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("samples", type=Path, help="a burst eval --ruler --samples-out .jsonl file")
    parser.add_argument("model", type=Path, help="the Hugging Face model directory burst evaluated")
    parser.add_argument("--batch", type=int, default=1, help="prompts generated together (1)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="the weights' dtype: burst eval's --precision")
    args = parser.parse_args()
    if not args.samples.is_file() or not (args.model / "config.json").is_file():
        parser.error(f"{args.samples} must be a samples file and {args.model} a Hugging Face model directory")
    if args.batch < 1:
        parser.error(f"--batch {args.batch} must be at least 1")
    samples = [json.loads(line) for line in args.samples.read_text(encoding="utf-8").splitlines() if line.strip()]
    results = rescore(samples, args.model, args.batch, args.dtype)
    for (task, length), scores in results.items():
        print(f"{task:16} {length:>7,}  burst {scores.average(scores.burst):6.2f}  transformers "
              f"{scores.average(scores.transformers):6.2f}  {'equal' if scores.equal else 'DIFFERENT'}  "
              f"({scores.differing_outputs} of {len(scores.burst)} outputs differ)")
    every = all(scores.equal for scores in results.values())
    print("every task's score equals burst's" if every else "some scores differ")
    return 0 if every else 1


if __name__ == "__main__":
    sys.exit(main())
