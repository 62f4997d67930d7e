"""Writing a run's training checkpoints: synchronously, or in the background while training goes on.

    saver = CheckpointSaver(out, model_config, device, keep=2, asynchronous=True, group=env.cpu_group,
                            on_saved=report)
    saver.start(step, model, optimizer, train_state)   # asynchronous: returns at once
    saver.poll()                                        # each step: completes a save whose files are written
    saver.wait()                                        # before the next save and before the run ends
    saver.close()

Every rank writes its shards into `step-N.tmp-<id>` (DCP), hashing each as it writes it; rank 0 then writes
COMPLETE, the SHA-256 of every file in it, and renames the directory to `step-N`, and only then deletes
checkpoints past --keep. A kill at any point leaves the previous checkpoint whole and a tmp directory that
readers ignore and --resume deletes.

Asynchronous saves use DCP's async_save: one background thread copies the state to CPU memory
(staging) while the next step's forward and backward run, and another writes the copy, on a process
group of its own so its collectives never interleave with the training step's. The weights and the
optimizer state change only in optimizer.step(), so a hook before it waits for the copy: that wait,
and the hand-over, are all the loop waits. At most one save is in flight: starting another, or
ending the run, waits for it. DCP writes .metadata on rank 0 only after gathering every rank's write results,
so rank 0's save finishing means every rank's files are there; each rank's RNG file is written
before its shards are handed over, so it is there too.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from checkpoints.training import (
    CHECKSUMS,
    MARKER,
    STATE_NAME,
    checkpoint_dir,
    complete_checkpoints,
    missing_files,
    rng_name,
)
from models.checkpoint import CONFIG_NAME
from models.config import ModelConfig
from models.storage import read_json, write_json
from runtime.digest import file_sha256
from runtime.failure import STORAGE_ERRORS, WriteFailed, os_error_message, storage_problem
from trainer.checkpoint import rng_state

# A save's files take a little more than its tensors (DCP's metadata, JSON, zip framing).
SAVE_OVERHEAD, SAVE_SLACK_BYTES = 1.05, 2**20


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested state dict."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _tensors(value)


class _HashingStream(io.RawIOBase):
    """A file being written, and the SHA-256 of what was written to it (DCP writes its shards in order)."""

    def __init__(self, file: io.IOBase) -> None:
        super().__init__()
        self.file, self.sha256 = file, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.file.write(data)

    def tell(self) -> int:
        return self.file.tell()

    def fileno(self) -> int:
        return self.file.fileno()

    def flush(self) -> None:
        self.file.flush()


class _HashingFileSystem(FileSystem):
    """DCP's file system, keeping the SHA-256 of each file it writes by name: hashed while written, not read back."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, str] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            try:
                yield hashing
            finally:
                hashing.close()  # while its file is open: left to the finaliser, close() flushes a closed file
        self.digests[Path(path).name] = hashing.sha256.hexdigest()


def _digests_name(rank: int) -> str:
    return f"sha256-{rank:05d}.json"  # a rank's shard digests, until COMPLETE gathers them


class _ChecksummedWriter(dcp.FileSystemWriter):
    """DCP's file writer, hashing each shard as it writes it; the rank's digests land beside the shards before DCP
    gathers the ranks' results, so rank 0 finds every rank's once the save is done."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(path)
        self.fs, self.own_rank = _HashingFileSystem(), rank

    def write_data(self, plan, planner) -> torch.futures.Future:
        written = super().write_data(plan, planner)
        written.wait()  # the file writer has written when it returns
        write_json(self.fs.digests, Path(self.path) / _digests_name(self.own_rank))
        return written


def checksums(directory: Path) -> dict[str, str]:
    """The SHA-256 of every file of a finished save in `directory`, for COMPLETE: the shards' as their ranks wrote
    them (their digest files are then removed), the small files' read here."""
    found: dict[str, str] = {}
    for digests in directory.glob("sha256-*.json"):
        found.update(read_json(digests))
        digests.unlink()
    for file in directory.iterdir():
        if file.is_file() and file.name not in found and file.name != MARKER:
            found[file.name] = file_sha256(file)
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class Saved:
    """A checkpoint that became complete."""

    path: Path
    seconds: float  # from the start of the save to its completion
    blocked_s: float  # how long the training loop waited for it


@dataclass
class _Pending:
    future: Future  # the files are written
    staged: Future  # the state is copied: the optimizer may change it again
    step: int
    tmp: Path
    started: float
    blocked_s: float


class CheckpointSaver:
    """Saves the checkpoints of the run in `out`, on every rank (start, poll and wait are called by all ranks
    at the same steps); `on_saved` is called on every rank when a checkpoint is complete.

    group: a gloo group of every rank, apart from the training step's, for the background save's
    collectives (plans, results); None in a single process.
    """

    def __init__(self, out: Path, model_config: ModelConfig, device: torch.device, keep: int, asynchronous: bool,
                 group: dist.ProcessGroup | None, on_saved: Callable[[Saved], None]) -> None:
        self.out, self.model_config, self.device, self.keep = out, model_config, device, keep
        self.asynchronous, self.group, self.on_saved = asynchronous, group, on_saved
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.failure: str | None = None  # rank 0: why the last save could not be completed
        self._pending: _Pending | None = None
        self.newest: Path | None = None  # the directory of the newest save this saver completed
        self._hooked: set[int] = set()  # the optimizers whose step() waits for the staging copy
        # One stager for the run: it keeps its CPU buffers from one save to the next (pinned on CUDA).
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=device.type == "cuda", use_shared_memory=False,
                                                    use_async_staging=True,
                                                    use_non_blocking_copy=device.type == "cuda")) \
            if asynchronous else None

    def start(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              train_state: dict[str, Any]) -> None:
        """Save checkpoint `step`; asynchronously: return at once, the copy and the files follow.

        `train_state` (rank 0's) is the JSON-able rest of the run: TrainState, schedule and loader states.
        """
        self.wait()  # at most one save in flight
        started = time.perf_counter()
        tag = [uuid.uuid4().hex[:8]]
        if dist.is_initialized():
            dist.broadcast_object_list(tag, src=0)  # every rank writes into the same tmp directory
        final = checkpoint_dir(self.out, step)
        tmp = final.with_name(f"{final.name}.tmp-{tag[0]}")
        with self._storage_checked(tmp, step):
            tmp.mkdir(parents=True, exist_ok=True)
            write_json(rng_state(self.device), tmp / rng_name(self.rank))
            if self.rank == 0:
                write_json(self.model_config.to_dict(), tmp / CONFIG_NAME)
                write_json(train_state, tmp / STATE_NAME)
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            self._check_room(state, tmp)
            if self.asynchronous:
                if id(optimizer) not in self._hooked:
                    optimizer.register_step_pre_hook(lambda *_: self._wait_for_staging())
                    self._hooked.add(id(optimizer))
                response = dcp.async_save(state, storage_writer=_ChecksummedWriter(tmp, self.rank),
                                          process_group=self.group, async_stager=self._stager,
                                          no_dist=not dist.is_initialized())
                future, staged = response.upload_completion, response.staging_completion
            else:
                future = Future()
                future.set_result(dcp.save(state, storage_writer=_ChecksummedWriter(tmp, self.rank),
                                           no_dist=not dist.is_initialized()))
                staged = future
        self._pending = _Pending(future, staged, step, tmp, started, time.perf_counter() - started)
        if not self.asynchronous:
            self.wait()

    def _check_room(self, state: dict[str, Any], tmp: Path) -> None:
        """Refuse to start a save the disk has no room for (every rank's shards together, against the free
        space each rank sees there), the same verdict on every rank: an OSError(ENOSPC) for `_storage_checked`."""
        local = sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes
                    for t in _tensors(state))  # this rank's shards
        total = torch.tensor([float(local)])
        if dist.is_initialized():
            dist.all_reduce(total, group=self.group)
        needed = int(total.item() * SAVE_OVERHEAD) + SAVE_SLACK_BYTES
        free = shutil.disk_usage(tmp).free
        short = torch.tensor([float(needed > free)])
        if dist.is_initialized():
            dist.all_reduce(short, op=dist.ReduceOp.MAX, group=self.group)
        if short.item():
            raise OSError(errno.ENOSPC, f"the checkpoint needs about {needed / 2**20:,.1f} MiB there and "
                                        f"{free / 2**20:,.1f} MiB are free", str(self.out))

    @contextlib.contextmanager
    def _storage_checked(self, tmp: Path, step: int) -> Iterator[None]:
        """A save that fails because of the storage (a full disk, a read-only or forbidden path) ends the run
        with WriteFailed (exit 1): one line naming the path, and the checkpoint that stays intact. DCP reports
        a full disk as whatever its file writer hit ("unexpected pos ..."), so the directory is probed to tell."""
        try:
            yield
        except Exception as err:
            problem = err if isinstance(err, OSError) and err.errno in STORAGE_ERRORS else storage_problem(tmp)
            if problem is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # its space back; the previous checkpoint is untouched
            detail = f" ({problem.strerror})" if problem.errno == errno.ENOSPC and "MiB" in str(problem.strerror) \
                else ""
            raise WriteFailed(f"saving checkpoint {checkpoint_dir(self.out, step).name} failed: "
                              f"{os_error_message(problem, tmp)}{detail}. The newest complete checkpoint, "
                              f"{self.newest or 'none yet'}, is intact; continue with `burst train --resume "
                              f"--out {self.out}` once there is room") from None

    def _wait_for_staging(self) -> None:
        """Before optimizer.step(): the save in flight must have copied the state it changes."""
        if self._pending is not None and not self._pending.staged.done():
            waited = time.perf_counter()
            self._pending.staged.result()
            self._pending.blocked_s += time.perf_counter() - waited

    def poll(self) -> None:
        """Complete the save in flight if its files are written (no waiting, no collective)."""
        if self._pending is not None and self._pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight, if any, and complete it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        waited = time.perf_counter()
        with self._storage_checked(pending.tmp, pending.step):
            pending.future.result()  # raises the background save's error, if any
        blocked_s = pending.blocked_s + time.perf_counter() - waited
        final = checkpoint_dir(self.out, pending.step)
        # Rank 0 marks the checkpoint complete only once it sees every rank's files: ranks writing to
        # directories that are not one shared directory (node-local disks) leave it without the others'.
        problems = missing_files(pending.tmp, self.world_size) if self.rank == 0 else []
        if problems:
            self.failure = (f"checkpoint {final.name} is incomplete as rank 0 sees it in {pending.tmp}: "
                            f"{'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}. Every rank must write "
                            f"to the same --out, on a file system all nodes share; the newest complete checkpoint "
                            f"is {self.newest or 'none'}")
        elif self.rank == 0:
            write_json({"step": pending.step, CHECKSUMS: checksums(pending.tmp)}, pending.tmp / MARKER)
            if final.exists():  # a checkpoint of this step from an earlier invocation: the new one replaces it
                shutil.rmtree(final)
            os.replace(pending.tmp, final)
            for old in complete_checkpoints(self.out)[:-self.keep]:
                shutil.rmtree(old)
        if not self.asynchronous and dist.is_initialized():
            dist.barrier()  # no rank goes on (or exits) before the checkpoint is complete
        if problems:
            return  # the loop ends the run on every rank at its next agreement (Trainer.agreed_stop)
        self.newest = final
        self.on_saved(Saved(final, time.perf_counter() - pending.started, blocked_s))

    def close(self) -> None:
        """Release the staging buffers (the run's last save is waited for first, by `wait`)."""
        if self._stager is not None:
            self._stager.close()
