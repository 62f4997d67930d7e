"""The training loop: train() -> train_step() -> forward_backward() for each micro-batch.

The loss of a step is the mean over every scored token of the global batch (all dp and cp ranks,
all micro-batches). Each rank divides its summed token loss by the global token count, so its
gradient is its exact share of the true gradient, and FSDP sums the shares (see parallelize.py).
Dividing by the local count instead, as some trainers do, weighs ranks wrongly and reports a loss
cp times too small.

The stateful pieces of a run, the model, the optimizer, the LR schedule, the data loader and the
TrainState, each have state_dict()/load_state_dict(): a checkpoint is those five plus RNG states
(trainer/checkpoint.py). One is saved every --checkpoint-every steps and always when the loop ends:
finished, --stop-after, SIGTERM/Ctrl-C (trainer/signals.py) or repeated non-finite steps, and only
with finite weights: a checkpoint is never a diverged model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.tensor import DTensor

from burst.module import set_rank_checks
from checkpoints.training import complete_checkpoints, remove_interrupted_saves
from data import Batch, SequenceLoader, TokenStore
from data.store import TOKENIZER_FILE
from models import Transformer
from runtime.memory import peak_memory_mib
from runtime.process import all_reduce, leaving_process_group
from trainer.checkpoint import forget_metrics_after, load_checkpoint
from trainer.config import TrainConfig, save_config
from trainer.distributed import (
    Distributed,
    environment_world_size,
    init_distributed,
    is_collective_timeout,
    unresponsive_ranks,
)
from trainer.metrics import Metrics
from trainer.optim import build_optimizer, build_schedule
from trainer.parallelize import build_model
from trainer.preflight import RunPlan, invocation_done, plan_run, restart_count
from trainer.saving import CheckpointSaver, Saved
from trainer.signals import StopRequest, TrainingInterrupted


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. the loss keeps being non-finite); the message says why and what to try."""


@dataclass
class TrainState:
    """The loop's own counters."""

    step: int = 0  # optimizer steps done, applied or skipped
    tokens: int = 0  # tokens trained on, over all ranks
    bad_steps: int = 0  # non-finite steps in a row

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, int(value))


@dataclass
class StepResult:
    loss: float  # global mean token loss
    grad_norm: float  # global gradient norm before clipping
    applied: bool  # False: non-finite loss or gradient norm, the optimizer step was skipped


def forward_backward(model: Transformer, batch: Batch, global_count: torch.Tensor, config: TrainConfig,
                     device: torch.device) -> torch.Tensor:
    """Backward of this micro-batch's share of the global mean loss; returns its summed token loss."""
    tokens, labels, positions = (t.to(device, non_blocking=True) for t in (batch.tokens, batch.labels,
                                                                           batch.positions))  # [b, seq / cp]
    doc_boundaries = batch.doc_boundaries if config.doc_mask else None  # offsets over the full sequence
    if config.compile and doc_boundaries is not None:
        for offsets in doc_boundaries:  # documents per row vary from batch to batch: one graph for any count
            torch._dynamo.maybe_mark_dynamic(offsets, 0)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16"):
        loss_sum, _ = model.loss(tokens, labels, positions, doc_boundaries)
    (loss_sum / global_count).backward()
    return loss_sum.detach()


def checks_ranks(step: int, first_step: int, every: int) -> bool:
    """Whether optimizer step `step` (1-based) compares the cp ranks' attention inputs: the first step of
    this invocation and every `every` steps. Every rank counts the same steps, so all check together."""
    return step == first_step or step % every == 0


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, micro_batches: list[Batch],
               config: TrainConfig, env: Distributed, check_ranks: bool = False) -> StepResult:
    """One optimizer step over `micro_batches` (grad_accum of them), unless the loss or gradient is not finite.

    check_ranks: compare the cp ranks' attention inputs in every attention call of this step (one
    all-gather and host read each; see `burst.burst_attn`). A compiled model takes such a step eagerly,
    so that its graphs never hold the check (nor recompile for it).
    """
    set_rank_checks(model, check_ranks)
    with torch.compiler.set_stance("force_eager") if check_ranks and config.compile else contextlib.nullcontext():
        return _train_step(model, optimizer, micro_batches, config, env)


def _train_step(model: Transformer, optimizer: torch.optim.Optimizer, micro_batches: list[Batch],
                config: TrainConfig, env: Distributed) -> StepResult:
    # Known before any backward, so every micro-batch is scaled by the step's global token count.
    global_count = all_reduce(torch.tensor(float(sum(b.num_tokens for b in micro_batches)), device=env.device))
    global_count.clamp_(min=1.0)
    loss_sum = torch.zeros((), device=env.device)
    for batch in micro_batches:
        loss_sum += forward_backward(model, batch, global_count, config, env.device)
    loss = all_reduce(loss_sum) / global_count
    max_norm = config.max_grad_norm or math.inf  # 0: no clipping, but still measure the norm
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # over all shards
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    # Every rank holds the same reduced loss and norm, so every rank takes the same decision.
    applied = bool(torch.isfinite(loss) and torch.isfinite(grad_norm))
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss.item(), grad_norm.item(), applied)


def weights_are_finite(model: Transformer, env: Distributed) -> bool:
    """Whether every weight on every rank is finite (each rank checks its shards)."""
    non_finite = torch.zeros((), device=env.device)
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        non_finite = torch.maximum(non_finite, (~torch.isfinite(local.detach())).any().float())
    return all_reduce(non_finite, op=dist.ReduceOp.MAX).item() == 0


def print_config(plan: RunPlan, config: TrainConfig, console: Console) -> None:
    table = Table(title="burst train", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for name, value in dataclasses.asdict(config).items():
        table.add_row(name, f"{value} ({plan.precision.reason})" if name == "precision" else str(value))
    model = plan.model_config
    table.add_row("model shape", f"dim {model.dim}, {model.n_layers} layers, {model.n_heads} heads "
                                 f"({model.n_kv_heads} kv), vocabulary {model.vocab_size}")
    table.add_row("tokens per step", f"{config.tokens_per_step:,}")
    console.print(table)


def report_model_ready(model: Transformer, env: Distributed, started: float, metrics: Metrics | None) -> None:
    """Report (rank 0) the start-up: parameters, seconds since `started`, the largest rank's peak host memory."""
    host_peak = peak_memory_mib(torch.device("cpu"))  # the process's peak resident memory, also on CUDA runs
    peak = all_reduce(torch.tensor(host_peak, device=env.device), op=dist.ReduceOp.MAX).item()
    if metrics is not None:
        parameters = sum(p.numel() for p in model.parameters())  # global counts, also of sharded DTensors
        seconds = time.perf_counter() - started
        metrics.event("model_ready", {"parameters": parameters, "seconds": seconds, "peak_host_mib": peak},
                      f"model ready: {parameters:,} parameters, {seconds:.1f} s, peak host memory {peak:,.0f} MiB "
                      f"(largest rank)")


def train(config: TrainConfig) -> None:
    """Train with `config` as one rank of the process group the environment describes (or as a single process).

    Raises ValueError on a bad config before any work, and TrainingStopped when the run cannot continue.
    """
    started = time.perf_counter()
    if restart_count() and invocation_done(config):
        return  # the worker that died had saved this invocation's last checkpoint: nothing is left to do
    plan = plan_run(config, environment_world_size(), restart_count())  # every rank checks before joining
    config = plan.config
    env = init_distributed(config)
    if env.mesh is None:
        run(plan, env, started)
        return
    with leaving_process_group():
        try:
            run(plan, env, started)
        except RuntimeError as err:
            if isinstance(err, TrainingStopped) or not is_collective_timeout(err):
                raise
            # The other ranks have waited --timeout already: a minute more tells a hung rank from a slow one.
            answer = unresponsive_ranks(env, min(datetime.timedelta(minutes=config.timeout),
                                                 datetime.timedelta(minutes=1)))
            raise TrainingStopped(f"a collective waited longer than --timeout {config.timeout:g} minutes ({err}); "
                                  f"{answer}. That rank hung (a deadlock, a stuck device or file system) or is "
                                  f"too slow: look at its log, or raise --timeout for very long steps") from err


def run(plan: RunPlan, env: Distributed, started: float) -> None:
    # The precision this machine resolved "auto" to: the run records it, so a resume elsewhere keeps it.
    config = dataclasses.replace(plan.config, precision=plan.precision.name)
    out, console = Path(config.out), Console()
    store = TokenStore(config.data)
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        # on --resume: the layout this invocation runs with
        save_config(config, out / "config.toml", notes=f"precision {config.precision}: {plan.precision.reason}")
        shutil.copyfile(store.tokenizer_path, out / TOKENIZER_FILE)  # exports and `burst eval` check data by it
        print_config(plan, config, console)

    # A resumed run builds no initial weights: its checkpoint's load fills every shard.
    model = build_model(plan.model_config, env.mesh, config, env.device, plan.checkpoint,
                        fill=plan.resume_from is None)
    optimizer = build_optimizer(model, config)
    schedule = build_schedule(optimizer, config)
    loader = SequenceLoader(store.split("train"), config.seq_len, config.batch_size,
                            dp_rank=env.dp_rank, dp_size=config.dp, cp_rank=env.cp_rank, cp_size=config.cp,
                            seed=config.seed, reset_positions=config.doc_mask, cp_layout=config.sequence_layout)
    state = TrainState()
    if plan.resume_from is not None:
        saved = load_checkpoint(plan.resume_from, model, optimizer, env.device)
        schedule.load_state_dict(saved["schedule"])
        loader.load_state_dict(saved["loader"])
        state.load_state_dict(saved["train"])
    if env.is_main and (plan.resume_from is not None or plan.restart):
        remove_interrupted_saves(out)
        forget_metrics_after(out, state.step)  # steps past the checkpoint (or all: none) are trained again

    def report_saved(saved: Saved) -> None:
        if metrics is not None:
            size = sum(f.stat().st_size for f in saved.path.iterdir())
            metrics.event("checkpoint_saved", {"checkpoint": saved.path.name, "seconds": saved.seconds,
                                               "blocked_s": saved.blocked_s},
                          f"saved {saved.path.name}: {size / 2**20:,.1f} MiB in {saved.seconds:.2f} s "
                          f"(training waited {saved.blocked_s:.2f} s)")

    saver = CheckpointSaver(out, plan.model_config, env.device, config.keep, config.async_checkpoint, env.cpu_group,
                            report_saved)

    def save() -> None:
        if not weights_are_finite(model, env):
            saver.wait()  # a save in flight holds earlier, finite weights: it completes
            newest = complete_checkpoints(out)
            raise TrainingStopped(
                f"the weights hold non-finite values at step {state.step}: a step with a finite loss and gradient "
                f"overflowed them; no checkpoint is saved, the newest finite one is "
                f"{newest[-1] if newest else 'none (start a new run)'}. Try a lower --lr or a longer --warmup")
        train_state = {"train": state.state_dict(), "schedule": schedule.state_dict(), "loader": loader.state_dict()}
        saver.start(state.step, model, optimizer, train_state)

    metrics = Metrics(out, config.steps, console) if env.is_main else None
    report_model_ready(model, env, started, metrics)
    if metrics is not None and plan.restart:
        metrics.event("restart", {"attempt": plan.restart, "from_step": state.step},
                      f"restart {plan.restart} of the workers after one died: "
                      + (f"continuing from step {state.step}" if state.step else "starting over (no checkpoint yet)"))
    elif metrics is not None and plan.resume_from is not None:
        metrics.message(f"resumed from {plan.resume_from} (step {state.step})")
    last_step = min(config.steps, config.stop_after or config.steps)
    first_step = state.step + 1
    loop_started, first_loss, stop_reason, signalled = time.perf_counter(), None, None, None
    try:
        with StopRequest() as stop_request:
            while state.step < last_step and stop_reason is None and signalled is None:
                step_started = time.perf_counter()
                lr = schedule.get_last_lr()[0]
                result = train_step(model, optimizer, [next(loader) for _ in range(config.grad_accum)], config, env,
                                    checks_ranks(state.step + 1, first_step, config.check_ranks_every))
                schedule.step()
                state.step += 1
                state.tokens += config.tokens_per_step
                state.bad_steps = 0 if result.applied else state.bad_steps + 1
                first_loss = result.loss if first_loss is None else first_loss
                step_time = time.perf_counter() - step_started
                if state.step % config.log_every == 0 or state.step == last_step or not result.applied:
                    peak = all_reduce(torch.tensor(peak_memory_mib(env.device), device=env.device),
                                      op=dist.ReduceOp.MAX).item()
                    if metrics is not None:
                        metrics.log(state.step, {"loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                                                 "tokens_per_s": config.tokens_per_step / step_time,
                                                 "step_time_s": step_time, "peak_mem_mib": peak,
                                                 "skipped": not result.applied})
                if state.bad_steps == config.max_bad_steps:
                    stop_reason = (
                        f"{state.bad_steps} steps in a row (up to step {state.step}) had a non-finite loss or "
                        f"gradient norm (last: loss {result.loss}, gradient norm {result.grad_norm}); the run stops. "
                        f"Skipped steps change no weights. Try a lower --lr or a longer --warmup"
                        + (", or --precision fp32" if config.precision == "bf16" else ""))
                # A signal may reach some ranks only: every rank stops after the same step if any was signalled.
                signal_number = signal.Signals[stop_request.signal_name].value if stop_request.signal_name else 0
                signal_number = int(all_reduce(torch.tensor(float(signal_number), device=env.device),
                                               op=dist.ReduceOp.MAX).item())  # SIGTERM wins over SIGINT
                if signal_number:
                    signalled = signal.Signals(signal_number).name
                elif config.checkpoint_every and state.step % config.checkpoint_every == 0 \
                        and state.step < last_step and stop_reason is None:
                    save()
                saver.poll()  # an asynchronous save whose files are written becomes complete
            # Every run that finishes or stops gets here, its model and optimizer holding the last good
            # state: the one place for the run's final checkpoint (signals still only set the flag).
            saver.wait()
            save()
            saver.wait()
            path = saver.newest
        if stop_reason is not None:
            raise TrainingStopped(f"{stop_reason}. The weights of the last applied step, checked finite, are saved "
                                  f"in {path}")
        if metrics is not None:
            what = f"stopped by {signalled} after step {state.step}" if signalled else \
                f"stopped after step {state.step} (--stop-after)" if state.step < config.steps else "done"
            metrics.message(f"{what}: {state.step} steps, {state.tokens:,} tokens; this invocation "
                            f"{time.perf_counter() - loop_started:.1f} s, loss {first_loss:.4f} -> {result.loss:.4f}; "
                            f"checkpoint {path}")
            if state.step < config.steps:
                metrics.message(f"continue with: burst train --resume --out {out}")
        if signalled:
            raise TrainingInterrupted(signalled)
    finally:
        saver.close()
        if metrics is not None:
            metrics.close()
