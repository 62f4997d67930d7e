"""How a run ends early: a graceful stop on SIGTERM (preemption, a job's time limit) and SIGINT (Ctrl-C), and
TrainingStopped, a run that cannot go on (the launcher reports both without importing the training loop).

The handler only records the request; the training loop reads it between steps, agrees on it with
every rank (one may have been signalled, another not yet), finishes the step, saves a checkpoint
and raises TrainingInterrupted. Further signals are recorded too: the save must not be cut short by a
second Ctrl-C (a kill during the save is safe anyway: the previous checkpoint stays intact).

`burst train` then exits 128 + the signal's number, as a shell does for a process a signal ended:
130 after SIGINT, 143 after SIGTERM. So `&&` chains and job schedulers do not take an interrupted
run for a finished one (exit 0), nor for a failed one (exit 1).
"""

from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingInterrupted(Exception):
    """Training stopped early on a signal, its checkpoint saved; `exit_code` is 128 + the signal's number."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name}")
        self.signal_name = signal_name
        self.exit_code = 128 + signal.Signals[signal_name].value


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. the loss keeps being non-finite); the message says why and what to try."""


class StopRequest:
    """Context manager: while inside, SIGTERM and SIGINT set `signal_name` instead of ending the process."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> StopRequest:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
