"""`burst eval --ruler` against transformers: its samples file re-scored with transformers' greedy generation gives
burst's score per task, the samples are fitted to their length with the model's own tokenizer, and bad settings get
one line.

The run is SmolLM2-135M-Instruct, whole and in float32, at 1K tokens over cp 2 (the ring for the prompt, the merged
cache for the answer): two tasks it partly solves there, so that the scores compared are not all 0.
"""

from __future__ import annotations

import json

import pytest
import transformers
from typer.testing import CliRunner

from cli import app
from evaluation import EvalConfig, evaluate
from evaluation.ruler.run import RulerResult, RulerSettings
from scripts.ruler_rescore import rescore, string_match
from tests.distributed import run_on_ranks

TASKS = ("niah_single_1", "vt")
LENGTH = 1024


def _ruler_on_ranks(rank: int, world_size: int, model, out) -> None:
    settings = RulerSettings(tasks=TASKS, lengths=(LENGTH,), samples=3, samples_out=out / "samples.jsonl")
    evaluate(EvalConfig(checkpoint=model, cp=world_size, json_path=out / "ruler.json", ruler=settings))


@pytest.fixture(scope="module")
def ruler_run(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("ruler")
    run_on_ranks(_ruler_on_ranks, world_size=2, args=(smollm2, out), timeout_s=900)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return json.loads((out / "ruler.json").read_text())["ruler"], samples, out


def test_transformers_greedy_reproduces_every_task_score(smollm2, ruler_run):
    report, samples, _ = ruler_run
    results = rescore(samples, smollm2, batch=len(samples))  # together: 29 -> 23 CPU s, the same outputs
    assert set(results) == {(task, LENGTH) for task in TASKS}
    for (task, length), scores in results.items():
        assert scores.differing_outputs == 0
        assert report["scores"][task][str(length)] == scores.average(scores.transformers)
    assert any(report["scores"][task][str(LENGTH)] > 0 for task in TASKS)  # scores that could differ


def test_rulers_string_match_as_its_source_has_it():
    assert string_match("  The value is 42 and 7.\x01", ["42", "7", "9"], part=False) == pytest.approx(200 / 3)
    assert string_match("value: ABC", ["abc", "zzz"], part=True) == 100.0
    assert string_match("nothing", ["abc"], part=True) == 0.0


def test_samples_fit_their_length_as_the_models_tokenizer_counts(smollm2, ruler_run):
    _, samples, _ = ruler_run
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    for sample in samples:
        ids = tokenizer(sample["prompt"], add_special_tokens=False)["input_ids"]
        assert ids == sample["prompt_token_ids"]
        assert LENGTH - 40 <= len(ids) + sample["max_new_tokens"] <= LENGTH
        assert sample["prompt"].startswith("<|im_start|>")  # a chat model reads its template
        assert all(answer in sample["prompt"] for answer in sample["answers"])


def test_the_report_has_the_table_heatmap_and_effective_length(ruler_run):
    report, _, out = ruler_run
    assert set(report["scores"]) == set(TASKS)
    average = round(sum(report["scores"][t][str(LENGTH)] for t in TASKS) / len(TASKS), 2)
    assert report["average"][str(LENGTH)] == average
    assert report["effective_length"] == (LENGTH if average >= 85.6 else None)
    assert (out / "ruler.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_effective_length_is_the_longest_before_the_first_failure():
    result = RulerResult(["a"], [1024, 2048, 4096], {"a": {1024: 90.0, 2048: 70.0, 4096: 95.0}}, 85.6)
    assert result.effective_length == 1024
    assert RulerResult(["a"], [1024], {"a": {1024: 50.0}}, 85.6).effective_length is None


@pytest.mark.parametrize("args, message", [
    (["--ruler", "--ruler-tasks", "niah_single_9"], "unknown task 'niah_single_9'"),
    (["--ruler", "--ruler-lengths", "100"], "must be increasing lengths of at least 256"),
    (["--ruler", "--ruler-tasks", "qa"], "--ruler-qa FILE gives the questions of task qa"),
    (["--ruler", "--samples-out", "s.json"], "must end in .jsonl"),
    (["--ruler-samples", "3"], "--ruler-samples is a setting of RULER; add --ruler"),
    (["--ruler", "--seq-len", "1024"], "--seq-len scores perplexity"),
])
def test_bad_ruler_settings_get_one_line(smollm2_2_layers, args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(smollm2_2_layers), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
