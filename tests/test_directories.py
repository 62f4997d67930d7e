"""The rule for every directory burst writes (runtime/directories.py): one writer, whole files, --force only
over burst's own kind, and dead writers' leftovers cleaned by the next one, never a live one's."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime import directories
from runtime.directories import (
    MARKER,
    DirectoryBusy,
    DirectoryRefused,
    exclusive_writer,
    read_marker,
    write_atomically,
)

REPO = Path(__file__).parents[1]
HOLD = """
import sys, time
from runtime.directories import exclusive_writer
with exclusive_writer(sys.argv[1], sys.argv[2], "burst prepare docs --out store") as writer:
    if sys.argv[3] == "stage":
        writer.check_replaceable(force=True)
        with writer.staging() as tmp:
            (tmp / "half.bin").write_bytes(b"half")
            print(tmp, flush=True)
            time.sleep(600)
    print("held", flush=True)
    time.sleep(600)
"""


def hold(directory: Path, kind: str = "store", stage: bool = False) -> tuple[subprocess.Popen, str]:
    """Another process that takes the directory's lock (and with `stage`, starts a staging directory) and sleeps."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), kind, "stage" if stage else "hold"],
                               stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    return process, process.stdout.readline().strip()


def stop(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    process.send_signal(sig)
    process.wait(timeout=30)
    process.stdout.close()


def test_a_second_writer_is_refused_naming_the_holder_and_the_lock_dies_with_it(tmp_path):
    out = tmp_path / "store"
    process, said = hold(out)
    assert said == "held"
    try:
        with pytest.raises(DirectoryBusy) as refused, exclusive_writer(out, "store"):
            pass
        message = str(refused.value)
        for part in (f"{out} is being written by another process", f"pid {process.pid}", socket.gethostname(),
                     "`burst prepare docs --out store`", "since 20"):
            assert part in message, message
    finally:
        stop(process)  # SIGKILL: no `finally` runs in it, the kernel releases its lock
    assert (tmp_path / ".store.lock").exists()  # the killed holder's file, no longer locked
    with exclusive_writer(out, "store") as writer:
        writer.claim()
    assert not (tmp_path / ".store.lock").exists()  # a writer that ends removes its lock file
    assert read_marker(out) == {"kind": "store", "command": directories.current_command()}


def test_the_lock_is_reentrant_in_a_thread_and_exclusive_between_threads(tmp_path):
    out = tmp_path / "model"
    failures = []
    with exclusive_writer(out, "model") as writer:
        with exclusive_writer(out, "model") as inner:
            assert inner is writer
        with pytest.raises(ValueError, match="already held by this thread as a model, not a store"):
            with exclusive_writer(out, "store"):
                pass

        def other() -> None:
            try:
                with exclusive_writer(out, "model"):
                    pass
            except DirectoryBusy as err:
                failures.append(str(err))

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert len(failures) == 1 and f"pid {os.getpid()}" in failures[0]
    with exclusive_writer(out, "model"):  # released by the outermost block only
        pass


def test_a_waiting_writer_gets_the_lock_when_the_holder_ends(tmp_path):
    out = tmp_path / "store"
    process, _ = hold(out)
    started = time.monotonic()
    threading.Timer(0.5, process.send_signal, (signal.SIGTERM,)).start()
    with exclusive_writer(out, "store", wait=True) as writer:
        assert time.monotonic() - started >= 0.5 and writer.kind == "store"  # it waited for the holder to end
    stop(process)
    assert process.returncode == -signal.SIGTERM


def test_staging_appears_whole_or_not_at_all(tmp_path):
    out = tmp_path / "deep" / "store"
    with exclusive_writer(out, "store") as writer:
        with pytest.raises(RuntimeError, match="before check_replaceable"), writer.staging():
            pass
        writer.check_replaceable(force=False)
        with pytest.raises(RuntimeError, match="failed midway"), writer.staging() as tmp:
            (tmp / "tokens.bin").write_bytes(b"partial")
            raise RuntimeError("failed midway")
        assert sorted(p.name for p in out.parent.iterdir()) == [".store.lock"]
        with writer.staging() as tmp:
            assert tmp.name.startswith("store.tmp-") and read_marker(tmp)["kind"] == "store"
            assert not out.exists()
            (tmp / "tokens.bin").write_bytes(b"whole")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "tokens.bin"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["store"]


def make_user_directory(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work")
    (path / "figures").mkdir()


def test_force_replaces_only_a_directory_of_the_same_kind_that_burst_wrote(tmp_path):
    store, run, user = tmp_path / "store", tmp_path / "run", tmp_path / "user"
    for path, kind in ((store, "store"), (run, "run")):
        with exclusive_writer(path, kind) as writer:
            writer.claim()
            (path / "precious").write_text(kind)
    make_user_directory(user)
    (tmp_path / "file").write_text("a file")
    (tmp_path / "link").symlink_to(store)
    cases = {  # destination -> what the refusal must say
        run: f"{run} already exists and is a training run of `burst train`, not a token store",
        user: f"{user} already exists and is a directory burst did not write (no .burst marker; it holds figures/, "
              f"thesis.tex)",
        tmp_path / "file": "is a file, not a token store",
        tmp_path / "link": f"is a symbolic link to {store}, not a token store",
    }
    for destination, message in cases.items():
        for force in (False, True):
            with exclusive_writer(destination, "store") as writer, pytest.raises(DirectoryRefused) as refused:
                writer.check_replaceable(force)
            assert message in str(refused.value) and "delete it yourself" in str(refused.value)
    assert (run / "precious").read_text() == "run" and (user / "thesis.tex").read_text() == "years of work"
    assert (tmp_path / "file").read_text() == "a file" and (tmp_path / "link").resolve() == store

    with exclusive_writer(store, "store") as writer, pytest.raises(DirectoryRefused) as refused:
        writer.check_replaceable(force=False)
    assert "already exists (a token store written by `burst prepare`); choose another destination, or pass " \
           "--force" in str(refused.value)
    with exclusive_writer(store, "store") as writer:
        writer.check_replaceable(force=True)
        with writer.staging() as tmp:
            (tmp / "new").write_text("new")
    assert sorted(p.name for p in store.iterdir()) == [MARKER, "new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "link", "run", "store", "user"]


def test_an_older_directory_of_the_kind_is_replaced_only_when_recognised(tmp_path):
    old = tmp_path / "store"
    old.mkdir()
    (old / "metadata.json").write_text("{}")
    with exclusive_writer(old, "store") as writer:
        with pytest.raises(DirectoryRefused, match="a token store that burst did not mark as its own"):
            writer.check_replaceable(True, recognize=lambda path: "a token store")
        with pytest.raises(DirectoryRefused, match="burst did not write"):
            writer.check_replaceable(True)
        with pytest.raises(RuntimeError, match="before check_replaceable"), writer.staging():
            pass
        writer.check_replaceable(True, older=lambda path: (path / "metadata.json").is_file())
        with writer.staging() as tmp:
            (tmp / "metadata.json").write_text('{"new": 1}')
    assert json.loads((old / "metadata.json").read_text()) == {"new": 1}


def test_claim_marks_a_new_directory_and_refuses_another_kind(tmp_path):
    run = tmp_path / "runs" / "a"
    with exclusive_writer(run, "run") as writer:
        writer.claim()
        writer.claim()  # its own kind: kept
    assert read_marker(run)["kind"] == "run"
    with exclusive_writer(run, "store") as writer, pytest.raises(DirectoryRefused, match="is a training run"):
        writer.claim()
    make_user_directory(tmp_path / "mine")
    with exclusive_writer(tmp_path / "mine", "run") as writer, pytest.raises(DirectoryRefused, match="thesis.tex"):
        writer.claim()
    assert not (tmp_path / "mine" / MARKER).exists()
    (tmp_path / "old-run").mkdir()
    (tmp_path / "old-run" / "config.toml").write_text("steps = 1\n")  # a run from before burst marked them
    with exclusive_writer(tmp_path / "old-run", "run") as writer:
        writer.claim(older=lambda path: (path / "config.toml").is_file())
    assert read_marker(tmp_path / "old-run")["kind"] == "run"
    (tmp_path / "link").symlink_to(run)
    with exclusive_writer(tmp_path / "link", "run") as writer, pytest.raises(DirectoryRefused, match="symbolic"):
        writer.claim()


def test_dead_writers_leftovers_are_removed_by_the_next_writer_and_a_live_writers_are_not(tmp_path):
    out = tmp_path / "store"
    process, staging = hold(out, stage=True)
    staging = Path(staging)
    try:
        assert staging.name.startswith("store.tmp-") and (staging / "half.bin").is_file()
        with pytest.raises(DirectoryBusy), exclusive_writer(out, "store"):
            pass
        assert (staging / "half.bin").is_file()  # the live writer's work is left alone
    finally:
        stop(process)
    assert staging.is_dir()  # SIGKILL: nothing ran in it
    lookalike = tmp_path / "store.tmp-0123abcd"  # named as burst names them, but not marked: not burst's
    make_user_directory(lookalike)
    empty = tmp_path / "store.tmp-deadbeef"  # a writer killed between mkdir and its marker
    empty.mkdir()
    with exclusive_writer(out, "store") as writer:
        writer.claim()
        write_atomically(out / "config.toml", "x = 1\n")
    (out / ".config.toml.tmp-00ff00ff").write_text("half a file")  # a write_atomically killed midway
    with exclusive_writer(out, "store"):
        pass
    assert not staging.exists() and not empty.exists() and (lookalike / "thesis.tex").is_file()
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.toml"]


def test_a_replace_stopped_between_its_renames_is_put_back(tmp_path):
    out = tmp_path / "store"
    with exclusive_writer(out, "store") as writer:
        writer.check_replaceable(force=False)
        with writer.staging() as tmp:
            (tmp / "tokens.bin").write_text("first")
    os.rename(out, tmp_path / "store.old-89abcdef")  # what a kill between the two renames leaves
    with exclusive_writer(out, "store"):
        pass
    assert (out / "tokens.bin").read_text() == "first" and sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_write_atomically_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    write_atomically(path, "steps = 1\n")
    write_atomically(path, b"steps = 2\n")
    assert path.read_text() == "steps = 2\n"

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(path, "steps = 3\n")
    assert path.read_text() == "steps = 2\n" and sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]


def test_a_directory_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    with pytest.raises(DirectoryRefused, match="root of the file system"), exclusive_writer("/", "store"):
        pass
    real_open = os.open

    def read_only(path, flags, *args):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(OSError) as failed, exclusive_writer(tmp_path / "store", "store"):
        pass
    assert failed.value.errno == errno.EROFS and failed.value.filename == str(tmp_path)
