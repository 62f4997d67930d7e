"""A run directory is sacred: a resume reads and verifies, never rewrites what identifies the run; ranks agree
on every setting; a checkpoint is complete only with every rank's files; damaged history, state or starting
weights are refused or recovered, never trained on silently; the summary reports a loss one can trust."""

import contextlib
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from checkpoints.training import complete_checkpoints
from cli import app
from data import TokenStore, prepare
from models import ModelConfig, Transformer, save_model
from tests.fixtures import burst_train, events, make_text, metrics
from tests.test_checkpoint import COMMON, losses
from tests.test_output_faults import one_error_line
from tests.test_output_faults import seal as seal  # noqa: F401  (fixtures)
from tests.test_output_faults import small_disk as small_disk  # noqa: F401
from trainer.saving import CheckpointSaver

REPO = Path(__file__).parents[1]


def snapshot(directory: Path) -> list[tuple]:
    """Every file's path, size and modification time: what a refused command must leave as it was."""
    return sorted((p.relative_to(directory), p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*"))


@pytest.fixture(scope="module")
def stopped_run_template(store, tmp_path_factory) -> Path:
    """A run of 4 steps stopped after step 2, its checkpoint saved: trained once for the module."""
    out = tmp_path_factory.mktemp("template") / "run"
    done = burst_train(*COMMON, "--data", store, "--steps", 4, "--stop-after", 2, "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture
def stopped_run(stopped_run_template, tmp_path) -> Path:
    """The stopped run, a copy of its own for each test (a resume takes the directory as --out)."""
    return Path(shutil.copytree(stopped_run_template, tmp_path / "run", symlinks=True))


def resume(out: Path, *flags) -> "CliRunner.invoke":
    return CliRunner().invoke(app, ["train", "--resume", "--out", str(out), *map(str, flags)])


def test_a_resume_on_data_of_another_tokenizer_is_refused_and_changes_nothing(stopped_run, store, tmp_path):
    """It used to train on with exit 0 and overwrite the run's tokenizer.model with the new one."""
    corpus = tmp_path / "other-docs"
    corpus.mkdir()
    rng = random.Random(99)
    for i in range(20):
        (corpus / f"d{i}.py").write_text(make_text(rng, 80))
    moved = tmp_path / "store-before"
    shutil.move(store, moved)
    try:
        prepare([corpus], store, vocab_size=320, progress=False)  # the same size, another tokenizer
        before = snapshot(stopped_run)
        result = resume(stopped_run)
        assert result.exit_code == 2, result.output
        assert "was prepared with another tokenizer than the model" in " ".join(result.output.split())
        assert snapshot(stopped_run) == before
    finally:
        shutil.rmtree(store, ignore_errors=True)
        shutil.move(moved, store)


def test_a_resume_on_the_same_rows_prepared_again_in_another_order_is_refused(stopped_run, store, tmp_path):
    """Same tokenizer, same counts, other data: it used to continue on it, compared by counts only."""
    rng = random.Random(0)  # the store fixture's documents, written again in another order
    texts = [make_text(rng, rng.randint(20, 200)) for _ in range(30)]
    corpus = tmp_path / "shuffled"
    corpus.mkdir()
    for i, text in enumerate(reversed(texts)):
        (corpus / f"doc{i}.py").write_text(text)
    moved = tmp_path / "store-before"
    shutil.move(store, moved)
    try:
        prepare([corpus], store, tokenizer=moved / "tokenizer.model", val_fraction=0.05, progress=False)
        again, trained = TokenStore(store), TokenStore(moved)
        assert (again.num_documents, again.num_tokens) == (trained.num_documents, trained.num_tokens)
        assert again.content_digest != trained.content_digest
        before = snapshot(stopped_run)
        result = resume(stopped_run)
        assert result.exit_code == 2, result.output
        assert "holds other data than the run trained on: its content digest is not the one step-000002 recorded" \
            in " ".join(result.output.split()), result.output
        assert snapshot(stopped_run) == before
    finally:
        shutil.rmtree(store, ignore_errors=True)
        shutil.move(moved, store)


def test_a_hand_edited_config_is_refused_on_resume(stopped_run):
    path = stopped_run / "config.toml"
    path.write_text(path.read_text().replace("seq_len = 256", "seq_len = 512"))
    before = snapshot(stopped_run)
    result = resume(stopped_run)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "no longer describes the run its checkpoint step-000002 trained: seq_len 512 there, 256 in the" in text
    assert snapshot(stopped_run) == before


def test_a_torn_last_line_of_the_metrics_is_dropped_and_damage_elsewhere_is_refused(stopped_run):
    path = stopped_run / "metrics.jsonl"
    whole = path.read_text()
    path.write_text(whole + '{"step": 3, "loss": 5.1, "lr"')  # killed while writing step 3's line
    done = resume(stopped_run)
    assert done.exit_code == 0, done.output
    assert sorted(losses(stopped_run)) == [1, 2, 3, 4]
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + ["{not json"] + lines[1:]) + "\n")
    result = CliRunner().invoke(app, ["train", "--resume", "--out", str(stopped_run), "--steps", "4"])
    assert result.exit_code == 2
    assert "metrics.jsonl line 2 is not a JSON object" in " ".join(result.output.split())


def test_a_damaged_train_state_is_refused_naming_the_checkpoint(stopped_run):
    newest = complete_checkpoints(stopped_run)[-1]
    state = json.loads((newest / "train_state.json").read_text())
    (newest / "train_state.json").write_text(json.dumps({**state, "train": {**state["train"], "step": "two"}}))
    result = resume(stopped_run)
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "train_state.json holds no valid step" in text and "resume from an earlier one" in text
    (newest / "train_state.json").write_text('{"train": ')
    assert "train_state.json or COMPLETE cannot be read" in " ".join(resume(stopped_run).output.split())


def test_a_starting_checkpoint_with_a_nan_is_refused_not_blamed_on_the_learning_rate(store, tmp_path):
    config = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=320)  # the store's vocabulary
    model = Transformer(config)
    with torch.no_grad():
        model.layers[1].feed_forward.w2.weight[3, 4] = float("nan")
    save_model(model, config, tmp_path / "model")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--model", str(tmp_path / "model"), "--data", str(store),
                                      "--seq-len", "128", "--steps", "3", "--out", str(out)])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "hold non-finite values (nan or inf) in layers.1.feed_forward.w2.weight (1 tensors)" in text
    assert "--lr" not in text and not out.exists()


def test_a_checkpoint_is_completed_only_with_every_ranks_files(tmp_path):
    """Ranks writing to directories that are not one shared directory leave rank 0 without the others' files."""
    config = ModelConfig.from_name("debug")
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters())
    reported = []
    saver = CheckpointSaver(tmp_path, config, torch.device("cpu"), keep=2, asynchronous=False, group=None,
                            on_saved=reported.append)
    saver.world_size = 2  # as if rank 1 wrote its files elsewhere
    saver.start(5, model, optimizer, {"train": {"step": 5, "tokens": 0, "bad_steps": 0}, "schedule": {},
                                      "loader": {}})
    assert saver.failure is not None and "rank 1's rng-00001.json is missing" in saver.failure
    assert "the same --out, on a file system all nodes share" in saver.failure
    assert complete_checkpoints(tmp_path) == [] and reported == []
    saver.world_size = 1
    saver.start(6, model, optimizer, {"train": {"step": 6, "tokens": 0, "bad_steps": 0}, "schedule": {},
                                      "loader": {}})
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000006"]


def test_ranks_started_with_different_settings_are_refused_before_any_work(store, tmp_path):
    """Under torchrun each node parses its own command line: another --seed trained on silently before."""
    script = tmp_path / "rank_seed.py"
    script.write_text("import os, sys\nfrom cli import main\n"
                      "sys.argv += ['--seed', os.environ['LOCAL_RANK']]\nmain()\n")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           str(script), "train", "--model", "debug", "--data", str(store), "--seq-len", "128",
                           "--steps", "2", "--cp", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert done.returncode != 0 and time.perf_counter() - started < 200
    assert "the ranks were started with different settings: --seed: rank 0 0, rank 1 1" in done.stderr
    assert not (out / "checkpoints").exists()


def test_the_summary_and_metrics_report_the_validation_loss_at_the_start_and_the_end(store, tmp_path):
    out = tmp_path / "run"
    done = burst_train(*COMMON, "--data", store, "--steps", 6, "--val-tokens", 3 * 256, "--val-every", 3,
                       "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = events(out, "validation")
    assert [r["at_step"] for r in rows] == [0, 3, 6] and all(r["sequences"] == 3 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    summary = " ".join(done.stdout.split())
    assert f"validation loss {rows[0]['loss']:.4f} (step 0) -> {rows[-1]['loss']:.4f} (step 6) over " \
           f"{rows[-1]['held_out_tokens']:,} held-out tokens" in summary
    assert "training loss" in summary and "(mean of the last 6 steps)" in summary
    assert len(metrics(out)) == 6  # validation rows are events, not steps


# ---- one writer; nothing written over that burst did not write; read-only and full disks ------------------------

def test_a_second_writer_and_a_resume_of_a_running_run_are_refused_naming_the_holder(store, tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "cli", "train", *map(str, COMMON), "--data", str(store),
                              "--steps", "400", "--out", str(out)], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").is_file() or not metrics(out):
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.poll() else ""
            time.sleep(0.2)
        for args in (["train", *map(str, COMMON), "--data", str(store), "--steps", "4", "--out", str(out)],
                     ["train", "--resume", "--out", str(out)]):
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 2, result.output
            text = " ".join(result.output.split())
            assert f"{out} is being written by another process (pid {first.pid} on" in text, text
            assert "--steps 400" in text and "Traceback" not in text
        assert first.poll() is None  # the run itself goes on
    finally:
        first.terminate()
        first.wait(timeout=120)
    assert first.returncode == 143 and complete_checkpoints(out)  # it saved as it stopped


def descendants(pid: int) -> set[int]:
    """The processes `pid` started and theirs (Linux's /proc): its workers, forked by its forkserver
    (runtime/launch.py), with the server itself."""
    found = set()
    with contextlib.suppress(OSError):  # a process that just ended
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found.update(map(int, (task / "children").read_text().split()))
    for child in list(found):
        found |= descendants(child)
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the workers through Linux's /proc")
def test_workers_die_with_a_launcher_killed_outright_so_a_resume_is_the_only_writer(store, tmp_path):
    """kill -9 of the launcher used to free the run's lock while its workers went on: torch's launcher has them
    sent SIGINT when it dies, so they finished their step and saved a checkpoint, outside any lock: a --resume let
    in meanwhile was a second writer (metrics.jsonl logged steps twice). Now they die with it, writing nothing."""
    out = tmp_path / "run"
    done = burst_train(*COMMON, "--data", store, "--steps", 400, "--stop-after", 2, "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    launcher = subprocess.Popen([sys.executable, "-m", "cli", "train", "--resume", "--out", str(out), "--cp", "2",
                                 "--checkpoint-every", "1000"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while max(losses(out)) < 3:  # the workers are training
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read()
            time.sleep(0.1)
        workers = descendants(launcher.pid)
        assert len([pid for pid in workers if alive(pid)]) >= 3, workers  # two ranks and their server
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers), "the workers outlived their launcher"
    assert [p.name for p in complete_checkpoints(out)] == ["step-000002"]  # they saved nothing after it
    done = resume(out, "--stop-after", 4)
    assert done.exit_code == 0, done.output
    assert max(losses(out)) == 4  # and each step logged once


def test_a_new_run_never_writes_over_files_burst_did_not_write(store, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.toml").write_text("# my own settings, not burst's\n")
    result = CliRunner().invoke(app, ["train", *map(str, COMMON), "--data", str(store), "--steps", "3",
                                      "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "already exists and is a directory burst did not write" in " ".join(result.output.split())
    assert (out / "config.toml").read_text() == "# my own settings, not burst's\n" and len(list(out.iterdir())) == 1


def test_a_read_only_run_directory_is_refused_before_any_work(store, tmp_path, seal):
    (tmp_path / "shelf").mkdir()
    sealed = seal(tmp_path / "shelf")
    result = CliRunner().invoke(app, ["train", *map(str, COMMON), "--data", str(store), "--steps", "3",
                                      "--out", str(sealed / "run")])
    assert result.exit_code == 2, result.output
    error = one_error_line(result.output)
    assert f"{sealed}: " in error and ("read-only" in error or "permission denied" in error)
    assert list((tmp_path / "shelf").iterdir()) == []


def test_a_full_disk_during_a_save_ends_the_run_in_one_line_and_keeps_the_previous_checkpoint(store, tmp_path,
                                                                                            small_disk):
    disk = small_disk(3 * 2**20)  # room for the run and one checkpoint, not two (--keep 2)
    out = disk / "run"
    done = burst_train(*COMMON, "--data", store, "--steps", 8, "--checkpoint-every", 2, "--out", out)
    assert done.returncode == 1, done.stderr[-3000:]
    error = one_error_line(done.stderr)
    assert "failed: " in error and "no space left on the device (the disk is full)" in error, error
    assert "is intact; continue with `burst train --resume" in error
    kept = complete_checkpoints(out)
    assert kept and not list((out / "checkpoints").glob("*.tmp-*"))  # the failed save's files are gone
    assert f"The newest complete checkpoint, {kept[-1]}, is intact" in error
