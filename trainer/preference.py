"""Training on preference pairs: the checks, the reference pass and the objective's backward of one step.

    check_preferences(config, sources)          # preflight: the store and --objective must fit each other
    reference = Reference.load_or_compute(...)  # dpo, ipo: the starting weights' logps of every training pair
    loss, pairs, metrics = preference_backward(model, micro_batches, config, env)

Each answer's log-probability is summed over its tokens on every cp rank and all-reduced over the cp group
before any nonlinearity (the counts too, for the length-normalised objectives), so every cp rank holds the whole
sums; the reduction passes the gradient back to each rank's own tokens. The step's loss is the mean over the
pairs of the global batch (every dp rank, every micro-batch): each rank backpropagates its pairs' summed loss
divided by that global count, and FSDP sums the shares (trainer/parallelize.py), as for token losses.

The reference model's log-probabilities (DPO, IPO) are computed once, before the first step, with the starting
weights (--model DIR, --init-from RUN, or the seed's; under LoRA the frozen base with its adapters off, so an
--init-adapter run's reference is still the base model): one pass over the training pairs, packed as training packs
them (epoch 0 holds every pair once), saved in the run directory as reference_logps.npz with the SHA-256 of the
weights it was computed from; the run's "reference" event records the same digest and the pass's time. A resumed
run reads the file back and refuses one that is damaged or from other starting weights (its own weights have
trained since, so neither can be computed again); training holds one model.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from data import Batch, SequenceLoader, TokenStore
from data.mixture import Source
from models import Transformer
from models.lora import adapters_off
from models.preference import NEEDS_REFERENCE, OBJECTIVES, pair_losses, summed
from runtime.process import all_reduce
from trainer.checkpoint import metrics_rows
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.parallelize import end_forward_only, mark_documents_dynamic

REFERENCE_FILE = "reference_logps.npz"
# The step's metrics, TRL's names: means over the pairs of the global batch.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def check_preferences(config: TrainConfig, sources: list[Source]) -> None:
    """Refuse a preference store without a preference objective, an objective without one, a mixture, and
    packed pairs with --no-doc-mask."""
    names = [source.spec.name for source in sources if source.store.is_preferences]
    if config.objective == "nll":
        if names:
            raise ValueError(f"--data {', '.join(names)} is a preference store (`burst prepare --preference`): its "
                             f"pairs train with --objective {' | '.join(OBJECTIVES)}, not the next-token loss")
        return
    if len(sources) != 1 or not names:
        kind = "conversations" if sources[0].store.is_conversations else "documents"
        what = "several --data sources" if len(sources) != 1 else f"--data {sources[0].spec.name}, a store of {kind}"
        raise ValueError(f"--objective {config.objective} trains on one preference store (`burst prepare --preference "
                         f"--tokenizer MODEL --out STORE`), but got {what}; pass one preference store, or drop "
                         f"--objective for the next-token loss")
    if not config.doc_mask:  # on by default for a preference store (trainer/resolve.py `document_mask`)
        raise ValueError(f"--no-doc-mask is refused for --data {names[0]}: pairs are packed several to a sequence, "
                         f"each answer's documents must not attend to other pairs' (nor, with prefix sharing, to the "
                         f"other answer); drop --no-doc-mask (the mask is on by default for preference stores)")
    if config.train_on_prompt:
        raise ValueError("--train-on-prompt scores conversations' prompts; a preference objective scores answers "
                         "only: drop --train-on-prompt")


def cp_group(env: Distributed) -> torch.distributed.ProcessGroup | None:
    return env.mesh["cp"].get_group() if env.mesh is not None else None


def batch_logps(model: Transformer, batch: Batch, config: TrainConfig, env: Distributed
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's whole log-probability (differentiable through this rank's tokens) and token count, float32
    [2 x pairs] each: chosen, rejected of pair 0, then of pair 1, ..."""
    tokens, labels, positions, answers = (t.to(env.device, non_blocking=True) for t in (
        batch.tokens, batch.labels, batch.positions, batch.answers))
    mark_documents_dynamic(config, batch.documents)
    with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16"):
        logps, counts = model.answer_logps(tokens, labels, answers, 2 * batch.num_pairs, positions,
                                           batch.documents, chunk_size=config.loss_tile,
                                           rope_length=batch.rope_length)
    group = cp_group(env)
    return summed(logps, lambda t: all_reduce(t, group)), all_reduce(counts, group)


def preference_backward(model: Transformer, micro_batches: list[Batch], config: TrainConfig, env: Distributed
                        ) -> tuple[torch.Tensor, int, dict[str, float]]:
    """Backward of each micro-batch's share of the step's mean pair loss; returns that loss, the global batch's
    answer tokens and the step's metrics (METRICS, and its "pairs")."""
    chosen_tokens = sum(int(((b.answers >= 0) & (b.answers % 2 == 0)).sum()) for b in micro_batches)  # this shard's
    counts = all_reduce(torch.tensor([float(sum(b.num_pairs for b in micro_batches)),
                                      float(sum(b.num_tokens for b in micro_batches)), float(chosen_tokens)],
                                     device=env.device))
    pairs = int(counts[0].item()) // config.cp  # every cp rank of a dp rank holds the same pairs
    chosen_tokens_per_pair = counts[2].item() / max(pairs, 1)  # orpo's NLL: TRL's mean over the batch's tokens
    totals = torch.zeros(1 + len(METRICS), dtype=torch.float64, device=env.device)
    for batch in micro_batches:
        logps, answer_tokens = batch_logps(model, batch, config, env)
        result = pair_losses(config.objective, logps, answer_tokens, batch.reference_logps, beta=config.beta,
                             simpo_gamma=config.simpo_gamma, orpo_lambda=config.orpo_lambda,
                             chosen_tokens_per_pair=chosen_tokens_per_pair)
        (result.losses.sum() / max(pairs, 1)).backward()
        totals += pair_metrics(result.losses.detach(), result.rewards_chosen, result.rewards_rejected,
                               logps.detach()).to(totals)
    totals = all_reduce(totals) / config.cp / max(pairs, 1)
    return totals[0], int(counts[1].item()), {**dict(zip(METRICS, totals[1:].tolist(), strict=True)), "pairs": pairs}


def pair_metrics(losses: torch.Tensor, rewards_chosen: torch.Tensor, rewards_rejected: torch.Tensor,
                 logps: torch.Tensor) -> torch.Tensor:
    """float64 [1 + len(METRICS)]: the sums over the pairs of the loss and of each metric."""
    chosen, rejected = logps.view(-1, 2).double().unbind(1)
    rewards_chosen, rewards_rejected = rewards_chosen.double(), rewards_rejected.double()
    return torch.stack([losses.double().sum(), rewards_chosen.sum(), rewards_rejected.sum(),
                        (rewards_chosen > rewards_rejected).double().sum(),
                        (rewards_chosen - rewards_rejected).sum(), chosen.sum(), rejected.sum()])


# -- the reference pass ---------------------------------------------------------------------------------------

@dataclass
class Reference:
    """The reference model's log-probabilities of each training pair's chosen and rejected answer."""

    logps: np.ndarray  # float64 [pairs, 2]

    def attach(self, batch: Batch) -> Batch:
        batch.reference_logps = torch.from_numpy(self.logps[batch.pair_documents.numpy()])
        return batch


def needs_reference(config: TrainConfig) -> bool:
    return config.objective in NEEDS_REFERENCE


def identity(store: TokenStore, config: TrainConfig) -> dict:
    """What a saved reference belongs to: its pairs, and how they were packed."""
    return {"store": str(store.directory), "split": store.split_name, "pairs": store.num_documents,
            "fingerprint": store.tokenizer_fingerprint, "seq_len": config.seq_len,
            "prefix_sharing": config.prefix_sharing, "long_conversations": config.long_conversations}


def check_reference_kept(config: TrainConfig, run: Path) -> None:
    """Refuse to resume a dpo or ipo run whose saved reference is gone: its weights have trained since."""
    if needs_reference(config) and not (run / REFERENCE_FILE).is_file():
        raise ValueError(missing_reference(run / REFERENCE_FILE))


def missing_reference(path: Path) -> str:
    return (f"{path} is missing: the reference log-probabilities of the starting weights are gone and the weights "
            f"have trained since; start a new run (--init-from {path.parent} to keep its weights)")


@torch.no_grad()
def compute_reference(model: Transformer, store: TokenStore, config: TrainConfig, env: Distributed,
                      progress: Callable[[int, int], None] = lambda done, total: None) -> np.ndarray:
    """float64 [pairs, 2]: `model`'s logps of every pair of `store` (a split view), packed as training packs them;
    the dp ranks share the sequences of one epoch, the cp ranks split each. `progress(done, total)` hears of each
    step of this rank's."""
    loader = SequenceLoader(store, config.seq_len, 1, dp_rank=env.dp_rank, dp_size=config.dp, cp_rank=env.cp_rank,
                            cp_size=config.cp, seed=config.seed, reset_positions=True,
                            cp_layout=config.sequence_layout, long_conversations=config.long_conversations,
                            prefix_sharing=config.prefix_sharing, layout_windows=model.config.windows)
    sequences = loader.streams[0].sequences_in_epoch(0)  # every pair once
    sums = torch.zeros(store.num_documents, 2, dtype=torch.float64, device=env.device)
    seen = torch.zeros(store.num_documents, 1, dtype=torch.float64, device=env.device)
    was_training = model.training
    model.eval()
    steps = math.ceil(sequences / config.dp)
    progress(0, steps)
    for step in range(steps):  # every rank takes as many steps (the last may repeat pairs)
        batch = next(loader)
        with adapters_off(model):  # LoRA: the reference model is the frozen base, in the same model
            logps, _ = batch_logps(model, batch, config, env)
        documents = batch.pair_documents.to(env.device)
        sums.index_add_(0, documents, logps.detach().double().view(-1, 2))
        seen.index_add_(0, documents, torch.ones(len(documents), 1, dtype=torch.float64, device=env.device))
        progress(step + 1, steps)
    model.train(was_training)
    end_forward_only(model)
    sums, seen = all_reduce(sums), all_reduce(seen)  # each pair once per cp rank (and twice where repeated)
    return (sums / seen).cpu().numpy()


def starting_weights_digest(model: Transformer) -> str:
    """The SHA-256 of `model`'s whole weights (each tensor's dtype, shape and bytes, in order; names vary with the
    recomputation's wrappers), the same on every rank and layout: each sharded one is gathered in turn, so every
    rank calls this."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        tensor = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().contiguous()
        digest.update(f"{tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def recorded_weights(run: Path) -> str | None:
    """The digest of the weights `run` computed its reference from, as its "reference" event recorded it."""
    digests = [row["weights"] for row in map(json.loads, metrics_rows(run)) if row.get("event") == "reference"]
    return digests[0] if digests else None


def _read_reference(path: Path) -> tuple[dict, np.ndarray] | None:
    """The identity and logps a saved reference holds; None when the file is damaged (cut short, not an npz)."""
    try:
        with np.load(path) as saved:
            return json.loads(str(saved["identity"])), saved["logps"]
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError):
        return None


def load_or_compute_reference(run: Path, model: Transformer, store: TokenStore, config: TrainConfig,
                              env: Distributed, resumed: bool, metrics=None) -> Reference:
    """The run's saved reference, or (a run that has not trained yet) computed now and saved by rank 0, with its
    progress and its "reference" event (its time, the starting weights' digest) in `metrics` (rank 0's)."""
    path = run / REFERENCE_FILE
    if resumed:
        return Reference(_resumed_reference(path, identity(store, config), recorded_weights(run)))
    started = time.perf_counter()
    wanted = {**identity(store, config), "weights": starting_weights_digest(model)}
    saved = _read_reference(path) if path.is_file() else None
    if saved is not None and saved[0] == wanted:
        return Reference(saved[1])
    if metrics is not None:
        metrics.message(f"reference log-probabilities: one pass over {store.num_documents:,} training pairs with the "
                        f"starting weights")
    logps = compute_reference(model, store, config, env,
                              lambda done, total: metrics.progress("reference", done, total) if metrics else None)
    if env.is_main:
        temporary = path.with_name(path.name + ".tmp.npz")
        np.savez(temporary, logps=logps, identity=json.dumps(wanted))
        temporary.replace(path)  # whole or not at all
    if metrics is not None:
        seconds = time.perf_counter() - started
        metrics.event("reference", {"pairs": store.num_documents, "seconds": seconds, "weights": wanted["weights"]},
                      f"reference ready: {store.num_documents:,} pairs, {seconds:.1f} s")
    return Reference(logps)


def _resumed_reference(path: Path, wanted: dict, weights: str | None) -> np.ndarray:
    """A resumed run's reference logps, refused (one line) when gone, damaged, of other pairs or packing, or from
    other weights than the run started from (`weights`, None when the run recorded none)."""
    if not path.is_file():
        raise ValueError(missing_reference(path))
    cannot_recompute = (f"the weights have trained since, so it cannot be computed again: put back this run's own "
                        f"{path.name}, or start a new run (--init-from {path.parent} to keep its weights)")
    saved = _read_reference(path)
    if saved is None:
        raise ValueError(f"{path} is damaged (cut short, or not a reference file); {cannot_recompute}")
    found, logps = saved
    if weights is not None and found.get("weights") != weights:
        raise ValueError(f"{path} was computed from other starting weights ({str(found.get('weights'))[:12]}...) "
                         f"than this run's ({weights[:12]}...), e.g. another --seed; {cannot_recompute}")
    if {key: found.get(key) for key in wanted} != wanted:
        raise ValueError(f"{path} holds the reference log-probabilities of other pairs or another packing than this "
                         f"run's ({found} against {wanted}); {cannot_recompute}")
    return logps
