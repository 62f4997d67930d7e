"""How a command ends when the machine or the user stops it: one line naming the path, and an exit code.

    with stopping_on_sigterm():                 # SIGTERM raises Stopped, so `finally` blocks clean up as for Ctrl-C
        with writing(tmp, kept="; OUT is unchanged"):   # a full disk here ends the command with WriteFailed
            ...

Exit codes (the CLI maps them): 2 for bad input refused before any work (ValueError, or an OSError such as a
read-only destination met before work began), 1 for work under way that a failed write ended (WriteFailed),
128 + N after signal N (130 after Ctrl-C, 143 after SIGTERM).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

# What the file system said, in words a user acts on; the errors that are about the storage, not the input.
STORAGE_ERRORS = {
    errno.ENOSPC: ("no space left on the device (the disk is full)", "free space there, or choose another destination"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota, or choose another destination"),
    errno.EROFS: ("the file system is read-only", "choose a destination on a writable file system"),
    errno.EACCES: ("permission denied", "check the owner and permissions of that path, or choose another one"),
    errno.EPERM: ("operation not permitted", "check the owner and permissions of that path, or choose another one"),
    errno.EIO: ("input/output error (a failing disk or network file system)", "check the device, then run again"),
    errno.EFBIG: ("file too large for the file system", "choose a destination on another file system"),
}


class WriteFailed(RuntimeError):
    """Work under way was ended by a failed write (disk full, read-only, permissions): exit 1. The message names
    the path and what was kept; nothing that existed before was changed."""


class Stopped(BaseException):
    """A signal asked this process to stop (SIGTERM). A BaseException, as KeyboardInterrupt is, so that no
    `except Exception` swallows it while `finally` and `except BaseException` blocks still clean up."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.exit_code = 128 + signum  # as a shell reports a process a signal ended: 143 for SIGTERM


def os_error_message(err: OSError, path: str | Path | None = None) -> str:
    """One line for `err`: the path it concerns (the error's own, else `path`), what happened, and what to do."""
    where = err.filename if err.filename is not None else path
    what, hint = STORAGE_ERRORS.get(err.errno, (err.strerror or str(err), ""))
    return f"{where}: {what}" + (f"; {hint}" if hint else "") if where is not None else \
        what + (f"; {hint}" if hint else "")


@contextlib.contextmanager
def writing(path: str | Path, kept: str = "") -> Iterator[None]:
    """Work under way that writes `path`: a storage error inside (STORAGE_ERRORS) becomes WriteFailed, one line
    naming the path (the error's own when it has one) followed by `kept` (say, "; the previous store is unchanged").
    Other errors pass through unchanged."""
    try:
        yield
    except OSError as err:
        if err.errno not in STORAGE_ERRORS:
            raise
        raise WriteFailed(os_error_message(err, path) + kept) from None


@contextlib.contextmanager
def stopping_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises Stopped in the main thread (a no-op elsewhere). Python runs the handler
    between bytecodes, so a long call into native code (tokenizer training) finishes first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


PROBE_BYTES = 64 << 10  # a write that fails even this small was refused by the storage, not the data


def storage_problem(path: str | Path) -> OSError | None:
    """Why the storage at `path` (or the nearest existing directory above it) cannot take a write now: a
    storage OSError (disk full, read-only, no permission) from writing and flushing a probe file of
    PROBE_BYTES there, or None when it can. For libraries whose errors lose the errno of a failed write."""
    directory = Path(path)
    while not directory.is_dir() and directory != directory.parent:
        directory = directory.parent
    probe = directory / f".burst-space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return err if err.errno in STORAGE_ERRORS else None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None
