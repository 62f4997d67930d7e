"""The run directory's rule (runtime/directories.py): one writer, marked as a run, never mixed with another.

    with hold_run_directory(out):   # the launcher (or rank 0 under torchrun) for the run's whole life;
        ...                         # a second `burst train` on `out`, or a --resume of a run still training, is
                                    # refused with exit 2 naming the holder
    claim_run_directory(out)        # rank 0, once start-up succeeded: create and mark it (or adopt a run of before
                                    # markers), refusing a directory of another kind or one burst did not write

The launcher holds the lock and its workers know it from the environment (they are its children, and flock
belongs to the process that took it; they die with it, however it ends: runtime/launch.py); under torchrun
rank 0 holds it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from data.tokenizer import TOKENIZER_FILES
from runtime.directories import (
    MARKER,
    DirectoryRefused,
    DirectoryWriter,
    current_command,
    describe,
    exclusive_writer,
    read_marker,
)

HELD_ENV = "BURST_RUN_DIRECTORY_HELD"  # set by the process holding the lock, for the workers it starts
METRICS_FILE = "metrics.jsonl"
SOURCE_TOKENIZERS = "tokenizers"  # RUN/tokenizers/NAME/: a mixture source's tokenizer files, where they differ
# What a run that failed during start-up (before its first step) leaves: a rerun may reuse the directory.
STARTUP_FILES = {MARKER, "config.toml", *TOKENIZER_FILES, SOURCE_TOKENIZERS, METRICS_FILE}


@contextlib.contextmanager
def hold_run_directory(out: str | Path) -> Iterator[None]:
    """Hold the writer lock of the run directory `out` for the block (DirectoryBusy, exit 2, while another process
    writes it), unless this process's launcher holds it already."""
    key = os.path.abspath(out)
    if os.environ.get(HELD_ENV) == key:
        yield
        return
    with exclusive_writer(out, "run"):
        os.environ[HELD_ENV] = key  # inherited by the workers this process starts
        try:
            yield
        finally:
            os.environ.pop(HELD_ENV, None)


def is_older_run(path: Path) -> bool:
    """A run directory a burst from before markers wrote: its config.toml and checkpoints."""
    return (path / "config.toml").is_file() and (path / "checkpoints").is_dir()


def claim_run_directory(out: Path) -> None:
    """Create and mark the run directory (rank 0, at the end of start-up); refuses another kind by name."""
    DirectoryWriter(out, "run", current_command()).claim(older=is_older_run)


def check_run_dir(out: Path) -> None:
    """Refuse, for a new run, a directory that holds anything but a failed start-up of a burst run (its marker,
    config.toml, tokenizer and a metrics log without steps): a new run never mixes into an old one, and never
    writes over files burst did not write."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise DirectoryRefused(f"--out {out} is {describe(out)}, not a directory; choose a new --out")
    entries = {p.name for p in out.iterdir()}
    if not entries:
        return
    marker = read_marker(out)
    if marker is None and is_older_run(out):
        marker = {"kind": "run"}  # written by a burst of before markers
    if marker is None or marker["kind"] != "run":
        raise DirectoryRefused(f"--out {out} already exists and is {describe(out)}; a new run starts in a new or "
                               f"empty directory: choose a new --out" + ("" if marker else f", or delete {out}"))
    if entries - STARTUP_FILES or _logged_steps(out):
        raise DirectoryRefused(f"run directory {out} already holds another run; choose a new --out, continue it "
                               f"with `burst train --resume --out {out}`, or delete {out}")


def _logged_steps(out: Path) -> bool:
    path = out / METRICS_FILE
    if not path.is_file():
        return False
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            if "step" in json.loads(line):
                return True
    return False
