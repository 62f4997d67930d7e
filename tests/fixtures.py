"""What test files share: the small token store most runs train on, `burst train` as a process of its own (one, or
several at once), and readers of a run's metrics.jsonl. tests/conftest.py registers the fixtures here, so a test
asks for `store` by name; the helpers are imported (`from tests.fixtures import burst_train`).
"""

import atexit
import contextlib
import fcntl
import functools
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import sentencepiece

from data import prepare

REPO = Path(__file__).parents[1]
WORDS = ["def", "return", "self", "import", "tensor", "rank", "shard", "ring", "(", ")", ":", "=", "+", "0", "1"]


def make_text(rng: random.Random, lines: int) -> str:
    """Code-like lines from a small vocabulary of words: structure a model learns within a few steps."""
    return "\n".join(" " * rng.choice([0, 4, 8]) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))
                     for _ in range(lines)) + "\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for i in range(30):
        (root / f"doc{i}.py").write_text(make_text(rng, rng.randint(20, 200)))
    out = tmp_path_factory.mktemp("store")  # unique: test_checkpoint builds this fixture again
    prepare([root], out, vocab_size=320, val_fraction=0.05, progress=False)
    return out


def store_identity(store: Path) -> str:
    """A digest of what a run's losses depend on in a store: its token ids, documents, split, settings and
    vocabulary. Not the corpus's path (metadata.json's "inputs"), nor the tokenizer file's bytes (and the digests of
    them), which hold the path sentencepiece trained from: these differ for each module's `store`."""
    digest = hashlib.sha256()
    for path in sorted(path for path in store.iterdir() if path.is_file() and path.name != "tokenizer.model"):
        if path.name == "metadata.json":
            content = json.loads(path.read_text())
            content.pop("inputs", None)
            for key in ("files", "digest", "fingerprint"):
                content["tokenizer"].pop(key, None)
            data = json.dumps(content, sort_keys=True).encode()
        else:
            data = path.read_bytes()
        digest.update(f"{path.name}:{len(data)}:".encode() + data)
    vocabulary = sentencepiece.SentencePieceProcessor(model_file=str(store / "tokenizer.model"))
    digest.update(json.dumps([(vocabulary.id_to_piece(i), vocabulary.get_score(i))
                              for i in range(vocabulary.get_piece_size())]).encode())
    return digest.hexdigest()


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """`uninterrupted(store, *args)`: the run directory of `burst train ARGS --data STORE`, trained once per session
    for each store content and ARGS. The run that tests/test_checkpoint.py, test_elastic.py and test_saving.py each
    compare a stopped, killed or resumed run with is one run (each module builds `store` alike, byte for byte), so
    it is trained once, not three times: also when those modules run on different workers of one session
    (pytest-xdist), which share the run through the session's temporary root, the first to ask training it under a
    lock while the others wait."""

    def run(store: Path, *args: object) -> Path:
        key = hashlib.sha256(json.dumps([store_identity(store), list(map(str, args))]).encode()).hexdigest()[:16]
        out = session_root(tmp_path_factory) / f"uninterrupted-{key}"
        with locked(out.with_suffix(".lock")):
            if not (out / "trained").is_file():
                shutil.rmtree(out, ignore_errors=True)  # what a worker that failed here left
                done = burst_train(*args, "--data", store, "--out", out / "run")
                assert done.returncode == 0, done.stderr[-2000:]
                (out / "trained").touch()
        return out / "run"

    return run


def session_root(tmp_path_factory) -> Path:
    """The temporary directory every worker of this session shares: the parent of a pytest-xdist worker's own
    (`.../pytest-N/popen-gw0`), the session's own where it runs in one process."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def locked(path: Path):
    """Holds an exclusive lock on `path` (created if missing): one process at a time in the block."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def burst_train(*args: object, timeout: float = 240) -> subprocess.CompletedProcess:
    return burst_train_together(args, timeout=timeout)[0]


def burst_train_together(*runs: Sequence[object], timeout: float = 240,
                         cores: Sequence[set[int]] | None = None) -> list[subprocess.CompletedProcess]:
    """Independent `burst train` invocations run at once, their results in order: most of a small run is start-up
    (imports, spawning ranks), which overlaps well, so the suite waits less.

    Each is a process of its own, as `python -m cli train ARGS` from the repository would be, but forked from the
    server the rank pools fork from (tests/distributed.py), which imported torch and the project once: a fresh
    interpreter spent about 2.5 CPU s importing them again, for some 60 runs in the suite. The process begins as
    that command's would: the caller's environment and the repository as working directory, its own stdout and
    stderr, argv, exit code (a signal's negative number) and exit handlers. BURST_TEST_SPAWN_COMMANDS=1 runs the
    command itself instead (to compare, or to rule this out). `cores`: the cores each run (and its ranks) may use.
    """
    cores = list(cores) if cores is not None else [None] * len(runs)
    if os.environ.get("BURST_TEST_SPAWN_COMMANDS") == "1":
        return _spawned_together(runs, timeout, cores)
    from tests.distributed import start_forkserver

    start_forkserver()  # running already in a pytest process (conftest): then this does nothing
    context = multiprocessing.get_context("forkserver")
    started = []
    for args, allowed in zip(runs, cores, strict=True):
        argv = ["train", *map(str, args)]
        out, err = tempfile.NamedTemporaryFile("w+", delete=False), tempfile.NamedTemporaryFile("w+", delete=False)
        process = context.Process(target=_command_in_this_process, args=(argv, out.name, err.name, dict(os.environ),
                                                                         allowed))
        process.start()
        started.append((argv, process, out, err))
    deadline, results = time.monotonic() + timeout, []
    try:
        for argv, process, out, err in started:
            process.join(timeout=max(deadline - time.monotonic(), 0.1))
            if process.exitcode is None:
                raise subprocess.TimeoutExpired([sys.executable, "-m", "cli", *argv], timeout)
            results.append(subprocess.CompletedProcess([sys.executable, "-m", "cli", *argv], process.exitcode,
                                                       Path(out.name).read_text(), Path(err.name).read_text()))
    finally:
        for _, process, out, err in started:
            if process.exitcode is None:
                process.kill()
                process.join()
            for handle in (out, err):
                handle.close()
                os.unlink(handle.name)
    return results


def _command_in_this_process(argv: list[str], stdout: str, stderr: str, environment: dict[str, str],
                             cores: set[int] | None) -> None:
    """`python -m cli ARGV` in a process forked from the server (see burst_train_together): the caller's
    environment, the repository as working directory, stdout and stderr into the given files. The process's exit
    code is the command's (typer's SystemExit)."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(REPO)
    for fd, path in ((1, stdout), (2, stderr)):
        handle = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    sys.argv = [str(REPO / "cli.py"), *argv]
    from cli import app

    try:
        app(args=argv, prog_name="python -m cli")
    finally:
        atexit._run_exitfuncs()  # as the interpreter would on its way out; the forked process skips them
        sys.stdout.flush()
        sys.stderr.flush()


def _spawned_together(runs: Sequence[Sequence[object]], timeout: float, cores: list[set[int] | None]
                      ) -> list[subprocess.CompletedProcess]:
    started = []
    for args, allowed in zip(runs, cores, strict=True):
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # files: a full pipe would stall
        command = [sys.executable, "-m", "cli", "train", *map(str, args)]
        pin = None if allowed is None else functools.partial(os.sched_setaffinity, 0, allowed)
        started.append((subprocess.Popen(command, stdout=out, stderr=err, text=True, cwd=REPO, preexec_fn=pin),
                        out, err))
    deadline, results = time.monotonic() + timeout, []
    try:
        for process, out, err in started:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read()))
    finally:
        for process, out, err in started:
            if process.poll() is None:
                process.kill()
                process.wait()
            out.close()
            err.close()
    return results


def metrics(out: Path) -> list[dict]:
    """The step rows of OUT/metrics.jsonl."""
    return [row for row in events(out, None) if "step" in row]


def events(out: Path, name: str | None) -> list[dict]:
    """The event rows named `name` of OUT/metrics.jsonl (None: every row)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if name is None or row.get("event") == name]


def relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
