"""Preference tuning: every objective's loss, gradient and per-answer log-probabilities equal TRL's formulas computed
with transformers on each pair unpacked (prompt + chosen and prompt + rejected as separate sequences), at cp 1,
cp 2 and dp 2 with gradient accumulation; `burst train --objective dpo` from its own reference starts at ln 2."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from data import SequenceLoader, TokenStore, prepare
from data.preference_packing import PreferenceStream
from evaluation import EvalConfig
from evaluation.run import open_inputs
from models import ModelConfig, init_model, save_model
from models.preference import OBJECTIVES
from tests.distributed import run_on_ranks
from tests.fixtures import burst_train, burst_train_together, events, metrics
from tests.test_chat import CHATML_SPECIALS, CHATML_TEMPLATE, chat_tokenizer, write_rows
from tests.test_instruction_training import hf_model, model_config
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.parallelize import build_model, end_forward_only
from trainer.preference import Reference, batch_logps
from trainer.step import train_step

SEQ_LEN, SEQUENCES = 384, 4  # a step: 4 sequences of 384 tokens, several pairs each
SHARING = (False, True)
SETTINGS = dict(beta=0.3, simpo_gamma=0.4, orpo_lambda=0.2)


def preference_rows(count: int) -> list[dict]:
    rows = []
    for i in range(count):
        prompt = f"Question {i}: what is {i} times {i % 7 + 2}?" + " Think." * (i % 3)
        chosen, rejected = f"It is {i * (i % 7 + 2)}.", f"Perhaps {i + 3}, or so." * (1 + i % 2)
        if i % 3 == 0:  # messages, not strings
            rows.append({"prompt": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def make_pair_store(root: Path) -> Path:
    """A preference store of 40 pairs (a ChatML template), 4 of them held out."""
    tokenizer = chat_tokenizer(root / "tokenizer", CHATML_SPECIALS, CHATML_TEMPLATE)
    rows = write_rows(root / "pairs.jsonl", preference_rows(40))
    prepare([rows], root / "store", tokenizer=tokenizer, val_fraction=0.1, preference=True, progress=False)
    return root / "store"


@pytest.fixture(scope="module")
def pair_store(tmp_path_factory) -> Path:
    return make_pair_store(tmp_path_factory.mktemp("preferences"))


def config_for(cp: int, dp: int, grad_accum: int, objective: str, sharing: bool) -> TrainConfig:
    return TrainConfig(model="debug", seq_len=SEQ_LEN, cp=cp, dp=dp, batch_size=SEQUENCES // dp // grad_accum,
                       grad_accum=grad_accum, precision="fp32", max_grad_norm=0.0, doc_mask=True, seed=3,
                       objective=objective, prefix_sharing=sharing, **SETTINGS)


def reference_logps(store: TokenStore) -> np.ndarray:
    """Made-up reference log-probabilities, one pair per row: the objectives' arithmetic is what is tested."""
    return np.random.default_rng(0).normal(-40.0, 5.0, (store.num_documents, 2))


def trl_losses(objective: str, chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
               rejected_tokens: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """TRL's per-pair losses, written out from its trainers' formulas."""
    beta, gamma, lam = SETTINGS["beta"], SETTINGS["simpo_gamma"], SETTINGS["orpo_lambda"]
    if objective == "dpo":
        return -F.logsigmoid(beta * ((chosen - reference[:, 0]) - (rejected - reference[:, 1])))
    if objective == "ipo":
        logits = (chosen - reference[:, 0]) / chosen_tokens - (rejected - reference[:, 1]) / rejected_tokens
        return (logits - 1 / (2 * beta)) ** 2
    chosen_avg, rejected_avg = chosen / chosen_tokens, rejected / rejected_tokens
    if objective == "simpo":
        return -F.logsigmoid(beta * (chosen_avg - rejected_avg) - gamma)
    log_odds = (chosen_avg - rejected_avg) - (torch.log1p(-torch.exp(chosen_avg)) -
                                              torch.log1p(-torch.exp(rejected_avg)))
    # ORPO's NLL is TRL's cross-entropy over all the batch's chosen tokens (a mean over tokens, not over pairs)
    return -chosen / chosen_tokens.mean() - lam * F.logsigmoid(log_odds)


def transformers_pair_logps(hf, store: TokenStore, documents: np.ndarray, shortest: int = 0) -> tuple:
    """Each pair's (chosen, rejected) summed log-probabilities, [pairs, 2] with the graph kept, and their answers'
    token counts, [pairs, 2], as the transformers model `hf` computes them on each answer after its prompt, unpacked.
    `shortest`: every prompt-and-answer sequence must be longer (a test's precondition, e.g. a window it must cross)."""
    sums, counts = [], []
    for document in documents.tolist():
        prompt, chosen, _ = store.pair_lengths_of(document)
        ids = torch.from_numpy(store.document(document).astype(np.int64))
        for answer in (ids[prompt:prompt + chosen], ids[prompt + chosen:]):
            sequence = torch.cat([ids[:prompt], answer])
            assert len(sequence) > shortest
            logits = hf(input_ids=sequence[None]).logits[0].float()  # [prompt + answer, vocab]
            sums.append(logits[prompt - 1:-1].log_softmax(-1).gather(1, answer[:, None]).sum())
            counts.append(float(len(answer)))
    return torch.stack(sums).view(-1, 2), torch.tensor(counts).view(-1, 2)


def transformers_reference(store_dir: Path, sharing: bool) -> dict:
    """Per objective, step 1's loss and gradient norm as transformers computes them on each pair of the step
    unpacked, and each pair's (chosen, rejected) log-probabilities."""
    store = TokenStore(store_dir).split("train")
    config = config_for(1, 1, 1, "dpo", sharing)
    hf = hf_model(build_model(model_config(store), None, config, torch.device("cpu")), model_config(store))
    stream = PreferenceStream(store, SEQ_LEN, config.seed, prefix_sharing=sharing)
    documents = np.concatenate([stream.sequence(k).documents for k in range(SEQUENCES)])
    assert len(documents) > SEQUENCES  # several pairs to a sequence
    reference = torch.from_numpy(reference_logps(store))[documents]
    expected: dict = {}
    for objective in OBJECTIVES:
        hf.zero_grad()
        logps, tokens = transformers_pair_logps(hf, store, documents)
        loss = trl_losses(objective, logps[:, 0], logps[:, 1], tokens[:, 0], tokens[:, 1], reference).mean()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), float("inf"))
        expected[objective] = (loss.item(), grad_norm.item())
        expected["logps"] = {d: logps[i].tolist() for i, d in enumerate(documents.tolist())}
        expected["answer_tokens"] = int(tokens.sum())
    return expected


@pytest.fixture(scope="module")
def expected(pair_store) -> dict:
    return {sharing: transformers_reference(pair_store, sharing) for sharing in SHARING}


def _check_on_ranks(rank, world_size, store_dir, cp, dp, grad_accum, expected):
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp")) if world_size > 1 else None
    env = Distributed(rank, world_size, torch.device("cpu"), mesh)
    store = TokenStore(store_dir).split("train")
    reference = Reference(reference_logps(store))
    for sharing in SHARING:
        model = None
        for objective in OBJECTIVES:
            config = config_for(cp, dp, grad_accum, objective, sharing)
            model = model or build_model(model_config(store), mesh, config, torch.device("cpu"))
            loader = SequenceLoader(store, SEQ_LEN, config.batch_size, dp_rank=env.dp_rank, dp_size=dp,
                                    cp_rank=env.cp_rank, cp_size=cp, seed=config.seed, reset_positions=True,
                                    cp_layout=config.sequence_layout, prefix_sharing=sharing)
            batches = [reference.attach(next(loader)) for _ in range(grad_accum)]
            if objective == OBJECTIVES[0]:
                with torch.no_grad():
                    for batch in batches:
                        logps, _ = batch_logps(model, batch, config, env)
                        for document, pair in zip(batch.pair_documents.tolist(), logps.view(-1, 2).tolist(),
                                                  strict=True):
                            # a sum of ~-150 in float32: 1e-5, or 2 ulps of the sum
                            assert pair == pytest.approx(expected[sharing]["logps"][document], abs=1e-5, rel=2e-7)
                end_forward_only(model)
            result = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batches, config, env)
            loss, grad_norm = expected[sharing][objective]
            assert abs(result.loss - loss) <= 1e-5, (objective, sharing, result.loss, loss, cp, dp)
            assert result.grad_norm == pytest.approx(grad_norm, rel=1e-4), (objective, sharing, cp, dp,
                                                                            result.grad_norm, grad_norm)
            assert result.metrics["pairs"] == len(expected[sharing]["logps"])
            assert result.scored_tokens == expected[sharing]["answer_tokens"]  # every answer token of the step


@pytest.mark.parametrize("cp, dp, grad_accum", [(1, 1, 2), (2, 1, 2), (1, 2, 2)])
def test_each_objective_is_trl_on_each_pair_unpacked(pair_store, expected, cp, dp, grad_accum):
    if cp * dp == 1:
        _check_on_ranks(0, 1, pair_store, cp, dp, grad_accum, expected)
    else:
        run_on_ranks(_check_on_ranks, world_size=cp * dp, args=(pair_store, cp, dp, grad_accum, expected),
                     timeout_s=300)


@pytest.fixture(scope="module")
def dpo_step_1(pair_store, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """DPO runs stopped after step 1 (to resume from copies), from the seed's weights ("own") and from another seed's
    ("other"): the two tests below start from the same run, trained once."""
    root = tmp_path_factory.mktemp("dpo")
    common = ("--model", "debug", "--data", pair_store, "--seq-len", SEQ_LEN, "--batch-size", 2, "--steps", 3,
              "--lr", 0.01, "--warmup", 1, "--precision", "fp32", "--doc-mask", "--objective", "dpo",
              "--stop-after", 1)
    runs = burst_train_together((*common, "--out", root / "own"), (*common, "--seed", 1, "--out", root / "other"))
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
    return {name: (root / name, done) for name, done in zip(("own", "other"), runs, strict=True)}


def test_dpo_from_its_own_reference_starts_at_ln2_and_resumes_with_it(pair_store, dpo_step_1, tmp_path):
    out = Path(shutil.copytree(dpo_step_1["own"][0], tmp_path / "run"))
    done = dpo_step_1["own"][1]
    [first] = metrics(out)
    assert abs(first["loss"] - math.log(2)) < 1e-6  # with prefix sharing (the default)
    assert first["rewards/margins"] == pytest.approx(0, abs=1e-6) and first["pairs"] > 2
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected"} <= \
        set(first)
    assert "reward accuracy" in " ".join(done.stdout.split())
    saved = (out / "reference_logps.npz").read_bytes()
    done = burst_train("--resume", "--out", out, "--stop-after", 2)  # the reference is read back, not recomputed
    assert done.returncode == 0, done.stderr[-3000:]
    assert [row["step"] for row in metrics(out)] == [1, 2] and (out / "reference_logps.npz").read_bytes() == saved
    assert "reference log-probabilities: one pass" not in done.stdout
    (out / "reference_logps.npz").unlink()
    done = burst_train("--resume", "--out", out)
    assert done.returncode != 0 and "reference_logps.npz is missing" in " ".join(done.stderr.split())
    (out / "reference_logps.npz").write_bytes(saved)  # the eval below scores the run's step-2 checkpoint
    evaluated = [burst_eval("--checkpoint", out, "--data", pair_store, "--seq-len", SEQ_LEN, "--cp", cp,
                            "--reference", out, "--json", tmp_path / f"cp{cp}.json") for cp in (1, 2)]
    for done in evaluated:
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"cp{cp}.json").read_text()) for cp in (1, 2))
    assert one["pairs"] == TokenStore(pair_store).split("val").num_documents > 0
    for key in ("logps/chosen", "logps/rejected", "accuracy", "margin"):
        assert two[key] == pytest.approx(one[key], abs=1e-5)  # the pairs summed over the ranks
    assert one["rewards/margins"] == 0 and one["rewards/accuracies"] == 0  # the model is its own reference
    assert "rewards/accuracies" in " ".join(evaluated[0].stdout.split())


def test_a_damaged_or_foreign_reference_is_refused_on_resume_in_one_line(dpo_step_1, tmp_path):
    """Issue 35, defects 3 and 7: a truncated reference_logps.npz gave a BadZipFile traceback on --resume; one from
    a run that started from other weights (another --seed) was read silently; the pass had no line of its own."""
    shutil.copytree(dpo_step_1["own"][0], tmp_path / "own")
    runs = [[dpo_step_1["own"][1]]]
    own, other = tmp_path / "own" / "reference_logps.npz", dpo_step_1["other"][0] / "reference_logps.npz"
    [started] = events(tmp_path / "own", "reference")
    assert started["pairs"] > 0 and started["seconds"] > 0 and len(started["weights"]) == 64
    [ready] = events(tmp_path / "own", "model_ready")
    rows = events(tmp_path / "own", None)
    assert rows.index(ready) < rows.index(started)  # the pass is not counted in the start-up's time
    assert "reference log-probabilities" in runs[0][0].stdout

    saved = own.read_bytes()
    own.write_bytes(saved[:len(saved) // 2])
    done = burst_train("--resume", "--out", tmp_path / "own")
    output = " ".join(done.stderr.split())
    assert done.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert "reference_logps.npz is damaged" in output and "start a new run" in output

    own.write_bytes(other.read_bytes())
    done = burst_train("--resume", "--out", tmp_path / "own")
    output = " ".join(done.stderr.split())
    assert done.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert "other starting weights" in output and started["weights"][:12] in output

    own.write_bytes(saved)
    done = burst_train("--resume", "--out", tmp_path / "own", "--stop-after", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [row["step"] for row in metrics(tmp_path / "own")] == [1, 2]


@pytest.mark.parametrize("objective, settings, message", [
    ("dpo", dict(beta=1e30), "--beta 1e+30 cannot train --objective dpo: it must lie in [0.001, 1000]"),
    ("ipo", dict(beta=1e-30), "--beta 1e-30 cannot train --objective ipo: it must lie in [0.001, 1000] (IPO's target"),
    ("simpo", dict(simpo_gamma=1e9), "--simpo-gamma 1e+09 asks for a margin of gamma / beta = 1e+10 nats per token"),
    ("orpo", dict(orpo_lambda=1e9), "--orpo-lambda 1e+09 is above 100"),
    ("simpo", dict(simpo_gamma=-1), "--simpo-gamma -1 must be a finite number, at least 0: SimPO's target"),
    ("orpo", dict(orpo_lambda=-1), "--orpo-lambda -1 must be a finite number, at least 0: the weight of ORPO's"),
    ("dpo", dict(beta=0), "--beta 0 must be a finite number above 0"),
])
def test_preference_settings_that_cannot_train_are_refused_naming_their_flag(objective, settings, message):
    """Issue 35, defects 6 and 9: such values skipped every step (or trained at a loss of 1e9) and exited 0; a
    negative gamma or lambda was refused with a message about --beta."""
    with pytest.raises(ValueError) as refused:
        TrainConfig(model="debug", objective=objective, doc_mask=True, **settings)
    assert message in str(refused.value)
    if "beta" not in settings:
        assert "--beta" not in str(refused.value).split(":")[0]
    TrainConfig(model="debug", objective=objective, doc_mask=True)  # the defaults train


@pytest.fixture(scope="module")
def pair_model(pair_store, tmp_path_factory) -> Path:
    """A `debug` model (untrained) of the pair store's vocabulary, as a native model directory."""
    config = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=TokenStore(pair_store).vocab_size)
    path = tmp_path_factory.mktemp("pair_model") / "debug"
    save_model(init_model(config), config, path)
    return path


@pytest.mark.parametrize("flags, message", [
    ({}, None),  # the default passkey lengths of --seq-len 64 are too short for a passkey: none runs here
    ({"passkey_trials": 3}, "--passkey-trials is for a store of documents or conversations"),
    ({"passkey_lengths": [64]}, "--passkey-lengths is for a store of documents or conversations"),
    ({"qa_samples": 4}, "--qa-samples is for an instruction store's conversations"),
    ({"beta": 0.2}, "--beta scales DPO's implicit rewards against --reference, which is not given"),
])
def test_eval_on_a_preference_store_refuses_the_flags_it_would_ignore(pair_store, pair_model, flags, message):
    """Issue 35, defect 9: `burst eval --seq-len 64` on a preference store failed on --passkey-lengths, though no
    passkey runs there; --qa-samples, --passkey-trials and --beta without --reference were accepted and ignored."""
    config = EvalConfig(checkpoint=pair_model, data=pair_store, seq_len=64, given=frozenset({"seq_len", *flags}),
                        **flags)
    if message is None:
        assert open_inputs(config).sequences == TokenStore(pair_store).split("val").num_documents
        return
    with pytest.raises(ValueError) as refused:
        open_inputs(config)
    assert message in str(refused.value) and "drop it" in str(refused.value)


def burst_eval(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "eval", *map(str, args)],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
