"""The run shape: the dozen settings a run's memory and step time depend on, and nothing else.

`burst train`'s 49 settings, `burst eval`'s and the GPU benchmark's all reduce to this; the planner (memory,
time, the fit check, the search) reads only it, so it never needs a trainer's or an evaluation's config.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("none", "selective", "full")  # --activation-checkpointing, from the least recomputation


@dataclass(frozen=True)
class RunShape:
    """One run as the planner sees it: the sequence and how it is split, the precision, the recomputation and the
    documents attention is counted for."""

    seq_len: int
    batch_size: int = 1  # sequences per data-parallel rank per micro-batch
    grad_accum: int = 1
    cp: int = 1
    dp: int = 1
    precision: str = "fp32"  # bf16 or fp32, resolved ("auto" counts as fp32)
    activation_checkpointing: str = "none"  # none, selective or full
    doc_len: int | tuple[int, ...] | None = None  # packed documents' length, or a repeated pattern; None: one a row
    prefix_sharing: bool = False  # documents come as (prompt, chosen, rejected), both answers seeing their prompt
    layout: str = "zigzag"  # how a sequence of several documents is cut into the cp shards (burst/layout.py)
    cp_topology: str = "auto"
    attention_backward: str = "auto"
    forward_only: bool = False  # evaluation: no gradients or optimizer, the model whole on every rank
    models: int = 1  # models held at once (evaluation with a --reference model: 2)
    new_tokens: int = 0  # generation (forward only): tokens generated after the seq_len prompt, their keys kept
    lora_rank: int = 0  # LoRA's rank (0: full fine-tuning): the frozen weights get no gradients or optimizer state
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o")
    train_embeddings_and_norms: bool = False  # with LoRA: the token embeddings and the norms train too
    offload_activations: bool = False  # the recomputed blocks' inputs wait in host memory
    mlp_tile: int = 0  # tokens the MLP computes at once (0: the whole sequence)
    loss_tile: int = 1024  # rows of logits the loss forms at once

    def __post_init__(self) -> None:
        if isinstance(self.doc_len, list):
            object.__setattr__(self, "doc_len", tuple(self.doc_len))
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))

    @property
    def world_size(self) -> int:
        return self.cp * self.dp

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all ranks."""
        return self.batch_size * self.seq_len * self.grad_accum * self.dp

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one rank holds in one micro-batch."""
        return self.batch_size * self.seq_len // self.cp

    def describe(self) -> str:
        """The flags that set this shape's layout and recomputation."""
        if self.forward_only:
            return f"--cp {self.cp}"
        return (f"--cp {self.cp} --dp {self.dp} --activation-checkpointing {self.activation_checkpointing}"
                + (" --offload-activations" if self.offload_activations else "")
                + (f" --mlp-tile {self.mlp_tile}" if self.mlp_tile else ""))
