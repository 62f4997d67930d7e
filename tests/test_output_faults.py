"""The directories and files burst writes, under faults: a second writer, signals, kills, --force over the wrong
kind, read-only destinations and full disks, for `burst prepare`, `burst convert-checkpoint` and `burst eval --json`.

Each test checks the exit code, the one-line message (naming the path, no traceback), and that nothing that
existed was lost or changed. Read-only and full-disk cases use a read-only bind mount and a small tmpfs when the
tests run as root (root ignores file permissions, so chmod proves nothing there), permissions otherwise; a disk
full is also injected at the write, which runs everywhere.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from data import TokenStore, default_store, prepare
from data.store import StoreWriter
from models import ModelConfig, Transformer, save_model
from runtime.directories import MARKER, exclusive_writer
from tests.test_bad_input import evaluate_args, invoke, refused
from tests.test_bad_input import model_for_store as model_for_store  # noqa: F401  (fixtures)
from tests.test_data_prepare import make_text, write_corpus
from tests.test_data_prepare import tokenizer as tokenizer  # noqa: F401
from tests.test_directories import hold, stop

REPO = Path(__file__).parents[1]
# `burst prepare` whose reading is slowed down, so that a test can act while it is under way.
SLOW_PREPARE = """
import sys, time
import data.sources as sources
parts = sources.DocumentReader.parts
def slowly(self):
    for part in parts(self):
        time.sleep(0.05)
        yield part
sources.DocumentReader.parts = slowly
sources.BLOCK_BYTES = 4096
sys.argv[0] = "burst"
import cli
cli.main()
"""


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (hidden ones too) by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def wait_for(condition: Callable[[], object], what: str, timeout: float = 120) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def slow_corpus(tmp_path) -> Path:
    """One text file of about 200 KB: some 50 blocks of the slowed-down reader, a few seconds."""
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "big.txt").write_text(make_text(random.Random(5), 30_000))
    return tmp_path / "slow"


@pytest.fixture
def corpus(tmp_path) -> Path:
    write_corpus(tmp_path / "corpus")
    return tmp_path / "corpus"


def start_prepare(*args) -> tuple[subprocess.Popen, Path]:
    """A slowed-down `burst prepare ARGS` in another process, and its staging directory once it tokenizes."""
    out = Path(args[list(args).index("--out") + 1])
    process = subprocess.Popen([sys.executable, "-c", SLOW_PREPARE, "prepare", *map(str, args)], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    staging = wait_for(lambda: next((p for p in out.parent.glob(f"{out.name}.tmp-*") if (p / "tokens.bin").exists()),
                                    None) or process.poll() is not None, "the first prepare to tokenize")
    assert isinstance(staging, Path), process.communicate()
    return process, staging


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name or p.suffix == ".lock")


# ---- two writers, signals, kills -------------------------------------------------------------------------------

def test_a_second_prepare_to_the_same_out_is_refused_naming_the_first(tmp_path, slow_corpus, corpus, tokenizer):  # noqa: F811
    out = tmp_path / "store"
    first, staging = start_prepare(slow_corpus, "--out", out, "--tokenizer", tokenizer.path)
    try:
        for force in ([], ["--force"]):
            refused(invoke("prepare", corpus, "--out", out, "--tokenizer", tokenizer.path, *force),
                    f"{out} is being written by another process", f"pid {first.pid}",
                    f"`burst prepare {slow_corpus} --out {out}", "since 20")
            assert (staging / "tokens.bin").is_file()  # the first one's work is left alone
        _, stderr = first.communicate(timeout=120)
        assert first.returncode == 0, stderr
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    finished = snapshot(out)
    assert TokenStore(out).num_documents == 1 and leftovers(tmp_path) == []
    refused(invoke("prepare", corpus, "--out", out, "--tokenizer", tokenizer.path),
            f"{out} already exists (a token store written by `burst prepare`)", "pass --force to replace it")
    assert snapshot(out) == finished  # never deleted silently
    done = invoke("prepare", corpus, "--out", out, "--tokenizer", tokenizer.path, "--force")
    assert done.exit_code == 0, done.output
    assert TokenStore(out).num_documents == 14 and leftovers(tmp_path) == []


@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                             (signal.SIGINT, 130, "interrupted by Ctrl-C")])
def test_a_stopped_prepare_removes_its_temporary_and_keeps_the_store_it_was_replacing(
        tmp_path, slow_corpus, corpus, tokenizer, sig, code, said):  # noqa: F811
    out = tmp_path / "store"
    prepare([corpus], out, tokenizer=tokenizer.path, progress=False)
    before = snapshot(out)
    process, staging = start_prepare(slow_corpus, "--out", out, "--tokenizer", tokenizer.path, "--force")
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == code, stderr
    assert said in stderr and "what it had begun to write was removed" in stderr and "Traceback" not in stderr
    assert not staging.exists() and leftovers(tmp_path) == [] and snapshot(out) == before


def test_what_a_killed_prepare_left_is_removed_by_the_next(tmp_path, slow_corpus, corpus, tokenizer):  # noqa: F811
    out = tmp_path / "store"
    process, staging = start_prepare(slow_corpus, "--out", out, "--tokenizer", tokenizer.path)
    stop(process)  # SIGKILL: nothing of its own runs
    process.stderr.close()
    assert staging.is_dir() and leftovers(tmp_path) == [".store.lock", staging.name]
    assert not out.exists()
    done = invoke("prepare", corpus, "--out", out, "--tokenizer", tokenizer.path)
    assert done.exit_code == 0, done.output
    assert leftovers(tmp_path) == [] and TokenStore(out).num_documents == 14


SLOW_CONVERT = """
import sys, time
import models.convert as convert
def slowly(checkpoint, directory, max_shard_bytes):
    (directory / "model.safetensors").write_bytes(b"half")
    time.sleep(120)
convert.TARGET_FORMATS["hf"] = slowly
sys.argv[0] = "burst"
import cli
cli.main()
"""


def test_a_stopped_convert_removes_its_temporary_and_keeps_the_export_it_was_replacing(tmp_path):
    config = ModelConfig.from_name("debug")
    save_model(Transformer(config), config, tmp_path / "model")
    assert invoke("convert-checkpoint", tmp_path / "model", tmp_path / "export", "--to", "burst").exit_code == 0
    before = snapshot(tmp_path / "export")
    process = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, "convert-checkpoint", str(tmp_path / "model"),
                                str(tmp_path / "export"), "--to", "hf", "--force"], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wait_for(lambda: list(tmp_path.glob("export.tmp-*/model.safetensors")), "the conversion to start writing")
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143 and "stopped by SIGTERM" in stderr and "Traceback" not in stderr, stderr
    assert snapshot(tmp_path / "export") == before and leftovers(tmp_path) == []


def test_a_read_only_cache_is_named_with_the_fix(tmp_path, seal):
    (tmp_path / "cache").mkdir()
    with pytest.raises(ValueError) as refused_:
        default_store(seal(tmp_path / "cache"), progress=False)
    message = str(refused_.value)
    assert message.startswith("the default corpus cannot be prepared in the cache: ")
    read_only_said(message, tmp_path / "cache" if os.geteuid() else tmp_path / "cache-read-only")
    assert "set $BURST_CACHE to a writable directory, or pass a token store (--data)" in message


def test_a_second_convert_to_the_same_destination_is_refused_naming_the_first(tmp_path):
    model = tmp_path / "model"
    save_model(Transformer(ModelConfig.from_name("debug")), ModelConfig.from_name("debug"), model)
    holder, said = hold(tmp_path / "export", kind="model")
    try:
        assert said == "held"
        refused(invoke("convert-checkpoint", model, tmp_path / "export", "--to", "hf", "--force"),
                f"{tmp_path / 'export'} is being written by another process", f"pid {holder.pid}")
    finally:
        stop(holder)
    assert not (tmp_path / "export").exists()


# ---- --force and what it may replace ---------------------------------------------------------------------------

def test_convert_force_replaces_only_a_model_directory_burst_wrote(tmp_path, store, corpus, tokenizer):  # noqa: F811
    config = ModelConfig.from_name("debug")
    model = tmp_path / "model"
    save_model(Transformer(config), config, model)
    done = invoke("train", "--model", "debug", "--data", store, "--seq-len", 64, "--steps", 1, "--precision", "fp32",
                  "--out", tmp_path / "run")
    assert done.exit_code == 0, done.output
    (tmp_path / "run" / MARKER).unlink()  # a run as a burst of before markers left it
    with exclusive_writer(tmp_path / "marked-run", "run") as writer:
        writer.claim()
    prepare([corpus], tmp_path / "token-store", tokenizer=tokenizer.path, progress=False)
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / "thesis.tex").write_text("years of work")
    assert invoke("convert-checkpoint", model, tmp_path / "download", "--to", "hf").exit_code == 0
    (tmp_path / "download" / MARKER).unlink()  # as a model downloaded from the Hub is: burst did not write it
    cases = {
        "run": "is a training checkpoint or run directory of `burst train` that burst did not mark as its own",
        "marked-run": "is a training run of `burst train`, not a model directory",
        "token-store": "is a token store written by `burst prepare`, not a model directory",
        "thesis": "is a directory burst did not write (no .burst marker; it holds thesis.tex)",
        "download": "is a Hugging Face LLaMA directory (config.json with model_type 'llama') that burst did not mark",
    }
    for name, message in cases.items():
        before = snapshot(tmp_path / name)
        refused(invoke("convert-checkpoint", model, tmp_path / name, "--to", "hf", "--force"),
                f"{tmp_path / name} already exists and {message}", "so it will not delete", "delete it yourself")
        assert snapshot(tmp_path / name) == before
    assert invoke("convert-checkpoint", model, tmp_path / "export", "--to", "hf").exit_code == 0
    replaced = invoke("convert-checkpoint", model, tmp_path / "export", "--to", "burst", "--force")
    assert replaced.exit_code == 0, replaced.output
    assert (tmp_path / "export" / "config.json").read_text() == (model / "config.json").read_text()
    assert leftovers(tmp_path) == []


# ---- read-only destinations ------------------------------------------------------------------------------------

@pytest.fixture
def seal(tmp_path):
    """seal(directory) -> a path through which `directory` cannot be written: a read-only bind mount as root (who
    ignores permissions), the directory itself with mode 0555 otherwise."""
    mounts, modes = [], []

    def make(directory: Path) -> Path:
        if os.geteuid() != 0:
            modes.append(directory)
            directory.chmod(0o555)
            return directory
        view = directory.with_name(directory.name + "-read-only")
        view.mkdir()
        if subprocess.run(["mount", "--bind", "-o", "ro", str(directory), str(view)], capture_output=True).returncode:
            pytest.skip("running as root (which ignores file permissions) without the right to mount a read-only bind")
        mounts.append(view)
        return view

    yield make
    for view in mounts:
        subprocess.run(["umount", "-l", str(view)], check=True)
    for directory in modes:
        directory.chmod(0o755)


def read_only_said(output: str, where: Path) -> None:
    assert f"{where}: " in output and ("the file system is read-only" in output or "permission denied" in output)


def test_prepare_and_convert_refuse_a_read_only_destination_before_any_work(tmp_path, seal, corpus, tokenizer):  # noqa: F811
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    prepare([corpus], shelf / "store", tokenizer=tokenizer.path, progress=False)
    save_model(Transformer(ModelConfig.from_name("debug")), ModelConfig.from_name("debug"), shelf / "model")
    before = snapshot(shelf)
    sealed = seal(shelf)
    for args in (("prepare", corpus, "--out", sealed / "new", "--tokenizer", tokenizer.path),
                 ("prepare", corpus, "--out", sealed / "store", "--tokenizer", tokenizer.path, "--force"),
                 ("convert-checkpoint", sealed / "model", sealed / "hf", "--to", "hf"),
                 ("convert-checkpoint", sealed / "model", sealed / "model", "--to", "hf", "--force")):
        result = invoke(*args)
        error = one_error_line(refused(result))
        if "holds the source" not in error:
            read_only_said(error, sealed)
    assert snapshot(shelf) == before


def test_eval_refuses_a_read_only_json_destination_before_reading_the_weights(model_for_store, store, seal, tmp_path):  # noqa: F811
    (tmp_path / "results").mkdir()
    sealed = seal(tmp_path / "results")
    result = invoke(*evaluate_args(model_for_store, store, "--json", sealed / "deep" / "eval.json"))
    output = refused(result)
    read_only_said(one_error_line(output), sealed)
    assert "perplexity" not in output and list((tmp_path / "results").iterdir()) == []


# ---- full disks ------------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """small_disk(bytes) -> the mount point of a tmpfs that small (root only: mounting needs it)."""
    mounts = []

    def make(size: int) -> Path:
        disk = tmp_path / f"disk{len(mounts)}"
        disk.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                                               capture_output=True).returncode:
            pytest.skip("a small file system needs root to mount it; the injected disk-full tests cover the rest")
        mounts.append(disk)
        return disk

    yield make
    for disk in mounts:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def one_error_line(output: str) -> str:
    """The command's error: one line (a progress bar may have been drawn above it)."""
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and output.endswith(errors[0] + "\n"), output
    return errors[0]


def disk_full_said(output: str, where: Path, kept: str) -> None:
    error = one_error_line(output)
    assert error.startswith(f"error: {where}: no space left on the device (the disk is full); free space there")
    assert error.endswith(kept), error


def big_corpus(root: Path) -> Path:
    root.mkdir()
    (root / "big.txt").write_text(make_text(random.Random(3), 300_000))  # about 2 MB of text, 1 MB of tokens
    return root


def test_prepare_on_a_full_disk_exits_1_and_keeps_the_store_it_was_replacing(tmp_path, small_disk, corpus,
                                                                              tokenizer):  # noqa: F811
    disk = small_disk(512 * 1024)
    out = disk / "store"
    prepare([corpus], out, tokenizer=tokenizer.path, progress=False)
    before = snapshot(out)
    result = invoke("prepare", big_corpus(tmp_path / "big"), "--out", out, "--tokenizer", tokenizer.path, "--force")
    disk_full_said(refused(result, code=1), out, f"{out} is as it was before")
    assert snapshot(out) == before and leftovers(disk) == []


def test_a_full_disk_injected_during_prepare_exits_1_and_leaves_nothing(tmp_path, corpus, tokenizer, monkeypatch):  # noqa: F811
    def full(self, documents, ends=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(StoreWriter, "append", full)
    out = tmp_path / "store"
    disk_full_said(refused(invoke("prepare", corpus, "--out", out, "--tokenizer", tokenizer.path), code=1), out,
                   f"{out} was not created")
    assert leftovers(tmp_path) == [] and not out.exists()


def test_convert_on_a_full_disk_exits_1_and_keeps_the_export_it_was_replacing(tmp_path, small_disk):
    config = ModelConfig.from_name("debug")  # 2.4 MiB of float32 weights: one export fits, a second beside it not
    save_model(Transformer(config), config, tmp_path / "model")
    disk = small_disk(4 * 2**20)
    assert invoke("convert-checkpoint", tmp_path / "model", disk / "export", "--to", "hf").exit_code == 0
    before = snapshot(disk / "export")
    result = invoke("convert-checkpoint", tmp_path / "model", disk / "export", "--to", "burst", "--force")
    disk_full_said(refused(result, code=1), disk / "export", f"{disk / 'export'} is as it was before")
    assert snapshot(disk / "export") == before and leftovers(disk) == []


def test_a_full_disk_injected_during_convert_exits_1_and_leaves_nothing(tmp_path, monkeypatch):
    config = ModelConfig.from_name("debug")
    save_model(Transformer(config), config, tmp_path / "model")

    def full(tensors, directory, max_shard_bytes):
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("models.convert.write_tensors", full)
    out = tmp_path / "export"
    disk_full_said(refused(invoke("convert-checkpoint", tmp_path / "model", out, "--to", "hf"), code=1), out,
                   f"{out} was not created")
    assert leftovers(tmp_path) == [] and not out.exists()


def test_eval_json_on_a_full_disk_exits_1_keeps_the_old_file_and_prints_the_results(model_for_store, store,
                                                                                    small_disk):  # noqa: F811
    disk = small_disk(64 * 1024)
    report = disk / "eval.json"
    report.write_text("last week's results")
    with open(disk / "filler", "wb", buffering=0) as filler, pytest.raises(OSError, match="No space left"):
        while True:
            filler.write(b"\0" * 4096)
    result = invoke(*evaluate_args(model_for_store, store, "--json", report, "--force"))
    output = refused(result, code=1)
    assert "perplexity" in output  # the tables came first
    disk_full_said(output, report, "the results are the tables printed above")
    assert report.read_text() == "last week's results" and sorted(p.name for p in disk.iterdir()) == \
        ["eval.json", "filler"]



def test_a_source_the_file_system_will_not_read_is_one_line_naming_it_not_corruption(tmp_path, monkeypatch):
    config = ModelConfig.from_name("debug")
    save_model(Transformer(config), config, tmp_path / "model")

    class SafetensorError(Exception):  # what safetensors raises for an unreadable file (root reads anything)
        pass

    def denied(path, framework):
        raise SafetensorError("Error while deserializing header: Permission denied (os error 13)")

    monkeypatch.setattr("models.storage.safe_open", denied)
    error = one_error_line(refused(invoke("convert-checkpoint", tmp_path / "model", tmp_path / "hf", "--to", "hf")))
    weights = tmp_path / "model" / "model.safetensors"
    assert error == f"error: {weights}: permission denied; check the owner and permissions of that path, or choose " \
                    f"another one"
    assert not (tmp_path / "hf").exists()
