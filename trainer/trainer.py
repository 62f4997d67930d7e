"""One rank's training run, in named phases (torchtitan's Trainer):

    trainer = Trainer(checked, env, started)   # set-up: run directory, model, optimizer, schedule, data, saver, metrics
    trainer.resume()                       # continuing a run: the checkpoint's state, and the run's history trimmed
    trainer.train()                        # step() until the last step, save() on schedule, then finish()

The stateful pieces of a run, the model, the optimizer, the LR schedule, the data loader and the
TrainState, each have state_dict()/load_state_dict(): a checkpoint is those five plus RNG states
(trainer/checkpoint.py). One is saved every --checkpoint-every steps and always when the loop ends:
finished, --stop-after, SIGTERM/Ctrl-C (trainer/signals.py) or repeated non-finite steps, and only
with finite weights: a checkpoint is never a diverged model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.table import Table

from burst.kernels import select_kernel
from checkpoints.training import complete_checkpoints, remove_interrupted_saves
from data import SequenceLoader
from data.mixture import open_sources, parse_mixture, tokenizer_source
from models.convert import generation_config_beside
from runtime.console import make_console
from runtime.memory import peak_memory_mib
from runtime.process import all_reduce
from trainer.checkpoint import forget_metrics_after, load_checkpoint, load_stage_start
from trainer.config import RECIPE_FIELDS, recipe_origin, run_identity, save_config, warmup_note
from trainer.distributed import Distributed
from trainer.metrics import Metrics
from trainer.optim import build_optimizer, build_schedule
from trainer.parallelize import build_model
from trainer.preference import Reference, load_or_compute_reference, needs_reference
from trainer.preflight import CheckedRun
from trainer.rundir import METRICS_FILE, SOURCE_TOKENIZERS, claim_run_directory
from trainer.saving import CheckpointSaver, Saved
from trainer.signals import StopRequest, TrainingInterrupted, TrainingStopped
from trainer.step import NON_FINITE, StepResult, checks_ranks, non_finite_weights, train_step
from trainer.validation import ValidationResult, Validator

SMOOTHED_STEPS = 10  # the summary's training loss: the mean over this many last steps


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


class Trainer:
    """The run of `checked` on this rank (`env`); `started` is when the invocation began (for its start-up time)."""

    def __init__(self, checked: CheckedRun, env: Distributed, started: float) -> None:
        # The precision this machine resolved "auto" to: the run records it, so a resume elsewhere keeps it.
        self.config = config = dataclasses.replace(checked.config, precision=checked.precision.name)
        self.checked, self.env, self.started = checked, env, started
        self.out, self.console = Path(config.out), make_console()
        self.sources = open_sources(parse_mixture(config.data))
        self.store = tokenizer_source(self.sources).store  # the same ids in every source; its files: the chat template
        if env.is_main:
            self.print_config()
        # The local kernel is chosen now (one named that cannot run here is refused), not at the first step: nothing
        # is written yet, so a refused --resume --attention-kernel leaves the run's config.toml as it was.
        model = checked.model_config
        select_kernel(env.device, checked.precision.dtype, config.attention_kernel, head_dim=model.head_dim,
                      groups=model.n_heads // model.n_kv_heads)
        # The draws of training itself (LoRA's dropout) come from the seed, a stream per rank; a resumed run's
        # checkpoint restores the streams where they were.
        torch.manual_seed(config.seed * 65_537 + env.rank)
        # A resumed run, or a new stage, builds no initial weights: its checkpoint's load fills every shard.
        self.model = build_model(checked.model_config, env.mesh, config, env.device, checked.checkpoint,
                                 fill=checked.resume_from is None and checked.init_from is None)
        self.optimizer = build_optimizer(self.model, config)
        self.schedule = build_schedule(self.optimizer, config)
        self.loader = SequenceLoader([source.store for source in self.sources], config.seq_len, config.batch_size,
                                     shares=[source.spec.share for source in self.sources], dp_rank=env.dp_rank,
                                     dp_size=config.dp, cp_rank=env.cp_rank, cp_size=config.cp, seed=config.seed,
                                     reset_positions=config.doc_mask, cp_layout=config.sequence_layout,
                                     long_conversations=config.long_conversations,
                                     train_on_prompt=config.train_on_prompt, prefix_sharing=config.prefix_sharing,
                                     layout_windows=checked.model_config.windows)
        self.state = TrainState()
        self.saver = CheckpointSaver(self.out, checked.model_config, env.device, config.keep, config.async_checkpoint,
                                     env.cpu_group, self.report_saved)
        self.metrics: Metrics | None = None  # rank 0's, once the run directory is written (`record`)
        # A preference run's held-out pairs are scored by `burst eval` (evaluation/preference.py), not by a token loss.
        self.validator = Validator(self.sources if config.objective == "nll" else [], config, env,
                                   checked.model_config.windows)
        self.reference: Reference | None = None  # dpo, ipo: the starting weights' logps (trainer/preference.py)
        self.accuracies: list[float] = []  # a preference run's rewards/accuracies of this invocation's steps
        self.val_losses: list[tuple[int, ValidationResult]] = []  # (step, validation) of this invocation
        self.losses: list[float] = []  # training losses of this invocation's steps that scored a token
        self.unscored_steps = 0  # this invocation's steps skipped for scoring no token
        self.steps_taken = self.steps_applied = 0  # this invocation's steps, and those that changed the weights
        self.last_step = min(config.steps, config.stop_after or config.steps)
        self.conversations = [(source.spec.name, stream) for source, stream in
                              zip(self.sources, self.loader.streams, strict=True) if source.store.is_conversations]

    # -- set-up and resume --------------------------------------------------------------------

    def print_config(self) -> None:
        table = Table(title="burst train", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        model = self.checked.model_config
        # what an unset flag means in this run, so the table never shows a bare None where a value is in force
        unset = {"model": "the --init-from checkpoint's", "rope_theta": f"the model's: {model.rope_theta:g}",
                 "rope_scaling": f"the model's: {model.rope_scaling.to_dict() if model.rope_scaling else 'none'}"}
        for name, value in dataclasses.asdict(self.config).items():
            if name == "precision":
                value = f"{value} ({self.checked.precision.reason})"
            elif name == "device":
                value = f"{value} ({self.checked.device.reason})"
            elif value is None and name in unset and (name != "model" or self.config.init_from is not None):
                value = unset[name]
            elif name in RECIPE_FIELDS:
                value = f"{value} ({recipe_origin(self.config, name)})"
            elif name == "doc_mask":
                reason = self.checked.resolved.doc_mask.reason
                value = f"{'on' if value else 'off'}" + (f" ({reason})" if reason else "")
            elif name == "cp_layout" and value == "auto":
                layout = self.checked.resolved.layout
                value = f"auto ({layout.value}, {layout.reason})"
            table.add_row(name, str(value))
        table.add_row("recipe", f"{self.config.recipe_name}: {self.config.recipe.source}")
        table.add_row("model shape", f"dim {model.dim}, {model.n_layers} layers, {model.n_heads} heads "
                                     f"({model.n_kv_heads} kv), vocabulary {model.vocab_size}")
        table.add_row("tokens per step", f"{self.config.tokens_per_step:,}")
        self.console.print(table)
        note = warmup_note(self.config)
        if note is not None:
            self.console.print(f"note: {note}")

    def resume(self) -> None:
        """Continue from the checked's checkpoint, if any: its weights, optimizer, schedule, data position and
        counters; or start a new stage from another run's weights (and optimizer state, --init-optimizer). A
        resumed or restarted run forgets the history past that checkpoint (it trains those steps again). Then
        report the start-up."""
        checked = self.checked
        if checked.init_from is not None:
            load_stage_start(checked.init_from, self.model, self.optimizer if self.config.init_optimizer else None)
        recorded_steps = None  # the steps the checkpoint's run was set for: fewer when this resume extends it
        if checked.resume_from is not None:
            saved = load_checkpoint(checked.resume_from, self.model, self.optimizer, self.env.device)
            self.schedule.load_state_dict(saved["schedule"])
            self.loader.load_state_dict(saved["loader"])
            self.state.load_state_dict(saved["train"])
            recorded_steps = saved.get("settings", {}).get("steps")
        self.check_starting_weights()
        if self.env.is_main:
            self.record()
        if self.metrics is not None and checked.init_from is not None:
            self.metrics.event("initialised", {"from": str(checked.init_from), "optimizer": self.config.init_optimizer},
                               f"initialised from {checked.init_from}"
                               + (" (weights and optimizer state)" if self.config.init_optimizer else " (weights)"))
        self.report_model_ready()
        if needs_reference(self.config):  # after the start-up's report: the pass has its own progress and event
            self.reference = load_or_compute_reference(self.out, self.model, self.store, self.config, self.env,
                                                       resumed=checked.resume_from is not None, metrics=self.metrics)
        self.report_conversations()
        if self.metrics is not None:
            self.metrics.event("validation_plan", self.validator.plan_values(), self.validator.plan())
        if self.metrics is not None and checked.restart:
            self.metrics.event("restart", {"attempt": checked.restart, "from_step": self.state.step},
                               f"restart {checked.restart} of the workers after one died: "
                               + (f"continuing from step {self.state.step}" if self.state.step
                                  else "starting over (no checkpoint yet)"))
        elif self.metrics is not None and checked.resume_from is not None:
            self.metrics.message(f"resumed from {checked.resume_from} (step {self.state.step})")
        self.report_extension(recorded_steps)
        if self.metrics is not None and checked.recorded_device not in (None, self.config.device):
            was = checked.recorded_device
            self.metrics.event("device_changed", {"from": was, "to": self.config.device},
                               f"device: the run ran on {was} and continues on {self.config.device} "
                               f"({checked.device.reason}); pass --device {was} to keep it there")

    def report_extension(self, recorded_steps: int | None) -> None:
        """Say once that a resume with a larger --steps extends the run, and what that does to its schedule."""
        steps = self.config.steps
        if self.metrics is None or recorded_steps is None or recorded_steps == steps:
            return
        self.metrics.event("extended", {"from_steps": recorded_steps, "to_steps": steps},
                           f"extending the run from {recorded_steps} to {steps} steps: the learning-rate schedule is "
                           f"now the {steps}-step one (warmup {self.config.warmup} kept), so from step "
                           f"{self.state.step} the rate is that schedule's, not the {recorded_steps}-step one's")

    def record(self) -> None:
        """Rank 0 writes the run directory, once everything it starts from is loaded and checked: a new run's
        config.toml and its data's tokenizer; on --resume the layout this invocation runs with (config.toml,
        replaced whole), the tokenizer only read (preflight compared it with the data's). A continued run
        forgets the history past its checkpoint (it trains those steps again). Then the metrics log opens."""
        checked, config = self.checked, self.config
        continued = checked.resume_from is not None or checked.restart > 0
        claim_run_directory(self.out)
        save_config(config, self.out / "config.toml",
                    notes=f"precision {config.precision}: {checked.precision.reason}\n"
                          f"device {config.device}: {checked.device.reason}")
        if checked.resume_from is None:  # never replaced (preflight compared its ids on resume); exports carry it
            self.store.copy_tokenizer(self.out)
            # the sampling settings of the model it starts from (a Hugging Face directory's), which exports carry
            starts = [checked.checkpoint] if checked.checkpoint else \
                [checked.init_from, checked.init_from.parent.parent] if checked.init_from else []
            kept = next(filter(None, map(generation_config_beside, starts)), None)
            if kept is not None:
                shutil.copy2(kept, self.out / kept.name)
            for source in self.sources:  # the same ids, other files (no chat template): kept aside, by source
                if source.store.metadata["tokenizer"]["files"] != self.store.metadata["tokenizer"]["files"]:
                    (self.out / SOURCE_TOKENIZERS / source.spec.name).mkdir(parents=True, exist_ok=True)
                    source.store.copy_tokenizer(self.out / SOURCE_TOKENIZERS / source.spec.name)
        if continued:
            remove_interrupted_saves(self.out)
            forget_metrics_after(self.out, self.state.step)  # steps past the checkpoint (or all: none) come again
        else:
            (self.out / METRICS_FILE).unlink(missing_ok=True)  # a failed start-up's: no step was logged
        self.metrics = Metrics(self.out, config.steps, self.console, config.wandb, dataclasses.asdict(config))

    def check_starting_weights(self) -> None:
        """Refuse to train from weights that are not finite (a damaged file, a diverged model): the run would
        fail at its first step and blame the learning rate."""
        bad = non_finite_weights(self.model, self.env)
        if bad:
            checked = self.checked
            source = checked.resume_from or checked.init_from or checked.checkpoint or f"--seed {self.config.seed}"
            raise ValueError(f"the starting weights from {source} hold non-finite values (nan or inf) in "
                             f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} ({len(bad)} tensors): the "
                             f"checkpoint is damaged or comes from a diverged run; start from another one")

    def report_model_ready(self) -> None:
        """Report (rank 0) the start-up: parameters, seconds since `started`, the largest rank's peak host memory."""
        host_peak = peak_memory_mib(torch.device("cpu"))  # the process's peak resident memory, also on CUDA runs
        peak = all_reduce(torch.tensor(host_peak, device=self.env.device), op=dist.ReduceOp.MAX).item()
        if self.metrics is not None:
            parameters = sum(p.numel() for p in self.model.parameters())  # global counts, also of sharded DTensors
            seconds = time.perf_counter() - self.started
            self.metrics.event("model_ready", {"parameters": parameters, "seconds": seconds, "peak_host_mib": peak},
                               f"model ready: {parameters:,} parameters, {seconds:.1f} s, peak host memory "
                               f"{peak:,.0f} MiB (largest rank)")

    def report_conversations(self) -> None:
        """Report (rank 0) what packing does to each instruction source: its conversations, and those longer than
        a sequence with what the --long-conversations policy does to them."""
        if self.metrics is None or not self.conversations:
            return
        values, lines = {}, []
        for name, stream in self.conversations:
            long = stream.long
            values[name] = {"conversations": stream.store.num_documents, "longer_than_sequence": long.count,
                            "policy": long.policy, "truncated_tokens": long.truncated_tokens, "pieces": long.pieces}
            lines.append(f"{name}: {long.describe(stream.store.num_documents)}"
                         + (", prompts scored too" if self.config.train_on_prompt else ", answers scored"))
        self.metrics.event("conversations", {"sources": values}, "; ".join(lines))

    # -- the loop -----------------------------------------------------------------------------

    def train(self) -> None:
        """Step until the invocation's last step, a signal or repeated non-finite steps; then finish(): the
        final checkpoint, the summary, and TrainingStopped or TrainingInterrupted when the run did not end."""
        first_step, stop_reason, signalled = self.state.step + 1, None, None
        loop_started = time.perf_counter()
        try:
            self.validate()
            with StopRequest() as stop_request:
                while self.state.step < self.last_step and stop_reason is None and signalled is None:
                    result = self.step(checks_ranks(self.state.step + 1, first_step, self.config.check_ranks_every))
                    if result.loss is None and self.state.step == first_step:
                        first_step += 1  # it scored no token, so ran no attention: the next step checks the ranks
                    stop_reason = self.bad_steps_reason(result)
                    signalled = self.agreed_signal(stop_request)
                    before_end = self.state.step < self.last_step and stop_reason is None and not signalled
                    if before_end and self.config.val_every and self.state.step % self.config.val_every == 0:
                        self.validate()
                    every = self.config.checkpoint_every
                    if before_end and every and self.state.step % every == 0:
                        self.save()
                    self.saver.poll()  # an asynchronous save whose files are written becomes complete
                if stop_reason is None and not signalled:
                    self.validate()
                # Every run that finishes or stops gets here, its model and optimizer holding the last good
                # state: the one place for the run's final checkpoint (signals still only set the flag).
                self.finish(stop_reason, signalled, time.perf_counter() - loop_started)
        finally:
            self.saver.close()
            if self.metrics is not None:
                self.metrics.close()

    def validate(self) -> None:
        """The validation loss now (trainer/validation.py), logged as a `validation` event; once per step."""
        if self.val_losses and self.val_losses[-1][0] == self.state.step:
            return
        metrics, step, validator = self.metrics, self.state.step, self.validator
        result = validator(self.model, functools.partial(metrics.progress, "validation") if metrics else None)
        if result is None:
            return
        if result.loss is not None:
            self.val_losses.append((step, result))
        if metrics is not None:
            text = f"validation loss {result.loss:.4f}" if result.loss is not None else \
                "validation: the held-out sequences score no token (no answer among their conversations)"
            metrics.event("validation", {"at_step": step, "loss": result.loss, "held_out_tokens": result.tokens,
                                         "sequences": validator.sequences, "seconds": result.seconds,
                                         "left_out": validator.skipped},
                          f"{text} at step {step} over {result.tokens:,} held-out tokens ({validator.sequences} "
                          f"sequence{'s' if validator.sequences > 1 else ''}, {result.seconds:.1f} s)"
                          f"{validator.left_out()}", step=step)

    def step(self, check_ranks: bool) -> StepResult:
        """One optimizer step over grad_accum micro-batches, its counters, and its metrics when logged."""
        config, state = self.config, self.state
        step_started = time.perf_counter()
        lr = self.schedule.get_last_lr()[0]
        batches = [next(self.loader) for _ in range(config.grad_accum)]
        if self.reference is not None:
            batches = [self.reference.attach(batch) for batch in batches]
        result = train_step(self.model, self.optimizer, batches, config, self.env, check_ranks)
        if "rewards/accuracies" in result.metrics:
            self.accuracies.append(result.metrics["rewards/accuracies"])
        with warnings.catch_warnings():  # a skipped step still takes its step of the schedule: no surprise to warn of
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before", UserWarning)
            self.schedule.step()
        if result.loss is not None:
            self.losses.append(result.loss)
        else:
            self.unscored_steps += 1
        state.step += 1
        state.tokens += config.tokens_per_step
        self.steps_taken += 1
        self.steps_applied += result.applied
        if result.applied or result.skip_reason == NON_FINITE:  # a step that scored no token is neither
            state.bad_steps = 0 if result.applied else state.bad_steps + 1
        step_time = time.perf_counter() - step_started
        if state.step % config.log_every == 0 or state.step == self.last_step or not result.applied:
            peak = all_reduce(torch.tensor(peak_memory_mib(self.env.device), device=self.env.device),
                              op=dist.ReduceOp.MAX).item()
            if self.metrics is not None:
                self.metrics.log(state.step, {"loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                                              "tokens_per_s": config.tokens_per_step / step_time,
                                              "step_time_s": step_time, "peak_mem_mib": peak,
                                              "skipped": not result.applied, "skip_reason": result.skip_reason,
                                              "scored_tokens": result.scored_tokens,
                                              "tokens_by_source": self.tokens_by_source(), **result.metrics,
                                              **({"padding_tokens": self.loader.padding_tokens}
                                                 if self.conversations else {})})
        return result

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens each --data source has given the run so far (a sequence comes whole from one source)."""
        return {source.spec.name: count * self.config.seq_len
                for source, count in zip(self.sources, self.loader.sequences_by_source, strict=True)}

    def bad_steps_reason(self, result: StepResult) -> str | None:
        """Why the run stops after this step, when --max-bad-steps non-finite steps came in a row."""
        if self.state.bad_steps < self.config.max_bad_steps:
            return None
        return (f"{self.state.bad_steps} steps in a row (up to step {self.state.step}) had a non-finite loss or "
                f"gradient norm (last: loss {result.loss}, gradient norm {result.grad_norm}); the run stops. "
                f"Skipped steps change no weights. Try a lower --lr or a longer --warmup"
                + (", or --precision fp32" if self.config.precision == "bf16" else ""))

    def agreed_signal(self, stop_request: StopRequest | None) -> str | None:
        """The signal that stops the run after this step, if any rank got one: a signal may reach some ranks
        only, so every rank stops after the same step (SIGTERM wins over SIGINT). The same reduction tells
        every rank when rank 0 could not complete a checkpoint: then all stop, with its reason."""
        number = signal.Signals[stop_request.signal_name].value if stop_request and stop_request.signal_name else 0
        flags = torch.tensor([float(number), float(self.saver.failure is not None)], device=self.env.device)
        number, failed = (int(x) for x in all_reduce(flags, op=dist.ReduceOp.MAX).tolist())
        if failed:
            raise TrainingStopped(self.saver.failure or "rank 0 could not complete the checkpoint just saved (its "
                                                        "message says why); the run stops")
        return signal.Signals(number).name if number else None

    # -- saving and the end -------------------------------------------------------------------

    def save(self) -> None:
        """Start a checkpoint of the current step, after checking that every weight on every rank is finite."""
        if non_finite_weights(self.model, self.env):
            self.saver.wait()  # a save in flight holds earlier, finite weights: it completes
            newest = complete_checkpoints(self.out)
            raise TrainingStopped(
                f"the weights hold non-finite values at step {self.state.step}: a step with a finite loss and "
                f"gradient overflowed them; no checkpoint is saved, the newest finite one is "
                f"{newest[-1] if newest else 'none (start a new run)'}. Try a lower --lr or a longer --warmup")
        train_state = {"train": self.state.state_dict(), "schedule": self.schedule.state_dict(),
                       "loader": self.loader.state_dict(), "settings": run_identity(self.config)}
        self.saver.start(self.state.step, self.model, self.optimizer, train_state)

    def report_saved(self, saved: Saved) -> None:
        if self.metrics is not None:
            size = sum(f.stat().st_size for f in saved.path.iterdir())
            self.metrics.event("checkpoint_saved", {"checkpoint": saved.path.name, "seconds": saved.seconds,
                                                    "blocked_s": saved.blocked_s},
                               f"saved {saved.path.name}: {size / 2**20:,.1f} MiB in {saved.seconds:.2f} s "
                               f"(training waited {saved.blocked_s:.2f} s)")

    def finish(self, stop_reason: str | None, signalled: str | None, seconds: float) -> None:
        """Save the final checkpoint and report how the invocation ended; raise if it did not end well."""
        self.saver.wait()
        self.save()
        self.saver.wait()
        self.agreed_signal(None)  # the final save complete on every rank, or TrainingStopped on every rank
        path = self.saver.newest
        if stop_reason is None and self.steps_taken and not self.steps_applied:
            stop_reason = (f"no step of this invocation was applied: all {self.steps_taken} steps were skipped (a "
                           f"non-finite loss or gradient norm, or no token scored), so the weights did not change. "
                           f"Try a lower --lr or a longer --warmup" + (f", or another --beta (now {self.config.beta:g})"
                                                                      if self.config.objective != "nll" else ""))
        if stop_reason is not None:
            raise TrainingStopped(f"{stop_reason}. The weights of the last applied step, checked finite, are saved "
                                  f"in {path}")
        if self.metrics is not None:
            state, config = self.state, self.config
            what = f"stopped by {signalled} after step {state.step}" if signalled else \
                f"stopped after step {state.step} (--stop-after)" if state.step < config.steps else "done"
            padding = self.loader.padding_tokens
            packed = f" ({padding:,} of them padding, {padding / max(state.tokens, 1):.1%}, between whole " \
                     f"conversations)" if self.conversations else ""
            self.metrics.message(f"{what}: {state.step} steps, {state.tokens:,} tokens{packed}; this invocation "
                                 f"{seconds:.1f} s{self.loss_summary()}; checkpoint {path}")
            if state.step < config.steps:
                self.metrics.message(f"continue with: burst train --resume --out {self.out}")
        if signalled:
            raise TrainingInterrupted(signalled)

    def loss_summary(self) -> str:
        """What this invocation's losses say, in figures one can trust: the validation loss at its start and
        end, and the training loss averaged over its last steps (one step's loss is one batch's, noisy)."""
        text = ""
        if self.val_losses:
            (first_step, first), (last_step, last) = self.val_losses[0], self.val_losses[-1]
            text += f"; validation loss {first.loss:.4f} (step {first_step}) -> {last.loss:.4f} (step {last_step}) " \
                    f"over {last.tokens:,} held-out tokens"
        recent = [loss for loss in self.losses[-SMOOTHED_STEPS:] if math.isfinite(loss)]
        if recent:
            text += f"; training loss {sum(recent) / len(recent):.4f} (mean of the last {len(recent)} steps)"
        if self.unscored_steps:
            text += f"; {self.unscored_steps} step{'s' if self.unscored_steps > 1 else ''} scored no token " \
                    f"(skipped, left out of the losses)"
        if self.accuracies:
            accuracies = self.accuracies[-SMOOTHED_STEPS:]
            text += f", reward accuracy {sum(accuracies) / len(accuracies):.1%} ({self.config.objective})"
        return text
