"""Asynchronous checkpoints through the real command line: a run saved in the background stops and resumes
to the losses of an uninterrupted run, bit for bit, and the loop waits less than for a synchronous save."""

from tests.test_checkpoint import COMMON, losses, steps_of
from tests.test_train import burst_train, events
from tests.test_train import store as store  # noqa: F401  (the module-scoped token store fixture)


def test_async_saves_stop_and_resume_exactly_and_keep_the_newest(store, tmp_path):
    common = [*COMMON, "--data", store, "--steps", 10, "--cp", 2]
    whole = burst_train(*common, "--out", tmp_path / "whole")
    stopped = burst_train(*common, "--async-checkpoint", "--checkpoint-every", 2, "--stop-after", 7,
                          "--out", tmp_path / "run")
    assert whole.returncode == 0 and stopped.returncode == 0, whole.stderr[-2000:] + stopped.stderr[-2000:]
    assert steps_of(tmp_path / "run") == [6, 7]  # --keep 2 held while saves completed in the background
    report = "".join(stopped.stdout.split())  # the console wraps long paths
    assert f"checkpoint{tmp_path / 'run' / 'checkpoints' / 'step-000007'}" in report, stopped.stdout[-2000:]
    saved = events(tmp_path / "run", "checkpoint_saved")
    assert [row["checkpoint"] for row in saved] == ["step-000002", "step-000004", "step-000006", "step-000007"]
    assert all(0 <= row["blocked_s"] <= row["seconds"] for row in saved)

    resumed = burst_train("--resume", "--out", tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert losses(tmp_path / "run") == losses(tmp_path / "whole")  # all 10 steps, bit for bit
    assert steps_of(tmp_path / "run") == [8, 10]
