"""Asynchronous checkpoints through the real command line: a run saved in the background stops and resumes
to the losses of an uninterrupted run, bit for bit, and the loop waits less than for a synchronous save."""

import hashlib
import subprocess
import sys
from pathlib import Path

from tests.fixtures import burst_train, events
from tests.test_checkpoint import UNINTERRUPTED, losses, steps_of


def test_async_saves_stop_and_resume_exactly_and_keep_the_newest(store, uninterrupted, tmp_path):
    whole = uninterrupted(store, *UNINTERRUPTED)  # 12 steps at cp 2
    stopped = burst_train(*UNINTERRUPTED, "--data", store, "--async-checkpoint", "--checkpoint-every", 2,
                          "--stop-after", 7, "--out", tmp_path / "run")
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert steps_of(tmp_path / "run") == [6, 7]  # --keep 2 held while saves completed in the background
    report = "".join(stopped.stdout.split())  # the console wraps long paths
    assert f"checkpoint{tmp_path / 'run' / 'checkpoints' / 'step-000007'}" in report, stopped.stdout[-2000:]
    saved = events(tmp_path / "run", "checkpoint_saved")
    assert [row["checkpoint"] for row in saved] == ["step-000002", "step-000004", "step-000006", "step-000007"]
    assert all(0 <= row["blocked_s"] <= row["seconds"] for row in saved)

    resumed = burst_train("--resume", "--out", tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert losses(tmp_path / "run") == losses(whole)  # all 12 steps, bit for bit
    assert steps_of(tmp_path / "run") == [10, 12]


def test_a_shard_stream_is_closed_with_its_file_so_nothing_is_reported_when_it_is_collected(tmp_path):
    """Python 3.13 reports what a stream's finaliser raises ("Exception ignored in: <_HashingStream> ...
    ValueError: flush of closed file", after every save); -X dev does so on every Python."""
    script = (
        "import gc\n"
        "from trainer.saving import _HashingFileSystem\n"
        "fs = _HashingFileSystem()\n"
        f"with fs.create_stream({str(tmp_path / 'shard')!r}, 'wb') as stream:\n"
        "    stream.write(b'abc')\n"
        "assert stream.closed\n"
        "del stream\n"
        "gc.collect()\n"
        "print(fs.digests['shard'])\n"
    )
    finished = subprocess.run([sys.executable, "-X", "dev", "-c", script], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "Exception ignored" not in finished.stderr, finished.stderr[-2000:]
    assert finished.stdout.strip() == hashlib.sha256(b"abc").hexdigest()
