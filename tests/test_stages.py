"""Stages: `burst train --init-from RUN|CHECKPOINT` starts a new run from another run's weights (and, with
--init-optimizer, its optimizer state), with its own seq-len, data, layout and schedule; what cannot carry over
is refused before any work."""

import dataclasses
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from checkpoints import read_checkpoint
from checkpoints.training import complete_checkpoints
from cli import app
from data import prepare
from models import save_model
from models.rope import YarnRope
from tests.fixtures import burst_train, burst_train_together, events, make_text
from tests.test_checkpoint import losses
from tests.test_checkpoint import run as run  # noqa: F401  (a 4-step run stopped after step 3)
from trainer.checkpoint import load_stage_start
from trainer.config import TrainConfig, save_config
from trainer.optim import build_optimizer, build_schedule
from trainer.parallelize import build_model
from trainer.preflight import check_run, with_rope
from trainer.rundir import claim_run_directory


@pytest.mark.parametrize("with_optimizer", [False, True], ids=["weights", "weights-and-optimizer"])
def test_a_stage_starts_from_the_checkpoints_weights_and_optimizer_state_under_its_own_schedule(run, with_optimizer):
    checkpoint = complete_checkpoints(run)[-1]
    model_config = read_checkpoint(checkpoint).config
    config = TrainConfig(model="debug", seq_len=512, lr=3e-4, warmup=4, precision="fp32")
    model = build_model(model_config, None, config, torch.device("cpu"), fill=False)
    optimizer = build_optimizer(model, config)
    schedule = build_schedule(optimizer, config)
    load_stage_start(checkpoint, model, optimizer if with_optimizer else None)
    saved = dict(read_checkpoint(checkpoint).tensors())
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), saved[name]), name
    assert [group["lr"] for group in optimizer.param_groups] == [3e-4 / 4] * 2  # this stage's schedule, step 0
    assert schedule.get_last_lr() == [3e-4 / 4] * 2
    moments = {name: optimizer.state[param].get("exp_avg") for name, param in model.named_parameters()}
    if not with_optimizer:
        assert all(m is None for m in moments.values())
        return
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    name = "layers.0.attention.wq.weight"
    key = f"optimizer.state.{name}.exp_avg"
    assert key in metadata
    stored = {"optimizer": {"state": {name: {"exp_avg": torch.empty(metadata[key].size)}}}}
    dcp.load(stored, checkpoint_id=str(checkpoint), no_dist=True)
    assert torch.equal(moments[name], stored["optimizer"]["state"][name]["exp_avg"])
    assert int(optimizer.state[dict(model.named_parameters())[name]]["step"]) == 3  # AdamW's count goes on


def test_a_stage_at_another_length_and_layout_trains_and_resumes(run, store, tmp_path):
    out = tmp_path / "stage2"
    stage = ["--init-from", run, "--init-optimizer", "--data", store, "--seq-len", 512, "--steps", 3, "--lr", 0.005,
             "--warmup", 1, "--precision", "fp32", "--out", out]
    first, fresh = burst_train_together([*stage, "--cp", 2, "--stop-after", 1],
                                        ["--model", "debug", "--data", store, "--seq-len", 512, "--steps", 1,
                                         "--precision", "fp32", "--out", tmp_path / "fresh"])
    assert first.returncode == 0, first.stderr[-3000:]
    table = " ".join((first.stdout + first.stderr).split())  # the settings table, unwrapped
    assert "model │ the --init-from checkpoint's" in table and "rope_theta │ the model's: 10000" in table, table
    assert events(out, "initialised") == [{"event": "initialised", "from": str(complete_checkpoints(run)[-1]),
                                           "optimizer": True}]
    text = (out / "config.toml").read_text()
    assert f'init_from = "{run}"' in text and "init_optimizer = true" in text and "model =" not in text
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert losses(out)[1] < losses(tmp_path / "fresh")[1] - 0.3  # it starts where stage 1 left off
    second = burst_train("--resume", "--out", out)  # cp 1 now; the stage's own checkpoint holds the model
    assert second.returncode == 0, second.stderr[-3000:]
    assert sorted(losses(out)) == [1, 2, 3]


@pytest.fixture(scope="module")
def other_store(tmp_path_factory):
    """A store prepared with another tokenizer than the run's."""
    corpus = tmp_path_factory.mktemp("other-docs")
    rng = random.Random(7)
    for i in range(6):
        (corpus / f"d{i}.py").write_text(make_text(rng, 60))
    return prepare([corpus], tmp_path_factory.mktemp("other") / "store", vocab_size=300, val_fraction=0.2,
                   progress=False).out_dir


def stage_cases(run, store, other_store, tmp_path):
    model_dir = tmp_path / "native"
    model = build_model(read_checkpoint(run).config, None, TrainConfig(model="debug"), torch.device("cpu"))
    save_model(model, read_checkpoint(run).config, model_dir)
    empty_run = tmp_path / "empty-run"
    (empty_run / "checkpoints").mkdir(parents=True)
    failed_run = tmp_path / "failed-run"  # what a run whose first step failed leaves: marker, config, no checkpoints
    claim_run_directory(failed_run)
    save_config(TrainConfig(model="debug", data=str(store)), failed_run / "config.toml")
    return {
        "with --model": (["--init-from", run, "--model", "debug"], "--model debug would not be used; drop --model"),
        "optimizer alone": (["--init-optimizer"], "--init-optimizer starts from the optimizer state of --init-from"),
        "missing": (["--init-from", tmp_path / "nowhere"], "does not exist; pass a run directory"),
        "model directory": (["--init-from", model_dir], f"start from a model directory with --model {model_dir}"),
        "no checkpoint": (["--init-from", empty_run], "holds no complete checkpoint"),
        "failed start-up": (["--init-from", failed_run], f"--init-from {failed_run} is a training run without a "
                                                         f"checkpoint (its start-up failed, or it ended before its "
                                                         f"first save)"),
        "other tokenizer": (["--init-from", run, "--data", other_store], "prepared with another tokenizer"),
    }


@pytest.mark.parametrize("case", ["with --model", "optimizer alone", "missing", "model directory", "no checkpoint",
                                  "failed start-up", "other tokenizer"])
def test_what_cannot_start_a_stage_is_refused_before_any_work(run, store, other_store, tmp_path, case):
    args, message = stage_cases(run, store, other_store, tmp_path)[case]
    if "--data" not in args:
        args = [*args, "--data", store]
    out = tmp_path / "stage"
    result = CliRunner().invoke(app, ["train", *map(str, args), "--seq-len", "256", "--steps", "2",
                                      "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert not out.exists()


def test_a_stages_rope_scaling_extends_the_context_its_checkpoint_was_trained_at(run, store, tmp_path):
    """`run` trained the debug preset (max_seq_len 4096) from seed at --seq-len 256: a stage at 512 with YaRN x 8
    interpolates from 256 (not from the new --seq-len, nor the preset's 4096, which its weights never saw), in its
    config and in its logits."""
    checkpoint = complete_checkpoints(run)[-1]
    config = TrainConfig(init_from=str(run), data=str(store), seq_len=512, rope_scaling="yarn:factor=8",
                         precision="fp32", out=str(tmp_path / "stage"))
    plan = check_run(config, 1)
    assert plan.model_config.rope_scaling == YarnRope(factor=8.0, original_max_position_embeddings=256)
    assert plan.model_config.max_seq_len == 512  # the context it is now trained for: a next stage extends that

    model = build_model(plan.model_config, None, config, torch.device("cpu"), fill=False)
    load_stage_start(checkpoint, model, None)
    tokens = torch.randint(0, plan.model_config.vocab_size, (1, 512))

    def logits(original: int) -> torch.Tensor:
        other = build_model(dataclasses.replace(plan.model_config, rope_scaling=YarnRope(
            factor=8.0, original_max_position_embeddings=original)), None, config, torch.device("cpu"), fill=False)
        other.load_state_dict(model.state_dict())
        return other(tokens)

    with torch.no_grad():
        stage_logits = model(tokens)
        assert torch.equal(stage_logits, logits(256))
        # Before, the original length was the stage's max_seq_len: the preset's 4096 here (the new --seq-len where
        # that is longer); with head_dim 16 YaRN's rounded ramp from 512 is the same as from 256.
        assert (stage_logits - logits(4096)).abs().max() > 1e-3

    # A stage of that stage extends the same context: its scaling's original length, whatever --seq-len it trained at.
    stage = {"rope_scaling": YarnRope(factor=8.0, original_max_position_embeddings=256), "max_seq_len": 512}
    again = with_rope(dataclasses.replace(plan.model_config, **stage), TrainConfig(rope_scaling="yarn:factor=16"), 512)
    assert again.rope_scaling == YarnRope(factor=16.0, original_max_position_embeddings=256)
