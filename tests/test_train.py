"""`burst train` through the real command line: cp and dp runs against one process, refusals before any work."""

import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import burst
from burst.layout import zigzag_layout
from cli import app
from data import SequenceLoader, TokenStore, train_tokenizer
from models import ModelConfig, Transformer, save_model
from tests.fixtures import burst_train, burst_train_together, make_text, metrics, relative_gap


def test_cp2_gives_the_loss_curve_of_one_process_and_the_loss_falls(store, tmp_path):
    settings = tmp_path / "run.toml"  # shared settings from a file, the parallel layout from flags
    settings.write_text(f'model = "debug"\ndata = "{store}"\nseq_len = 512\nsteps = 10\nlr = 0.01\nwarmup = 2\n'
                        f'precision = "fp32"\n')
    curves = {}
    for cp in (1, 2):
        out = tmp_path / f"cp{cp}"
        done = burst_train("--config", settings, "--cp", cp, "--out", out)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = metrics(out)
        assert [r["step"] for r in rows] == list(range(1, 11))
        assert {"step", "loss", "lr", "tokens_per_s", "grad_norm", "peak_mem_mib", "step_time_s"} <= set(rows[0])
        assert f"cp = {cp}" in (out / "config.toml").read_text()
        curves[cp] = [r["loss"] for r in rows]
    assert relative_gap(curves[2], curves[1]) <= 1e-3, curves
    assert sum(curves[1][-3:]) / 3 < curves[1][0] - 0.5, curves[1]  # it learns


def test_dp2_gives_the_loss_curve_of_one_process_with_the_same_global_batch(store, tmp_path):
    common = ["--model", "debug", "--data", store, "--seq-len", 256, "--steps", 4, "--precision", "fp32"]
    one = burst_train(*common, "--batch-size", 2, "--out", tmp_path / "dp1")
    two = burst_train(*common, "--dp", 2, "--batch-size", 1, "--out", tmp_path / "dp2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    losses = {name: [r["loss"] for r in metrics(tmp_path / name)] for name in ("dp1", "dp2")}
    assert relative_gap(losses["dp2"], losses["dp1"]) <= 1e-4, losses


def test_non_finite_steps_are_skipped_and_end_the_run_with_a_message(store, tmp_path, monkeypatch):
    """An --lr that diverges is refused at config time, so the loss is made non-finite here, from step 3 on."""
    import trainer.step

    forward_backward, steps = trainer.step.forward_backward, []

    def not_finite_from_step_3(*args):
        steps.append(len(steps) + 1)  # one micro-batch per step
        loss_sum = forward_backward(*args)
        return loss_sum * math.nan if steps[-1] >= 3 else loss_sum

    monkeypatch.setattr(trainer.step, "forward_backward", not_finite_from_step_3)
    out = tmp_path / "run"
    done = CliRunner().invoke(app, ["train", "--model", "debug", "--data", str(store), "--seq-len", "256", "--steps",
                                    "20", "--precision", "fp32", "--out", str(out)])
    assert done.exit_code == 1, done.output
    output = " ".join(done.output.split())
    assert "3 steps in a row" in output and "non-finite" in output and "lower --lr" in output
    assert "checked finite, are saved in" in output and "Traceback" not in output
    rows = metrics(out)
    assert [r["skipped"] for r in rows] == [False, False, True, True, True]


def test_a_run_in_which_no_step_was_applied_says_so_and_fails(store, tmp_path, monkeypatch):
    """Issue 35, defect 6: every step skipped (fewer than --max-bad-steps) printed "done: 2 steps ... training loss"
    and exited 0."""
    import trainer.step

    forward_backward = trainer.step.forward_backward
    monkeypatch.setattr(trainer.step, "forward_backward", lambda *args: forward_backward(*args) * math.inf)
    out = tmp_path / "run"
    done = CliRunner().invoke(app, ["train", "--model", "debug", "--data", str(store), "--seq-len", "256", "--steps",
                                    "2", "--precision", "fp32", "--out", str(out)])
    assert done.exit_code == 1, done.output
    output = " ".join(done.output.split())
    assert "no step of this invocation was applied" in output and "2 steps" in output, output[-2000:]
    assert "done:" not in output and "Traceback" not in output
    assert [r["skipped"] for r in metrics(out)] == [True, True]


def checkpoint_dir(path: Path, vocab_size: int, tokenizer: Path | None = None) -> Path:
    config = ModelConfig(**{**ModelConfig.from_name("debug").to_dict(), "vocab_size": vocab_size})
    save_model(Transformer(config), config, path)
    if tokenizer is not None:
        (path / "tokenizer.model").write_bytes(tokenizer.read_bytes())
    return path


def other_tokenizer(directory: Path) -> Path:
    rng = random.Random(1)
    texts = [make_text(rng, 50).replace("rank", "node") for _ in range(20)]
    return train_tokenizer(texts, directory / "other.model", vocab_size=320).path


@pytest.mark.parametrize("case", ["world", "seq_len", "preset", "tokenizer", "vocabulary", "occupied", "not a model"])
def test_bad_configs_are_refused_before_any_work(store, tmp_path, monkeypatch, case):
    out = tmp_path / "run"
    args = ["train", "--model", "debug", "--data", str(store), "--seq-len", "256", "--out", str(out)]
    expected = {
        "world": "cp x dp = 2 x 1 = 2 ranks, but 3 processes were started",
        "seq_len": "--seq-len 250 does not split over --cp 2",
        "preset": "'llama9' is neither a preset",
        "tokenizer": "was prepared with another tokenizer than the model",
        "vocabulary": "(its tokenizer has 320 tokens) but the model",
        "occupied": "already holds another run",
        "not a model": "is not a model checkpoint directory",
    }[case]
    if case == "world":  # as under torchrun with 3 processes
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "3")
        args += ["--cp", "2"]
    elif case == "seq_len":
        args += ["--cp", "2", "--seq-len", "250"]
    elif case == "preset":
        args += ["--model", "llama9"]
    elif case == "tokenizer":
        args += ["--model", str(checkpoint_dir(tmp_path / "ckpt", 320, other_tokenizer(tmp_path)))]
    elif case == "vocabulary":
        args += ["--model", str(checkpoint_dir(tmp_path / "ckpt", 300))]  # fewer embeddings than the store's ids
    elif case == "occupied":
        (out / "checkpoints").mkdir(parents=True)  # a run that trained, not one that failed during start-up
        (out / "config.toml").write_text('model = "debug"\n')
    elif case == "not a model":
        args += ["--model", str(tmp_path)]
    started = time.perf_counter()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split()), result.output
    assert time.perf_counter() - started < 10
    assert not (out / "metrics.jsonl").exists()


def test_doc_mask_cp2_gives_the_loss_curve_of_one_process_and_resumes_bit_exactly(store, tmp_path):
    """--doc-mask cuts each sequence by its balanced layout (cp_layout auto); the same sequences at cp 1."""
    common = ["--model", "debug", "--data", store, "--seq-len", 1024, "--steps", 6, "--lr", 0.01, "--warmup", 2,
              "--precision", "fp32"]
    flags = {"mask1": ["--doc-mask"], "mask2": ["--doc-mask", "--cp", 2], "plain": [],
             "stopped": ["--doc-mask", "--cp", 2, "--stop-after", 3]}
    runs = {}
    for pair in (("mask1", "mask2"), ("plain", "stopped")):  # two at a time: each pair is one process and two ranks
        runs.update(zip(pair, burst_train_together(*([*common, *flags[name], "--out", tmp_path / name]
                                                      for name in pair)), strict=True))
    runs["resumed"] = burst_train("--resume", "--out", tmp_path / "stopped")
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-3000:]
    losses = {name: [r["loss"] for r in metrics(tmp_path / name)] for name in ("mask1", "mask2", "plain", "stopped")}
    assert relative_gap(losses["mask2"], losses["mask1"]) <= 1e-5, losses
    assert losses["stopped"] == losses["mask2"]  # bit for bit, the three steps after the restart included
    assert losses["mask1"][-1] < losses["mask1"][0] - 0.5, losses["mask1"]  # it learns
    # the mask changes what the model sees: the same data and seed without it gives another curve
    assert relative_gap(losses["plain"], losses["mask1"]) > 1e-3, losses
    # the sequences trained on are cut by layouts of their own, not all zigzag's
    loader = SequenceLoader(TokenStore(store).split("train"), 1024, 1, reset_positions=True)
    layouts = {burst.balanced_layout(tuple(next(loader).doc_boundaries[0].tolist()), 1024, 2) for _ in range(6)}
    assert layouts - {zigzag_layout(1024, 2)}, layouts


def torchrun_nodes(nodes: int, per_node: int, *args: str, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """`burst train ARGS` as `nodes` torchrun node groups of `per_node` ranks on localhost, as a cluster
    would start it (LOCAL_WORLD_SIZE = per_node, so the topology sees `nodes` nodes)."""
    from tests.distributed import free_port

    port = free_port()
    logs = [tempfile.TemporaryFile("w+") for _ in range(nodes)]  # files, not pipes: no node blocks on a full pipe
    launches = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                                  "--node-rank", str(node), "--nproc-per-node", str(per_node),
                                  "--master-addr", "127.0.0.1", "--master-port", str(port),
                                  "cli.py", "train", *map(str, args)],
                                 stdout=log, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[1])
                for node, log in enumerate(logs)]
    try:
        codes = [launch.wait(timeout=timeout) for launch in launches]
    finally:  # a hung node must not outlive the test
        for launch in launches:
            launch.kill()
    done = []
    for launch, code, log in zip(launches, codes, logs, strict=True):
        log.seek(0)
        done.append(subprocess.CompletedProcess(launch.args, code, "", log.read()))
        log.close()
    return done


def test_two_nodes_give_the_loss_curve_of_one_node(store, tmp_path):
    """cp 4 over 2 nodes x 2 ranks, with the two-level ring and with Ulysses, trains as cp 4 on one node."""
    common = ["--model", "debug", "--data", store, "--seq-len", 512, "--steps", 3, "--lr", 0.01, "--precision", "fp32",
              "--doc-mask", "--cp", 4]
    one_node = burst_train(*common, "--cp-topology", "flat", "--out", tmp_path / "flat")
    assert one_node.returncode == 0, one_node.stderr[-3000:]
    reference = [r["loss"] for r in metrics(tmp_path / "flat")]
    for topology in ("two-level", "ulysses"):
        out = tmp_path / topology
        for node, done in enumerate(torchrun_nodes(2, 2, *common, "--cp-topology", topology, "--out", out)):
            assert done.returncode == 0, f"node {node}: {done.stderr[-3000:]}"
        losses = [r["loss"] for r in metrics(out)]
        assert relative_gap(losses, reference) <= 1e-5, (topology, losses, reference)
        assert f'cp_topology = "{topology}"' in (out / "config.toml").read_text()
