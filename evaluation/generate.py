"""Generation from a batch of prompts, the prompt read across a context-parallel group (burst/decode.py).

    use_decode_attention(model, group)            # cp > 1: the ring for the prompt, merged partials per token
    outputs, speed = generate(model, prompts, tokenizer, Stops(...), 64, Sampling(), group)

The prompts of a batch are padded on the left to a common length that the layout can cut (a multiple of
2 x cp): the padding is a document of its own (`doc_boundaries`), so no prompt token sees it, and its keys
are kept but never visible to a later token. Each prompt's positions start at 0, as if it were alone. The
last prompt token's hidden state comes from the rank that holds it (one all-reduce); from then on every
rank computes the same logits and draws the same token. A row that ends leaves the batch (its cache rows
dropped), so a batch decodes only the rows still going. Every batch has its own cache, freed after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from burst.decode import DecodeAttention, KVCache, cache_capacity, cache_dtype, token_owner
from burst.groups import group_rank_and_size
from burst.layout import check_layout, sequence_positions, shard_sequence
from data import Tokenizer
from evaluation.sampling import Sampling, next_tokens
from models import Transformer
from runtime.process import all_reduce


def use_decode_attention(model: Transformer, group: dist.ProcessGroup | None, layout: str = "zigzag",
                         kernel: str = "auto") -> None:
    """Make every block's attention read the prompt across `group` with the local kernel `kernel` and decode against
    every rank's slice of the cache (in place); a single process keeps its LocalAttention (its own cache path)."""
    check_layout(layout, "--layout")
    for block in model.layers:
        if group_rank_and_size(group)[1] == 1:
            block.attention.core_attention.kernel = kernel
        else:
            block.attention.core_attention = DecodeAttention(group, kernel=kernel, layout=layout,
                                                             layout_windows=model.config.windows)


@dataclass(frozen=True)
class Stops:
    """What ends a generation: one of `token_ids` (kept as the last token), or a string in the text (the text is
    cut before it; its tokens are kept)."""

    token_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()


@dataclass
class Generated:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "stop": an end token or stop string; "length": max_new_tokens reached


@dataclass
class Speed:
    """Tokens and seconds of the prompts' reading (prefill) and of the generation (decode), summed over batches."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    kv_cache_bytes: int = 0  # this rank's cache, the largest batch's

    def line(self) -> str:
        def rate(tokens: int, seconds: float) -> str:
            return f"{tokens / seconds:,.1f} tok/s" if seconds > 0 else "-"
        return (f"prefill {self.prefill_tokens:,} tokens {rate(self.prefill_tokens, self.prefill_seconds)}, "
                f"decode {self.decode_tokens:,} tokens {rate(self.decode_tokens, self.decode_seconds)}, "
                f"KV cache {self.kv_cache_bytes / 2**20:,.1f} MiB per rank")


def padded_length(longest: int, world_size: int) -> int:
    """The batch's length: the longest prompt, rounded up to what the layout cuts (2 x cp chunks; any at cp 1)."""
    step = 1 if world_size == 1 else 2 * world_size
    return -(-longest // step) * step


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], tokenizer: Tokenizer, stops: Stops, max_new_tokens: int,
             sampling: Sampling, group: dist.ProcessGroup | None = None, layout: str = "zigzag",
             speed: Speed | None = None) -> list[Generated]:
    """Generate up to `max_new_tokens` after each prompt of one batch (token ids, each at least one)."""
    device = model.output_weight.device
    rank, world_size = group_rank_and_size(group)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    longest = int(lengths.max())
    seq_len = padded_length(longest, world_size)
    pad = seq_len - lengths  # [batch]
    tokens = torch.zeros(len(prompts), seq_len, dtype=torch.int64, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, seq_len - len(prompt):] = torch.tensor(prompt, device=device)
    # The padding is a document of its own (none where a row has none): no prompt token attends to it.
    boundaries = [torch.tensor([0, p, seq_len] if p else [0, seq_len]) for p in pad.tolist()]
    if layout == "zigzag" and not int(pad.max()):
        boundaries = None
    if world_size == 1:  # one process reads the whole batch, of any length
        index, local_tokens = torch.arange(seq_len, device=device), tokens
    else:
        windows = model.config.windows  # the balanced layout weighs each layer's window, as the attention does
        index = sequence_positions(seq_len, group, device, layout=layout, doc_boundaries=boundaries,
                                   layout_windows=windows)
        local_tokens = shard_sequence(tokens, 1, group, layout=layout, doc_boundaries=boundaries,
                                      layout_windows=windows)
    index = index.expand(len(prompts), -1)  # [batch, local]: the global index of each token this rank holds
    config = model.config
    cache = KVCache(config.n_layers, len(prompts), cache_capacity(seq_len, max_new_tokens, world_size),
                    config.n_kv_heads, config.head_dim, cache_dtype(model.output_weight.dtype, device), device)
    outputs = [Generated(prompt_token_ids=list(p)) for p in prompts]
    speed = speed if speed is not None else Speed()
    speed.kv_cache_bytes = max(speed.kv_cache_bytes, cache.nbytes)

    started = time.perf_counter()
    positions = (index - pad[:, None]).clamp(min=0)  # [batch, local]: each prompt's own, from 0
    cache.reserve(index >= pad[:, None], positions)
    hidden = model.hidden_states(local_tokens, positions, boundaries, rope_length=longest, cache=cache)
    last = all_reduce((hidden * (index == seq_len - 1)[..., None]).sum(1), group)  # [batch, dim], from its holder
    logits = F.linear(last, model.output_weight).float()
    speed.prefill_tokens += int(lengths.sum())
    speed.prefill_seconds += time.perf_counter() - started

    started, generator = time.perf_counter(), sampling.generator(device)
    going = outputs  # the rows still generating, in the cache's order
    for step in range(max_new_tokens):
        chosen = next_tokens(logits, sampling, generator)
        goes_on = record(going, chosen.tolist(), tokenizer, stops)
        if not any(goes_on) or step == max_new_tokens - 1:
            break
        if not all(goes_on):  # a finished row leaves the batch (every rank drops the same rows)
            rows = torch.tensor([row for row, on in enumerate(goes_on) if on], device=device)
            cache.keep(rows)
            going, chosen, lengths = [going[row] for row in rows.tolist()], chosen[rows], lengths[rows]
        kept = token_owner(step, world_size) == rank
        cache.reserve(torch.ones(len(going), int(kept), dtype=torch.bool, device=device), (lengths + step)[:, None])
        hidden = model.hidden_states(chosen[:, None], (lengths + step)[:, None], rope_length=longest + step + 1,
                                     cache=cache)
        logits = F.linear(hidden[:, -1], model.output_weight).float()
    speed.decode_tokens += sum(len(out.token_ids) for out in outputs)
    speed.decode_seconds += time.perf_counter() - started
    for out in outputs:
        if out.finish_reason == "length":
            out.text = tokenizer.decode(out.token_ids)
    return outputs


def record(outputs: list[Generated], chosen: list[int], tokenizer: Tokenizer, stops: Stops) -> list[bool]:
    """Add each row's new token and end the rows it ends; whether each row goes on."""
    for out, token in zip(outputs, chosen, strict=True):
        out.token_ids.append(token)
        if token in stops.token_ids:
            out.finish_reason, out.text = "stop", tokenizer.decode(out.token_ids[:-1])
        elif stops.strings:
            text = tokenizer.decode(out.token_ids)
            found = [text.find(s) for s in stops.strings if s in text]
            if found:
                out.finish_reason, out.text = "stop", text[:min(found)]
    return [out.finish_reason != "stop" for out in outputs]
