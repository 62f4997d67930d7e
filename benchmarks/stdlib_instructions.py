"""Instruction data made from the default corpus: "what does function F in module M return?", the module as context.

For every module of this interpreter's standard library of at most --max-chars characters (so a conversation
fits a sequence of a few thousand tokens), `ast` finds the functions and methods with a single `return <expr>`
whose expression is one short line, and not one a model could guess without reading (None, True, False, self,
a bare literal). Up to --per-module of them per module, drawn with --seed, become conversations in the OpenAI /
Hugging Face chat format, one JSON Lines row each:

    user:       <the module's source>

                In the module M above, what does the function F return? Answer with the returned expression.
    assistant:  <the expression, as written in the source>

The answer is in the context, verbatim, at the function's return statement: `burst eval`'s question answering
places it there (its depth in the prompt). The fine-tuning example (docs/instruction-tuning-example.md) uses it:

    python benchmarks/stdlib_instructions.py --out stdlib-qa.jsonl
    burst prepare stdlib-qa.jsonl --chat --tokenizer runs/pretrain --out stores/stdlib-qa --val-fraction 0.1

On a real instruct model, SmolLM2-135M-Instruct (scripts/smollm2.py), the conversations are rendered with its own
ChatML template (its chat_template.jinja, default system prompt included), and modules up to its 8,192-token
context fit (about 3.5 characters a token on this code):

    SMOL=$(python scripts/smollm2.py)
    python benchmarks/stdlib_instructions.py --out smol-qa.jsonl --max-chars 24000
    burst prepare smol-qa.jsonl --chat --tokenizer $SMOL --out stores/smol-qa --val-fraction 0.05
    burst eval --checkpoint $SMOL --data stores/smol-qa --seq-len 8192 --qa-samples 64 --json before.json
    burst train --model $SMOL --data stores/smol-qa --seq-len 8192 --cp 2 --doc-mask --steps 100 --lr 3e-5 \
        --out runs/smol-qa
    burst eval --checkpoint runs/smol-qa --data stores/smol-qa --seq-len 8192 --qa-samples 64 --json after.json
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from data.corpus import stdlib_sources

QUESTION = ("In the module {module} above, what does the function {function} return? Answer with the returned "
            "expression.")
GUESSABLE = {"None", "True", "False", "self", "NotImplemented", "0", "1", "-1", "''", '""', "[]", "{}", "()"}


def returned_expressions(tree: ast.Module, source: str, max_answer: int) -> Iterator[tuple[str, str]]:
    """(qualified name, returned expression) of every function or method whose body returns one value once."""
    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                returns = [n for n in ast.walk(child) if isinstance(n, ast.Return)]
                nested = [n for n in ast.walk(child) if n is not child and isinstance(n, ast.FunctionDef | ast.Lambda)]
                if len(returns) == 1 and returns[0].value is not None and not nested:
                    answer = ast.get_source_segment(source, returns[0].value)
                    if answer and "\n" not in answer and len(answer) <= max_answer and answer not in GUESSABLE \
                            and not isinstance(returns[0].value, ast.Constant):
                        yield f"{prefix}{child.name}", answer
    yield from visit(tree, "")


def conversations(max_chars: int, per_module: int, max_answer: int, seed: int) -> Iterator[dict]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rng = random.Random(seed)
    for path in stdlib_sources():
        source = path.read_text(encoding="utf-8")
        if len(source) > max_chars or not source.strip():
            continue
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):  # lib2to3's test data holds Python 2 on purpose
            continue
        found = list(returned_expressions(tree, source, max_answer))
        module = ".".join(path.relative_to(stdlib).with_suffix("").parts).removesuffix(".__init__")
        for function, answer in rng.sample(found, min(per_module, len(found))):
            question = QUESTION.format(module=module, function=function)
            yield {"messages": [{"role": "user", "content": f"{source.rstrip()}\n\n{question}"},
                                {"role": "assistant", "content": answer}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON Lines file to write")
    parser.add_argument("--max-chars", type=int, default=6000, help="longest module taken, in characters")
    parser.add_argument("--per-module", type=int, default=2, help="questions per module at most")
    parser.add_argument("--max-answer", type=int, default=60, help="longest returned expression, in characters")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = list(conversations(args.max_chars, args.per_module, args.max_answer, args.seed))
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows):,} conversations to {args.out}")


if __name__ == "__main__":
    main()
