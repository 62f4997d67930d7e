"""The planner: what a run needs per rank and how fast it goes, from its shape (planner/shape.py), the model's
footprint (models/footprint.py) and the hardware (planner/hardware.py: this machine, or the GPU table).

Below trainer/ and evaluation/: `burst plan` (trainer/plan.py), `burst train`'s preflight and `burst eval` call it;
so does scripts/gpu_benchmark.py, for its one FLOP count and peak rate.

    shape.py        RunShape: the dozen settings memory and time depend on
    hardware.py     the GPU table, this machine's memory and measured CPU rate
    calibration.py  the constants no shape gives: one record per machine (shipped, or `burst plan --calibrate`'s)
    calibrate.py    fitting the constants to measured steps (benchmarks/plan_calibration.py, `--calibrate`)
    memory.py       peak memory of one rank, by part
    attention.py    one sequence's plan of kernel calls, and its documents
    time.py         step time by part, and the model FLOPs of a step (MFU's numerator)
    estimate.py     Estimate: memory, time, MFU together
    search.py       the settings that fit, and the longest sequence
    fit.py          the fit check train and eval refuse by
"""

from planner.estimate import Estimate, estimate, fits, memory_estimate, mfu
from planner.shape import RunShape

__all__ = ["Estimate", "RunShape", "estimate", "fits", "memory_estimate", "mfu"]
