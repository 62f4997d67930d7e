"""`burst generate` against transformers' generate: SmolLM2-135M-Instruct in float32, greedy, at cp 1, 2 and 4.

The prompt of 3,000 tokens (padded on the left to 2 x cp chunks at cp > 1) and a short chat run at every cp
on the first 2 layers of the model (real weights and tokenizer at a tenth of the cost: the cache, the ring and
the merge are the same code at any depth); the whole model answers the chat in one process. Each cp is one
process group that runs everything (greedy and sampled) through `run_generate`, as the command does. Sampling has no
transformers twin that draws alike: with a seed it must give the same tokens at every cp.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from cli import app
from evaluation.generate import Stops, generate, use_decode_attention
from evaluation.generate_run import GenerateConfig, Prompt, run_generate
from evaluation.sampling import Sampling
from models import convert_checkpoint, load_model
from tests.distributed import run_on_ranks
from tests.test_families import WINDOW
from tests.test_families import hf_model as random_family_model

NEW_TOKENS = 64
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 7}


@functools.cache
def long_text(directory: Path, tokens: int = 3000) -> str:
    """Python's own textwrap.py and shlex.py (code the model knows), cut to `tokens` tokens."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    text = (stdlib / "textwrap.py").read_text() + (stdlib / "shlex.py").read_text()
    return tokenizer.decode(tokenizer(text)["input_ids"][:tokens])


def _generate_all(rank: int, world_size: int, model: Path, out: Path, text: str) -> None:
    """Run on every rank of a group: greedy on both prompts, then sampled; rank 0 writes what it got."""
    prompts = [Prompt(text=text), Prompt(messages=CHAT)]
    greedy, speed = run_generate(GenerateConfig(model=model, prompts=prompts, max_new_tokens=NEW_TOKENS,
                                                cp=world_size))
    sampled, _ = run_generate(GenerateConfig(model=model, prompts=prompts[1:], max_new_tokens=24,
                                             cp=world_size, **SAMPLING))
    if rank == 0:
        out.write_text(json.dumps({"greedy": [asdict(g) for g in greedy], "sampled": [asdict(g) for g in sampled],
                                   "kv_cache_bytes": speed.kv_cache_bytes}))


@pytest.fixture(scope="module")
def generated(smollm2_2_layers, tmp_path_factory) -> dict[int, dict]:
    """What each cp generated: {cp: {"greedy": [...], "sampled": [...]}}."""
    root = tmp_path_factory.mktemp("generate")
    results = {}
    for cp in (1, 2, 4):
        out = root / f"cp{cp}.json"
        if cp == 1:
            _generate_all(0, 1, smollm2_2_layers, out, long_text(smollm2_2_layers))
        else:
            run_on_ranks(_generate_all, world_size=cp, args=(smollm2_2_layers, out, long_text(smollm2_2_layers)),
                         timeout_s=600)
        results[cp] = json.loads(out.read_text())
    return results


@functools.cache
def hf_model(directory: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def transformers_ids(directory: Path, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy continuation of `prompt_ids`, up to its EOS (included) or NEW_TOKENS: generated once per
    prompt, as every cp reads the same prompt ids (test_prompts_are_the_ids_transformers_reads)."""
    return list(_transformers_ids(directory, tuple(prompt_ids)))


@functools.cache
def _transformers_ids(directory: Path, prompt_ids: tuple[int, ...]) -> tuple[int, ...]:
    model = hf_model(directory)
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0]
    return tuple(ids[len(prompt_ids):].tolist())


def test_prompts_are_the_ids_transformers_reads(smollm2_2_layers, generated):
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_2_layers)
    long, chat = generated[1]["greedy"]
    assert long["prompt_token_ids"] == tokenizer(long_text(smollm2_2_layers))["input_ids"]
    assert 2990 < len(long["prompt_token_ids"]) < 3010
    assert chat["prompt_token_ids"] == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                                     return_dict=False)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_greedy_tokens_equal_transformers(smollm2_2_layers, generated, cp):
    for result in generated[cp]["greedy"]:
        assert result["token_ids"] == transformers_ids(smollm2_2_layers, result["prompt_token_ids"])


def test_the_whole_model_answers_a_batch_as_transformers_answers_each_prompt_alone(smollm2):
    """Three prompts of different lengths generated together: the chat ends early (its row leaves the batch), the
    others go on; each gets transformers' greedy ids for it alone (float32: a row's logits differ from its batch-1
    ones by rounding only, far below the margins between the tokens chosen)."""
    prompts = [Prompt(messages=CHAT), Prompt(text="def fibonacci(n):"), Prompt(text=long_text(smollm2, 400))]
    results, _ = run_generate(GenerateConfig(model=smollm2, prompts=prompts, max_new_tokens=NEW_TOKENS,
                                             batch_size=3))
    for result in results:
        assert result.token_ids == transformers_ids(smollm2, result.prompt_token_ids)
    assert results[0].finish_reason == "stop" and len(results[0].token_ids) < NEW_TOKENS  # it left the batch
    assert results[1].finish_reason == "length"
    assert "Paris" in results[0].text


def test_sampling_with_a_seed_gives_the_same_tokens_at_every_cp(generated):
    runs = [generated[cp]["sampled"][0]["token_ids"] for cp in (1, 2, 4)]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0] != generated[1]["greedy"][1]["token_ids"]  # it did sample


WINDOW_NEW_TOKENS = 24
WINDOW_PROMPTS = (41, 30)  # longer than the window, of different lengths: one row is padded


class IdsAsText:
    """The tokenizer `generate` wants, for a model without one: its text is the ids."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> list[tuple[Path, list[list[int]], list[list[int]]]]:
    """Small random Mistral and Gemma 3 models built by transformers (window 16 on every layer, on every other
    layer with its own RoPE base), converted to burst, with two prompts each and transformers' greedy ids for
    each prompt alone."""
    root, cases = tmp_path_factory.mktemp("windowed"), []
    for name in ("mistral", "gemma3"):
        reference = random_family_model(name, root / name)
        reference.generation_config.eos_token_id = None  # random weights: generate every token asked for
        convert_checkpoint(root / name, root / f"{name}-burst", to="burst")
        generator = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in WINDOW_PROMPTS]
        with torch.no_grad():
            expected = [reference.generate(torch.tensor([p]), max_new_tokens=WINDOW_NEW_TOKENS, do_sample=False,
                                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        cases.append((root / f"{name}-burst", prompts, expected))
    assert max(WINDOW_PROMPTS) + WINDOW_NEW_TOKENS > 3 * WINDOW > min(WINDOW_PROMPTS)
    return cases


def _generate_windowed(rank: int, world_size: int, cases: list) -> None:
    for path, prompts, expected in cases:
        for layout in ("zigzag", "balanced") if world_size > 1 else ("zigzag",):
            model = load_model(path)
            use_decode_attention(model, None, layout)
            got = generate(model, prompts, IdsAsText(), Stops(), WINDOW_NEW_TOKENS, Sampling(), layout=layout)
            assert [g.token_ids for g in got] == expected, (path.name, world_size, layout)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_windowed_models_generate_as_transformers_does(windowed, cp):
    """Sliding windows in the prompt's ring (zigzag and balanced) and in each new token's view of the rank-split
    cache."""
    if cp == 1:
        _generate_windowed(0, 1, windowed)
    else:
        run_on_ranks(_generate_windowed, cp, (windowed,))


def test_kv_cache_per_rank_at_cp_4_is_a_quarter_of_cp_1s_measured_and_planned(smollm2_2_layers, generated,
                                                                               tmp_path):
    measured = {cp: generated[cp]["kv_cache_bytes"] for cp in (1, 4)}
    assert abs(measured[4] / (measured[1] / 4) - 1) < 0.10
    tokens = 3000 + NEW_TOKENS  # the longer prompt and its new tokens, kept whole at cp 1
    config = json.loads((smollm2_2_layers / "config.json").read_text())
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["hidden_size"] // \
        config["num_attention_heads"] * 4  # keys and values of every layer, float32
    assert measured[1] == tokens * per_token
    planned = {}
    for cp in (1, 4):
        plan = tmp_path / f"plan{cp}.json"
        result = CliRunner().invoke(app, ["plan", "--model", str(smollm2_2_layers), "--seq-len", "3000", "--cp",
                                          str(cp), "--generate", str(NEW_TOKENS), "--precision", "fp32",
                                          "--device", "cpu", "--json", str(plan)])
        assert result.exit_code == 0, result.output
        assert "kv cache" in result.output
        planned[cp] = json.loads(plan.read_text())["memory_bytes"]["kv cache"]
    assert abs(planned[1] - measured[1]) / measured[1] < 0.01 and abs(planned[4] - measured[4]) / measured[4] < 0.01



def test_a_bf16_models_kv_cache_is_planned_in_float32_on_a_cpu(smollm2_2_layers, tmp_path):
    """A CPU keeps the cache in float32 whatever the weights (burst/decode.py's cache_dtype), and the plan says so."""
    config = json.loads((smollm2_2_layers / "config.json").read_text())
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["hidden_size"] // \
        config["num_attention_heads"] * 4
    plan = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--model", str(smollm2_2_layers), "--seq-len", "3000", "--generate",
                                      str(NEW_TOKENS), "--precision", "bf16", "--device", "cpu", "--json", str(plan)])
    assert result.exit_code == 0, result.output
    assert json.loads(plan.read_text())["memory_bytes"]["kv cache"] == (3000 + NEW_TOKENS) * per_token

def test_burst_generate_writes_text_and_ids(smollm2_2_layers, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "The capital of France is"}) + "\n" + json.dumps({"messages": CHAT}))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["generate", "--model", str(smollm2_2_layers), "--prompt-file", str(prompts),
                                      "--max-new-tokens", "8", "--output", str(out), "--stop", "\n"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all({"text", "token_ids", "prompt_token_ids"} <= set(row) for row in rows)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_2_layers)
    for row in rows:
        assert "\n" not in row["text"]
        assert tokenizer.decode(row["token_ids"]).startswith(row["text"])


@pytest.mark.parametrize("args, message", [
    ([], "give one of --prompt TEXT or --prompt-file FILE"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature -1.0 must be a finite number >= 0"),
    (["--prompt", "x", "--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    (["--prompt", "x", "--output", "out.json"], "must end in .jsonl"),
    (["--prompt-file", "missing.txt"], "--prompt-file missing.txt is not a file"),
])
def test_bad_input_gets_one_line(smollm2_2_layers, args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["generate", "--model", str(smollm2_2_layers), *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_a_bad_jsonl_line_is_named(smollm2_2_layers, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"text": "wrong key"}\n')
    result = CliRunner().invoke(app, ["generate", "--model", str(smollm2_2_layers), "--prompt-file", str(prompts)])
    assert result.exit_code == 2 and "line 2 holds neither" in result.output
