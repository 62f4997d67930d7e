"""The validation loss a run reports: the mean token loss of held-out sequences, the same ones every time.

Single training losses are noisy (one batch each); the validation loss at the start and the end of an
invocation, and every --val-every steps, tells whether the run learns. Its sequences are packed from the
sources' validation splits as training packs the training splits (the same mixture shares, --doc-mask and
positions), with a fixed seed, so every pass scores the same tokens; the dp ranks share them out and the cp
ranks split each one, and the loss is the mean over every scored token.
"""

from __future__ import annotations

import math

import torch

from data import SequenceLoader
from data.mixture import Source
from runtime.process import all_reduce
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.parallelize import end_forward_only


class Validator:
    """Scores `config.val_sequences` held-out sequences of `sources` (those with validation documents)."""

    def __init__(self, sources: list[Source], config: TrainConfig, env: Distributed) -> None:
        self.config, self.env = config, env
        held_out = [source for source in sources if source.val.num_documents > 0]
        total = sum(source.spec.share for source in held_out)
        self.stores = [source.val for source in held_out]
        self.shares = [source.spec.share / total for source in held_out]
        self.per_rank = math.ceil(config.val_sequences / config.dp) if self.stores else 0
        self.sequences = self.per_rank * config.dp  # every dp rank scores as many: at least --val-sequences
        self.skipped = [source.spec.name for source in sources if source.val.num_documents == 0]

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> float | None:
        """The mean token loss over the held-out sequences (None when there are none)."""
        if not self.sequences:
            return None
        config, env = self.config, self.env
        loader = SequenceLoader(self.stores, config.seq_len, 1, shares=self.shares, dp_rank=env.dp_rank,
                                dp_size=config.dp, cp_rank=env.cp_rank, cp_size=config.cp, seed=config.seed,
                                reset_positions=config.doc_mask, cp_layout=config.sequence_layout,
                                long_conversations=config.long_conversations,
                                train_on_prompt=config.train_on_prompt and any(s.is_conversations for s in self.stores))
        totals = torch.zeros(2, dtype=torch.float64, device=env.device)  # summed loss, scored tokens
        was_training = model.training
        model.eval()
        for _ in range(self.per_rank):
            batch = next(loader)
            tokens, labels, positions = (t.to(env.device) for t in (batch.tokens, batch.labels, batch.positions))
            with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16"):
                loss_sum, count = model.loss(tokens, labels, positions,
                                             batch.doc_boundaries if config.doc_mask else None,
                                             rope_length=batch.rope_length)
            totals += torch.stack([loss_sum.double(), count.double()])
        model.train(was_training)
        end_forward_only(model)  # else FSDP2's leftover state corrupts the gradients of the steps after
        loss_sum, count = all_reduce(totals).tolist()
        return loss_sum / count if count else None
