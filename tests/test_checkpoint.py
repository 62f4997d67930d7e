"""Training checkpoints through the real command line: exact resume, resharding, kills during a save,
SIGTERM, conversion and evaluation of a run, and refusals of partial, damaged or mismatched checkpoints."""

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from checkpoints import read_checkpoint
from checkpoints.training import MARKER, complete_checkpoints
from cli import app
from data import TokenStore, load_tokenizer
from models import ModelConfig, Transformer, load_model
from tests.fixtures import burst_train, burst_train_together, metrics, relative_gap

COMMON = ["--model", "debug", "--seq-len", 256, "--lr", 0.01, "--warmup", 2, "--precision", "fp32"]
# The uninterrupted run a stopped (here, tests/test_saving.py), killed or restarted (tests/test_elastic.py) run must
# reproduce: the `uninterrupted` fixture trains it once for the three files
UNINTERRUPTED = [*COMMON, "--steps", 12, "--cp", 2]
REPO = Path(__file__).parents[1]


def train_command(*args) -> list[str]:
    return [sys.executable, "-m", "cli", "train", *map(str, args)]


def losses(out: Path) -> dict[int, float]:
    rows = metrics(out)
    assert len({r["step"] for r in rows}) == len(rows), rows  # a resumed run logs each step once
    return {r["step"]: r["loss"] for r in rows}


def steps_of(out: Path) -> list[int]:
    return [int(p.name.removeprefix("step-")) for p in complete_checkpoints(out)]


def test_stop_after_and_resume_reproduce_the_uninterrupted_run_also_on_another_layout(store, uninterrupted,
                                                                                      tmp_path):
    whole = uninterrupted(store, *UNINTERRUPTED)
    stopped = burst_train(*UNINTERRUPTED, "--data", store, "--stop-after", 6, "--checkpoint-every", 2, "--out",
                          tmp_path / "run")
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert steps_of(tmp_path / "run") == [4, 6]  # --keep 2
    assert sorted(losses(tmp_path / "run")) == list(range(1, 7))
    shutil.copytree(tmp_path / "run", tmp_path / "resharded")

    same, other = burst_train_together(["--resume", "--out", tmp_path / "run"],
                                       ["--resume", "--cp", 1, "--out", tmp_path / "resharded"])
    assert same.returncode == 0 and other.returncode == 0, same.stderr[-2000:] + other.stderr[-2000:]
    reference = losses(whole)
    resumed = losses(tmp_path / "run")
    assert [resumed[s] for s in range(7, 13)] == [reference[s] for s in range(7, 13)]  # bit for bit
    assert relative_gap([losses(tmp_path / "resharded")[s] for s in range(7, 13)],
                        [reference[s] for s in range(7, 13)]) <= 1e-3
    assert steps_of(tmp_path / "run") == [10, 12]
    assert "cp = 1" in (tmp_path / "resharded" / "config.toml").read_text()  # the layout it last ran with
    assert "stop_after =" not in (tmp_path / "run" / "config.toml").read_text()


def kill_during_save(command: list[str], out: Path, step: int) -> int:
    """Run `command` and SIGKILL it while the save of `step` is under way (its tmp directory there, no marker yet).

    The process is stopped (SIGSTOP) the moment the tmp directory appears, so the check and the kill see the
    same state; a save that finished before it could be caught lets the run go on to its end (the caller retries).
    Returns the exit status (-SIGKILL when caught); the output is in out.log, beside out.
    """
    with open(out.with_suffix(".log"), "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 240
        while process.poll() is None and time.monotonic() < deadline:
            saving = list((out / "checkpoints").glob(f"step-{step:06d}.tmp-*"))
            if saving:
                process.send_signal(signal.SIGSTOP)
                if saving[0].is_dir() and not (saving[0] / MARKER).exists():
                    process.kill()
                    return process.wait()
                process.send_signal(signal.SIGCONT)
                break
            time.sleep(0.001)
        return process.wait(timeout=240)


@pytest.mark.parametrize("flags", [[], ["--async-checkpoint"]])
def test_a_kill_during_a_save_keeps_the_previous_checkpoint_which_resumes(store, tmp_path, flags):
    for attempt in range(5):  # a save that ends between two looks is not caught: run again
        out = tmp_path / f"run{attempt}"
        killed = kill_during_save(train_command(*COMMON, *flags, "--data", store, "--steps", 6,
                                                "--checkpoint-every", 2, "--out", out), out, step=4)
        if killed == -signal.SIGKILL:
            break
    assert killed == -signal.SIGKILL, out.with_suffix(".log").read_text()[-2000:]
    assert steps_of(out) == [2]
    interrupted = list((out / "checkpoints").glob("step-000004.tmp-*"))
    assert len(interrupted) == 1 and not (interrupted[0] / MARKER).exists()
    assert read_checkpoint(out).config.dim == ModelConfig.from_name("debug").dim  # loads in one process

    resumed = burst_train("--resume", "--out", out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "(step 2)" in " ".join(resumed.stdout.split())
    assert sorted(losses(out)) == list(range(1, 7))  # steps 3-4, logged before the kill, trained and logged anew
    assert steps_of(out) == [4, 6] and not list((out / "checkpoints").glob("*.tmp-*"))


@pytest.mark.parametrize("sent, exit_code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_finishes_the_step_saves_and_exits_128_plus_its_number(store, tmp_path, sent, exit_code):
    """Not 0: a scheduler or an `&&` chain must not take an interrupted run for a finished one."""
    out = tmp_path / "run"
    process = subprocess.Popen(train_command(*COMMON, "--data", store, "--steps", 1000, "--out", out),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").is_file() and len(metrics(out)) >= 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    process.send_signal(sent)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == exit_code, stderr[-2000:]
    assert "Traceback" not in stderr
    last = max(losses(out))
    assert 2 <= last < 1000 and steps_of(out) == [last]
    assert f"stopped by {sent.name}" in stdout and "--resume" in stdout
    if sent == signal.SIGINT:
        return

    resumed = burst_train("--resume", "--stop-after", last + 2, "--out", out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sorted(losses(out)) == list(range(1, last + 3)) and steps_of(out) == [last, last + 2]


@pytest.fixture(scope="module")
def run(store, tmp_path_factory) -> Path:
    """A run of 4 steps, stopped after step 3: checkpoints at steps 2 and 3."""
    out = tmp_path_factory.mktemp("trained") / "run"
    done = burst_train(*COMMON, "--data", store, "--steps", 4, "--stop-after", 3, "--checkpoint-every", 2,
                       "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def reference_model(checkpoint: Path) -> Transformer:
    """The trained weights read straight from the DCP files into a fresh model (not through burst's reader)."""
    model = Transformer(ModelConfig.from_dict(json.loads((checkpoint / "config.json").read_text())))
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    model.load_state_dict(state["model"])
    return model.eval()


def test_convert_a_run_to_native_and_hugging_face_and_evaluate_it(run, store, tmp_path):
    native, hf, back = tmp_path / "native", tmp_path / "hf", tmp_path / "back"
    for src, dst, to in ((run, native, "burst"), (run / "checkpoints" / "step-000002", hf, "hf"),
                         (hf, back, "burst")):
        result = CliRunner().invoke(app, ["convert-checkpoint", str(src), str(dst), "--to", to])
        assert result.exit_code == 0, result.output
    tokens = torch.randint(0, 320, (1, 64))
    with torch.no_grad():
        assert torch.equal(load_model(native)(tokens), reference_model(run / "checkpoints" / "step-000003")(tokens))
        assert torch.equal(load_model(back)(tokens), reference_model(run / "checkpoints" / "step-000002")(tokens))
    assert json.loads((hf / "config.json").read_text())["model_type"] == "llama"

    report = tmp_path / "eval.json"
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(run), "--data", str(store), "--seq-len", "128",
                                      "--batches", "2", "--buckets", "2", "--passkey-trials", "0",
                                      "--json", str(report)])
    assert result.exit_code == 0, result.output
    figures = json.loads(report.read_text())
    assert figures["perplexity"] > 1 and len(figures["loss_by_position"]) == 2 and "passkey" in figures


def test_exports_carry_the_run_tokenizer_and_the_hugging_face_one_loads_and_encodes_like_training(run, store,
                                                                                                   tmp_path):
    transformers = pytest.importorskip("transformers")
    store_tokenizer = TokenStore(store).tokenizer()
    assert load_tokenizer(run).fingerprint == store_tokenizer.fingerprint
    native, hf = tmp_path / "native", tmp_path / "hf"
    for src, dst, to in ((run, native, "burst"), (run / "checkpoints" / "step-000002", hf, "hf")):
        result = CliRunner().invoke(app, ["convert-checkpoint", str(src), str(dst), "--to", to])
        assert result.exit_code == 0, result.output
    assert load_tokenizer(native / "tokenizer.model").fingerprint == store_tokenizer.fingerprint
    assert load_tokenizer(hf / "tokenizer.model").fingerprint == store_tokenizer.fingerprint
    loaded = transformers.AutoTokenizer.from_pretrained(hf)
    for text in ["def f(x):\n    return  self.ring(0) + 1\n", "  über 数据 🙂\t", "", (REPO / "cli.py").read_text(),
                 "re.compile(r'(?P<s>x)</s><unk>')"]:  # literal specials: plain text, as to SentencePiece
        ids = loaded(text)["input_ids"]
        assert ids == [store_tokenizer.bos_id] + store_tokenizer.encode(text)  # BOS first, as training packs it
        assert loaded.decode(ids, skip_special_tokens=True) == text


def damage(run: Path, tmp_path: Path, case: str) -> tuple[Path, list[str]]:
    """A copy of `run` damaged as `case`, and the `burst train` arguments that try to resume it."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    newest = out / "checkpoints" / "step-000003"
    args = ["train", "--resume", "--out", str(out)]
    if case == "no checkpoint":
        shutil.rmtree(out / "checkpoints")
    elif case == "missing shard":
        (newest / "__0_0.distcp").unlink()
    elif case == "truncated shard":
        with open(newest / "__0_0.distcp", "r+b") as f:
            f.truncate(1000)
    elif case == "overwritten shard":  # the size unchanged: this used to load, and train on from a loss of 68
        shard = newest / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 64] = bytes(255 - b for b in data[middle:middle + 64])
        shard.write_bytes(bytes(data))
    elif case == "other model":
        config = json.loads((newest / "config.json").read_text())
        (newest / "config.json").write_text(json.dumps({**config, "dim": 128}))
        complete = json.loads((newest / MARKER).read_text())  # as its save would have recorded it
        complete["sha256"]["config.json"] = hashlib.sha256((newest / "config.json").read_bytes()).hexdigest()
        (newest / MARKER).write_text(json.dumps(complete))
    elif case == "other schedule":
        args += ["--steps", "3"]  # a larger --steps extends the run (test_bad_input); a smaller one is refused
    elif case == "other batch":
        args += ["--batch-size", "2"]
    return out, args


@pytest.mark.parametrize("case, expected", [
    ("no checkpoint", "holds no complete checkpoint"),
    ("missing shard", "the shard file __0_0.distcp is missing"),
    ("truncated shard", "the shard file __0_0.distcp has 1000 bytes"),
    ("overwritten shard", "step-000003 is damaged: __0_0.distcp does not match the SHA-256 its save recorded (its "
                          "bytes changed since); resume from the checkpoint before it, "),
    ("other model", "holds another model than this run's: dim 128 in the checkpoint, 64 in the run"),
    ("other schedule", "--steps 3: the run has 4 steps and cannot be shortened"),
    ("other batch", "changes the run's 1 sequences per step"),
])
def test_resume_refuses_what_it_cannot_continue_exactly_and_changes_nothing(run, tmp_path, case, expected):
    out, args = damage(run, tmp_path, case)
    before = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*"))
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split()), result.output
    assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*")) == before


def test_a_damaged_checkpoint_is_refused_by_every_reader_in_one_line_naming_the_one_before_it(run, tmp_path):
    out, _ = damage(run, tmp_path, "overwritten shard")
    complete = json.loads((out / "checkpoints" / "step-000003" / MARKER).read_text())
    assert set(complete["sha256"]) == {p.name for p in (out / "checkpoints" / "step-000003").iterdir()} - {MARKER}
    for args in (["convert-checkpoint", str(out), str(tmp_path / "x"), "--to", "burst"],
                 ["eval", "--checkpoint", str(out), "--seq-len", "128", "--batches", "1"]):
        result = CliRunner().invoke(app, args)
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and "__0_0.distcp does not match the SHA-256" in text, result.output
        assert f"resume from the checkpoint before it, {out / 'checkpoints' / 'step-000002'}" in text
        assert "Traceback" not in text
    assert not (tmp_path / "x").exists()


def test_a_checkpoint_of_an_older_burst_without_checksums_still_resumes_and_says_so(run, tmp_path):
    out, _ = damage(run, tmp_path, "none")
    (out / "checkpoints" / "step-000003" / MARKER).write_text(json.dumps({"step": 3}))
    resumed = burst_train("--resume", "--out", out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stderr.count("records no checksums (saved by an older burst)") == 1, resumed.stderr
    assert sorted(losses(out)) == [1, 2, 3, 4]


def test_a_checkpoint_without_its_marker_is_refused_and_a_run_falls_back_to_the_previous_one(run, tmp_path):
    out, _ = damage(run, tmp_path, "none")
    (out / "checkpoints" / "step-000003" / MARKER).unlink()
    result = CliRunner().invoke(app, ["convert-checkpoint", str(out / "checkpoints" / "step-000003"),
                                      str(tmp_path / "x"), "--to", "burst"])
    assert result.exit_code == 2 and "no COMPLETE marker: its save did not finish" in " ".join(result.output.split())
    assert not (tmp_path / "x").exists()
    assert steps_of(out) == [2] and read_checkpoint(out).config.dim == 64
