"""`burst generate`: text from a model, the prompt read across --cp ranks (evaluation/generate.py).

    results, speed = run_generate(GenerateConfig(model=Path("out/run"), prompts=[Prompt(text="Hello")], cp=2))

Prompts come from --prompt or --prompt-file (`read_prompts`), are tokenized as transformers would (the
tokenizer's BOS first where it adds one; messages through the model's chat template), and are generated
--batch-size at a time. Rank 0 prints each text on stdout, a progress line on stderr, and with --output
writes one JSON object per prompt. Every input is checked before the weights are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from burst.kernels import check_kernel_name
from burst.layout import check_layout
from data import Tokenizer, load_tokenizer
from data.chat import ChatFormat, ConversationRefused
from evaluation.checkpoint import EvalCheckpoint, load_for_eval
from evaluation.distributed import context_parallel_group
from evaluation.generate import Generated, Speed, Stops, generate, use_decode_attention
from evaluation.sampling import Sampling
from runtime.device import resolve_device
from runtime.directories import check_writable, write_atomically
from runtime.failure import writing
from runtime.launch import first_failure, run_local, under_torchrun
from runtime.memory import heap_for_large_tensors, peak_memory_mib
from runtime.precision import resolve_precision

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Prompt:
    """A plain text, or a conversation (OpenAI-style messages) to answer through the chat template."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None


def read_prompts(path: Path) -> list[Prompt]:
    """--prompt-file: a .jsonl file of {"prompt": ...} or {"messages": [...]} per line; any other file is one prompt."""
    if not path.is_file():
        raise ValueError(f"--prompt-file {path} is not a file; pass a text file (one prompt) or a .jsonl file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompt-file {path} is not UTF-8 text ({err})") from None
    if path.suffix.lower() != ".jsonl":
        return [Prompt(text=text)]
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--prompt-file {path} line {number} is not JSON ({err})") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(Prompt(text=row["prompt"]))
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"] and \
                all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in row["messages"]):
            prompts.append(Prompt(messages=row["messages"]))
        else:
            raise ValueError(f"--prompt-file {path} line {number} holds neither {{\"prompt\": TEXT}} nor "
                             f"{{\"messages\": [{{\"role\": ..., \"content\": TEXT}}, ...]}}")
    if not prompts:
        raise ValueError(f"--prompt-file {path} holds no prompt")
    return prompts


@dataclass
class GenerateConfig:
    """What to generate from and how; flags of `burst generate` by the same names."""

    model: Path
    prompts: list[Prompt] = field(default_factory=list)
    output: Path | None = None  # .jsonl: one object per prompt
    force: bool = False  # replace an existing --output
    max_new_tokens: int = 256
    chat: bool = False  # plain prompts through the chat template, as one user message
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)  # stop strings
    batch_size: int = 1
    cp: int = 1
    layout: str = "zigzag"
    precision: str = "fp32"
    device: str | None = None
    attention_kernel: str = "auto"  # the prompt's local kernel (burst.select_kernel's names)
    precision_reason: str = ""
    device_reason: str = ""

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("give a prompt: --prompt TEXT or --prompt-file FILE")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens} must be at least 1")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size {self.batch_size} must be at least 1")
        if self.cp < 1:
            raise ValueError(f"--cp {self.cp} must be at least 1")
        if any(not s for s in self.stop):
            raise ValueError("--stop takes a non-empty string")
        check_layout(self.layout, "--layout")
        check_kernel_name(self.attention_kernel, "--attention-kernel")
        self.sampling  # noqa: B018 (checks temperature, top-p, top-k)
        if self.precision not in (*PRECISIONS, "auto"):
            raise ValueError(f"--precision {self.precision!r} is not one of auto, {', '.join(PRECISIONS)}")
        if self.output is not None:
            if self.output.suffix.lower() != ".jsonl":
                raise ValueError(f"--output {self.output} must end in .jsonl (one JSON object per prompt)")
            if self.output.exists() and not self.force:
                raise ValueError(f"--output {self.output} already exists; choose another file, or pass --force")
            check_writable(self.output)
        where = resolve_device(self.device, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", self.cp)),
                               ranks_flag="--cp")
        self.device, self.device_reason = where.kind, where.reason
        chosen = resolve_precision(self.precision, torch.device(where.kind))
        self.precision, self.precision_reason = chosen.name, chosen.reason

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k, self.seed)


@dataclass
class GenerateInputs:
    checkpoint: EvalCheckpoint
    tokenizer: Tokenizer
    prompt_ids: list[list[int]]
    stops: Stops


def model_tokenizer(checkpoint: EvalCheckpoint) -> Tokenizer:
    if checkpoint.checkpoint.tokenizer is None:
        raise ValueError(f"{checkpoint.path} keeps no tokenizer (no tokenizer.json or tokenizer.model), so its "
                         f"output cannot be read as text; generate from a model directory or run that has one")
    return load_tokenizer(checkpoint.checkpoint.tokenizer)


def prompt_ids(prompt: Prompt, tokenizer: Tokenizer, chat: ChatFormat | None) -> list[int]:
    """The ids the model reads: a conversation through the chat template with its generation prompt; plain text as
    transformers' tokenizer encodes it (BOS first where the tokenizer adds one)."""
    messages = prompt.messages if prompt.messages is not None else \
        [{"role": "user", "content": prompt.text}] if chat is not None else None
    if messages is None:
        return ([tokenizer.bos_id] if tokenizer.bos_first else []) + tokenizer.encode(prompt.text)
    chat = chat or ChatFormat(tokenizer)
    try:
        return chat.prompt_ids(messages).tolist()
    except ConversationRefused as err:
        raise ValueError(f"a prompt's messages cannot be rendered by the chat template in {chat.where}: {err}") \
            from None


def end_tokens(checkpoint: EvalCheckpoint, tokenizer: Tokenizer) -> frozenset[int]:
    """The tokenizer's EOS and the model's generation_config.json eos_token_id(s), as transformers stops on them."""
    ids = {tokenizer.eos_id}
    config = checkpoint.path / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    return frozenset(ids)


def open_inputs(config: GenerateConfig) -> GenerateInputs:
    """Open the model and tokenize the prompts, refusing what cannot work before any weight is read."""
    checkpoint = load_for_eval(config.model)
    tokenizer = model_tokenizer(checkpoint)
    chat = ChatFormat(tokenizer) if config.chat else None
    if chat is not None and chat.is_plain:
        raise ValueError(f"--chat: {config.model}'s tokenizer has no chat template; drop --chat for a base model")
    ids = [prompt_ids(p, tokenizer, chat) for p in config.prompts]
    for number, prompt in enumerate(ids, 1):
        if not prompt:
            raise ValueError(f"prompt {number} is empty: it holds no token; give it some text")
        if max(prompt) >= checkpoint.config.vocab_size:
            raise ValueError(f"prompt {number} holds token id {max(prompt)}, past the model's vocabulary of "
                             f"{checkpoint.config.vocab_size}: the tokenizer is not the model's")
    return GenerateInputs(checkpoint, tokenizer, ids, Stops(end_tokens(checkpoint, tokenizer), tuple(config.stop)))


def run_generate(config: GenerateConfig, console: Console | None = None) -> tuple[list[Generated], Speed]:
    """Generate for every prompt of `config`: the generations and rank 0's speed and KV cache; with cp > 1 starts
    cp local ranks (unless torchrun did)."""
    if config.cp > 1 and not torch.distributed.is_initialized() and not under_torchrun():
        open_inputs(config)  # bad input refused once, here
        try:
            return run_local(run_generate, nproc=config.cp, args=(config,))[0]
        except ChildFailedError as err:
            rank, error_type, text, traceback = first_failure(err)
            if error_type == "ValueError":
                raise ValueError(f"rank {rank}: {text}") from None
            raise RuntimeError(f"rank {rank}: {error_type}: {text}\n{traceback}") from None
    console = console or Console(soft_wrap=True)
    log = Console(stderr=True)
    with context_parallel_group(config.cp, config.device) as (group, device):
        is_main = group is None or torch.distributed.get_rank(group) == 0
        say = log.print if is_main else lambda *_: None
        inputs = open_inputs(config)
        model = inputs.checkpoint.model(device, PRECISIONS[config.precision])
        use_decode_attention(model, group, config.layout, config.attention_kernel)
        say(f"weights in {config.precision} ({config.precision_reason}), on {config.device} "
            f"({config.device_reason}), cp {config.cp}")
        results, speed = [], Speed()
        with heap_for_large_tensors():
            for start in range(0, len(inputs.prompt_ids), config.batch_size):
                batch = inputs.prompt_ids[start:start + config.batch_size]
                results += generate(model, batch, inputs.tokenizer, inputs.stops, config.max_new_tokens,
                                    config.sampling, group, config.layout, speed)
                say(f"prompts {len(results)}/{len(inputs.prompt_ids)}: {speed.line()}, peak memory "
                    f"{peak_memory_mib(device):,.0f} MiB (rank 0)")
    if is_main:
        for out in results:
            console.print(out.text, markup=False, highlight=False)
        if config.output is not None:
            lines = [json.dumps({"text": o.text, "token_ids": o.token_ids, "prompt_token_ids": o.prompt_token_ids,
                                 "finish_reason": o.finish_reason}, ensure_ascii=False) for o in results]
            with writing(config.output, kept="; the texts are those printed above"):
                write_atomically(config.output, "\n".join(lines) + "\n")
            say(f"wrote {config.output}")
    return results, speed

