"""The validation loss a run reports: the mean token loss of held-out tokens, the same ones every time.

Single training losses are noisy (one batch each); the validation loss at the start and the end of an
invocation, and every --val-every steps, tells whether the run learns. Its sequences are packed from the
sources' validation splits as training packs the training splits (the same mixture shares, --doc-mask and
positions), with a fixed seed, so every pass scores the same tokens; the dp ranks share them out and the cp
ranks split each one, and the loss is the mean over every scored token.

A pass is sized in tokens, --val-tokens (its default: trainer/sections.py), rounded up to whole sequences, as
many for every dp rank, and no more sequences than the splits fill: a token is scored at most once per pass
(what a sequence holds past its source's split is input only), however long the sequences. The plan said before
the first pass counts the tokens a pass scores by packing its sequences (no model), from the same batches the
pass scores, so the plan and each result name the same figure.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from data import Batch, SequenceLoader
from data.mixture import Source
from runtime.process import all_reduce
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.parallelize import end_forward_only


def steps(share: float) -> str:
    """`share` of a training step in words: 0.33 -> "33% of a step's", 2.5 -> "2.5 steps'"."""
    return f"{share:.0%} of a step's" if share < 1.5 else f"{share:.1f} steps'"


@dataclass(frozen=True)
class ValidationResult:
    """One validation pass."""

    loss: float | None  # the mean loss over the scored tokens; None when the sequences held none
    tokens: int  # distinct held-out tokens scored, over all ranks
    seconds: float


class Validator:
    """Scores about `config.val_tokens` held-out tokens of `sources` (those with validation documents)."""

    def __init__(self, sources: list[Source], config: TrainConfig, env: Distributed,
                 layout_windows: tuple[int | None, ...] | None = None) -> None:
        """layout_windows: the model's layers' windows (`ModelConfig.windows`), as the training loader has them."""
        self.config, self.env, self.layout_windows = config, env, layout_windows
        held_out = [source for source in sources if source.val.num_documents > 0]
        self.skipped = [source.spec.name for source in sources if source.val.num_documents == 0]
        self.split_tokens = sum(source.val.num_tokens for source in held_out)
        total = sum(source.spec.share for source in held_out)
        self.stores = [source.val for source in held_out]
        self.shares = [source.spec.share / total for source in held_out]
        available = self._loader().first_epoch_sequences if self.stores else 0  # that hold every split whole
        wanted = math.ceil(config.val_tokens / config.seq_len)
        self.whole_split = 0 < available <= wanted
        self.per_rank = math.ceil(min(wanted, available) / config.dp)
        self.sequences = self.per_rank * config.dp  # every dp rank scores as many
        # What a pass scores, over all ranks: a small source's split may fill fewer sequences than its share.
        scored = torch.tensor(float(sum(batch.num_tokens for batch in self._batches())), dtype=torch.float64,
                              device=env.device)
        self.scored_tokens = int(all_reduce(scored).item()) if self.sequences else 0  # the same on every rank

    def _loader(self) -> SequenceLoader:
        """The held-out sequences from the first, each token scored once."""
        config, env = self.config, self.env
        return SequenceLoader(self.stores, config.seq_len, 1, shares=self.shares, dp_rank=env.dp_rank,
                              dp_size=config.dp, cp_rank=env.cp_rank, cp_size=config.cp, seed=config.seed,
                              reset_positions=config.doc_mask, cp_layout=config.sequence_layout,
                              long_conversations=config.long_conversations, once=True,
                              layout_windows=self.layout_windows,
                              train_on_prompt=config.train_on_prompt and any(s.is_conversations for s in self.stores))

    def _batches(self) -> Iterator[Batch]:
        """This rank's batches of one pass: what the plan counts and what each pass scores."""
        if not self.per_rank:
            return  # no split to load (a preference run, --val-tokens 0)
        loader = self._loader()
        for _ in range(self.per_rank):
            yield next(loader)

    def plan(self) -> str:
        """What a pass costs, said before the first: its tokens and sequences, and their share of a step's."""
        config = self.config
        if not self.sequences:
            why = "--val-tokens 0" if self.stores else \
                "a preference run's held-out pairs are scored by burst eval: reward accuracy and margins" \
                if config.objective != "nll" else \
                "no --data source has a validation split (prepare with --val-fraction above 0)"
            return f"validation: none ({why})"
        held = f"{self.scored_tokens:,} held-out tokens scored " + (
            f"(all the validation split fills; it holds {self.split_tokens:,})" if self.whole_split else
            f"(--val-tokens {config.val_tokens:,}; the validation split holds {self.split_tokens:,})")
        share = self.sequences * config.seq_len / config.tokens_per_step
        return (f"validation: {held} per pass, {self.sequences} sequence{'s' if self.sequences > 1 else ''} of "
                f"{config.seq_len:,} tokens forward only: {steps(share)} tokens, about {steps(share / 3)} time"
                + self.left_out())

    def plan_values(self) -> dict[str, Any]:
        """plan() as figures, for metrics.jsonl."""
        return {"sequences": self.sequences, "seq_len": self.config.seq_len, "val_tokens": self.config.val_tokens,
                "forward_tokens": self.sequences * self.config.seq_len, "step_tokens": self.config.tokens_per_step,
                "split_tokens": self.split_tokens, "scored_tokens": self.scored_tokens, "whole_split": self.whole_split,
                "left_out": self.skipped}

    def left_out(self) -> str:
        """The sources that validation leaves out, having no validation split, as a clause of a line."""
        return f"; left out, having no validation split: {', '.join(self.skipped)}" if self.skipped else ""

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, progress: Callable[[int, int], None] | None = None) \
            -> ValidationResult | None:
        """The mean token loss over the held-out tokens (None when there are no sequences to score);
        `progress(done, total)` hears of each block of each sequence this rank scored (of each sequence under
        --compile, whose graphs take no hooks)."""
        if not self.sequences:
            return None
        config, env = self.config, self.env
        started = time.perf_counter()
        totals = torch.zeros(2, dtype=torch.float64, device=env.device)  # summed loss, scored tokens
        was_training = model.training
        model.eval()
        # A pass at 131,072 tokens is one sequence for minutes: its blocks tell how far it is.
        blocks = list(model.layers) if progress is not None and not config.compile else []
        parts = max(len(blocks), 1)
        total = self.per_rank * parts
        finished = itertools.count(1)

        def block_done(*_) -> None:
            n = next(finished)
            if n < total:  # the end is said once, after the pass
                progress(n, total)

        hooks = [block.register_forward_hook(block_done) for block in blocks]
        for done, batch in enumerate(self._batches()):
            if progress is not None and (done == 0 or not blocks):
                progress(done * parts, total)
            tokens, labels, positions = (t.to(env.device) for t in (batch.tokens, batch.labels, batch.positions))
            with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16"):
                loss_sum, count = model.loss(tokens, labels, positions,
                                             batch.documents if config.doc_mask else None,
                                             rope_length=batch.rope_length)
            totals += torch.stack([loss_sum.double(), count.double()])
        for hook in hooks:
            hook.remove()
        model.train(was_training)
        end_forward_only(model)  # else FSDP2's leftover state corrupts the gradients of the steps after
        loss_sum, count = all_reduce(totals).tolist()
        if progress is not None:
            progress(total, total)
        return ValidationResult(loss_sum / count if count else None, int(count), time.perf_counter() - started)
