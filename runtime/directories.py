"""The one rule for every directory burst writes: a token store, a model directory, a training run.

    with exclusive_writer(out, "store") as writer:   # DirectoryBusy (exit 2) while another process writes `out`
        writer.check_replaceable(force)                # an existing `out` only with force, and only when burst
        with writer.staging() as tmp:                  # wrote it as a "store"; built in OUT.tmp-XXXXXXXX,
            ...                                        # renamed to `out` only when the block completes

    with exclusive_writer(run_dir, "run") as writer:   # a directory written in place (the trainer's)
        writer.claim()                                 # makes and marks a new one; refuses one of another kind
        write_atomically(run_dir / "config.toml", text)

- One writer at a time. A writer holds an flock on `.NAME.lock` beside the directory for its whole life (the
  kernel releases it when the process ends, however it ends) and writes into it who it is; a second writer is
  refused with that: pid, host, command and since when. `wait=True` waits instead (ranks sharing a cache).
- burst marks what it writes: `.burst` inside (JSON: kind and command). `--force` replaces only a directory
  marked with the same kind; a directory of another kind, or one burst did not mark, is refused by name.
- Files appear whole: written to a temporary beside them, flushed to disk (fsync), then renamed over the old.
- Whoever takes the lock removes what dead writers left (a live writer would hold the lock): staging
  directories `NAME.tmp-XXXXXXXX` (marked by burst) and file temporaries `.FILE.tmp-XXXXXXXX` inside, and it
  puts back a directory that a replace stopped between its two renames (`NAME.old-XXXXXXXX`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

MARKER = ".burst"
KINDS = {"store": "a token store written by `burst prepare`",
         "model": "a model directory written by burst (`burst convert-checkpoint`, save_model)",
         "run": "a training run of `burst train`"}
_SUFFIX = re.compile(r"\.(tmp|old)-[0-9a-f]{8}")  # NAME + this: a staging directory, or one being replaced
_FILE_TEMPORARY = re.compile(r"\..+\.tmp-[0-9a-f]{8}")  # .FILE.tmp-XXXXXXXX: write_atomically's
_HELD: dict[tuple[int, Path], DirectoryWriter] = {}  # (thread, lock file) -> the writer this thread holds there


class DirectoryRefused(ValueError):
    """The directory may not be written as asked (another kind, not burst's, a file): exit 2, nothing changed."""


class DirectoryBusy(DirectoryRefused):
    """Another process is writing the directory; the message names it."""


def _temporary_suffix() -> str:
    return uuid.uuid4().hex[:8]


def current_command() -> str:
    """This process's command line, as a user would type it (`burst prepare docs --out store`)."""
    argv = list(sys.argv) or ["python"]
    program = Path(argv[0]).name
    return shlex.join(["burst" if program in ("burst", "cli.py") else program, *argv[1:]])


def fsync_directory(directory: Path) -> None:
    """Flush a directory's entries (a rename into it) to disk; a no-op where the file system cannot."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; their renames are as durable as they get
    finally:
        os.close(fd)


def sync_tree(directory: Path) -> None:
    """Flush every file under `directory`, then the directories themselves, to disk."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(Path(root) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_directory(Path(root))


def write_atomically(path: str | Path, data: str | bytes) -> None:
    """Replace `path` with `data` (text is UTF-8) so that a reader, or a crash, sees the old file or the new one,
    whole: written to `.NAME.tmp-XXXXXXXX` beside it, flushed to disk, renamed over it. A failure leaves the old
    file as it was and no temporary."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{_temporary_suffix()}"
    try:
        with open(tmp, "xb") as f:  # the umask's mode, as any new file
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def check_writable(path: str | Path) -> None:
    """Refuse, before any work, a file this process could not create at `path` (a read-only file system, no
    permission): an OSError naming the nearest existing directory above it. Leaves nothing behind."""
    directory = Path(os.path.abspath(path)).parent
    while not directory.exists():
        directory = directory.parent
    probe = directory / f".burst-probe-{_temporary_suffix()}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(directory)) from None
    os.unlink(probe)


def read_marker(directory: Path) -> dict | None:
    """The marker burst left in `directory` ({"kind": ..., "command": ...}), or None when there is none."""
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("kind") in KINDS else None


def describe(path: Path, recognize: Callable[[Path], str | None] | None = None) -> str:
    """What `path` is, for a refusal: a kind of burst's, a file, or a directory burst did not mark, named by
    `recognize` when it knows it (say, "a Hugging Face LLaMA directory"), with its entries."""
    if path.is_symlink():
        return f"a symbolic link to {os.readlink(path)}"
    if not path.is_dir():
        return "a file"
    marker = read_marker(path)
    if marker is not None:
        return KINDS[marker["kind"]]
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    shown = ", ".join(entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "")
    recognized = recognize(path) if recognize else None
    if recognized:
        return f"{recognized} that burst did not mark as its own (no {MARKER} marker; it holds {shown})"
    return f"a directory burst did not write (no {MARKER} marker; it holds {shown})"


def _is_empty_directory(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and next(path.iterdir(), None) is None


@dataclass
class DirectoryWriter:
    """The right to write `directory`, held by this process (see `exclusive_writer`)."""

    directory: Path  # as the user gave it: messages name it so
    kind: str  # a key of KINDS
    command: str
    _checked: bool = False  # check_replaceable passed: staging may replace what is there

    def check_replaceable(self, force: bool, older: Callable[[Path], bool] | None = None,
                          recognize: Callable[[Path], str | None] | None = None) -> None:
        """Refuse, before any work, to replace what is at `directory`: anything without force; with force, all but
        a directory of this kind that burst wrote (marked, or `older(directory)`: written by a burst from before
        markers). Nothing there, or an empty directory, is always fine. `recognize` names what burst did not mark.
        Required before `staging`."""
        path = self.directory
        self._checked = False
        if path.exists() or path.is_symlink():
            marker = read_marker(path) if path.is_dir() and not path.is_symlink() else None
            ours = marker["kind"] == self.kind if marker else bool(older and not path.is_symlink() and older(path))
            if not _is_empty_directory(path) and not (ours and force):
                what = describe(path, recognize)
                if ours:
                    raise DirectoryRefused(f"{path} already exists ({what}); choose another destination, or pass "
                                           f"--force to replace it")
                raise DirectoryRefused(f"{path} already exists and is {what}, not {KINDS[self.kind]}: --force "
                                       f"replaces only that, so it will not delete {path}; choose another "
                                       f"destination, or delete it yourself")
        self._checked = True

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh marked directory `NAME.tmp-XXXXXXXX` beside `directory` that replaces it when the block completes
        (flushed to disk first); removed when the block fails. `check_replaceable` must have passed first."""
        if not self._checked:
            raise RuntimeError("DirectoryWriter.staging() before check_replaceable() passed")
        tmp = _sibling(self.directory, "tmp")
        tmp.mkdir()  # with the umask's mode, as the directory will keep it (mkdtemp's would be 0700)
        try:
            self._mark(tmp)
            yield tmp
            sync_tree(tmp)
            self._install(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def claim(self, older: Callable[[Path], bool] | None = None) -> None:
        """For a directory written in place (a run): create and mark it when it is missing or empty; keep it when
        burst marked it with this kind, or marks it when `older(directory)` says a burst from before markers wrote
        it; refuse anything else (another kind, a directory burst did not write) by name."""
        path = self.directory
        marker = read_marker(path) if path.is_dir() and not path.is_symlink() else None
        if marker is not None and marker["kind"] == self.kind:
            return
        if marker is None and path.is_dir() and not path.is_symlink() and older and older(path):
            self._mark(path)
            return
        if path.exists() or path.is_symlink():
            if not _is_empty_directory(path):
                raise DirectoryRefused(f"{path} already exists and is {describe(path)}, not {KINDS[self.kind]}; "
                                       f"choose another destination")
        path.mkdir(parents=True, exist_ok=True)
        self._mark(path)

    def _mark(self, directory: Path) -> None:
        write_atomically(directory / MARKER, json.dumps({"kind": self.kind, "command": self.command}) + "\n")

    def _install(self, tmp: Path) -> None:
        """Rename `tmp` to `directory`. An existing one is first renamed aside to NAME.old-XXXXXXXX and deleted
        after: a kill between the two renames leaves it there, and the next writer puts it back."""
        path = self.directory
        if _is_empty_directory(path):
            path.rmdir()
        if not path.exists():
            os.replace(tmp, path)
        else:
            old = _sibling(path, "old")
            os.replace(path, old)
            os.replace(tmp, path)
            fsync_directory(path.parent)
            shutil.rmtree(old)
        fsync_directory(path.parent)

    def remove_leftovers(self) -> None:
        """Delete what dead writers of this directory left, and put back one a replace stopped halfway; called
        with the lock held, so none of it belongs to a live writer. Only what burst marked is touched."""
        path, parent = self.directory, self.directory.parent
        for sibling in sorted(parent.iterdir()) if parent.is_dir() else []:
            suffix = sibling.name[len(path.name):] if sibling.name.startswith(path.name) else ""
            if not _SUFFIX.fullmatch(suffix) or sibling.is_symlink() or not sibling.is_dir():
                continue
            marked = read_marker(sibling) is not None
            if suffix.startswith(".old-") and marked and not (path.exists() or path.is_symlink()):
                os.replace(sibling, path)  # the replace was stopped before the new one took its place
            elif marked or _is_empty_directory(sibling):
                shutil.rmtree(sibling)
        if path.is_dir() and not path.is_symlink() and read_marker(path) is not None:
            for file in path.iterdir():
                if _FILE_TEMPORARY.fullmatch(file.name) and file.is_file():
                    file.unlink()


def _sibling(path: Path, what: str) -> Path:
    return path.parent / f"{path.name}.{what}-{_temporary_suffix()}"


def _absolute(directory: str | Path) -> Path:
    """`directory` made absolute without following links ("." is the working directory, by its name)."""
    path = Path(os.path.abspath(directory))
    if not path.name:
        raise DirectoryRefused(f"{directory} is the root of the file system; choose a directory inside it")
    return path


@contextlib.contextmanager
def exclusive_writer(directory: str | Path, kind: str, command: str | None = None, *,
                     wait: bool = False) -> Iterator[DirectoryWriter]:
    """Hold the right to write `directory` (of `kind`, a key of KINDS) for the block; refuse with DirectoryBusy
    while another process holds it (or with `wait`, wait for it). The lock is `.NAME.lock` beside the directory
    (the parent is created if missing); on entry, what dead writers left is removed. Re-entrant within a thread:
    a nested call for the same directory and kind gets the same writer."""
    if kind not in KINDS:
        raise ValueError(f"unknown directory kind {kind!r}; one of {', '.join(KINDS)}")
    absolute = _absolute(directory)
    absolute.parent.mkdir(parents=True, exist_ok=True)
    lock_path = absolute.parent.resolve() / f".{absolute.name}.lock"
    key = (threading.get_ident(), lock_path)
    if key in _HELD:
        held = _HELD[key]
        if held.kind != kind:
            raise ValueError(f"{directory} is already held by this thread as a {held.kind}, not a {kind}")
        yield held
        return
    writer = DirectoryWriter(Path(directory), kind, command or current_command())
    fd = _lock(lock_path, writer, wait)
    _HELD[key] = writer
    try:
        writer.remove_leftovers()
        yield writer
    finally:
        del _HELD[key]
        _unlock(lock_path, fd)


def _lock(lock_path: Path, writer: DirectoryWriter, wait: bool) -> int:
    """Open and flock `lock_path`, then record who holds it; refuse (DirectoryBusy) when another process does."""
    while True:
        fd = _open_lock_file(lock_path, writer.directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DirectoryBusy(f"{writer.directory} is being written by another process ({holder}); wait for it to "
                                f"finish, or stop it and run this again") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            current = os.stat(lock_path)
            same = (current.st_dev, current.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed this file as it let go: lock the one there now
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": writer.command, "since": time.time()}
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
    return fd


def _open_lock_file(lock_path: Path, directory: Path) -> int:
    try:
        return os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        if isinstance(err, PermissionError) and lock_path.exists():  # another user's: lockable, not ours to write
            return os.open(lock_path, os.O_RDONLY)
        # a read-only or closed parent: name it, not the lock file the user never named
        raise OSError(err.errno, err.strerror, str(directory.parent)) from None


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 65536, 0))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        return f"pid {holder['pid']} on {holder['host']}, `{holder['command']}`, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "which has not yet said who it is"


def _unlock(lock_path: Path, fd: int) -> None:
    """Remove the lock file (while still holding it, so no one else locks it meanwhile), then let go."""
    try:
        current = os.stat(lock_path)
        if (current.st_dev, current.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
            os.unlink(lock_path)
    except OSError:
        pass
    os.close(fd)
