"""Training on an instruction store: the loss of a step is transformers' mean over the answers' tokens of the whole
global batch (labels -100 elsewhere), at cp 1, cp 2 and dp 2 with gradient accumulation; `burst train` reports the
scored tokens, the padding and the long conversations, and refuses what cannot train, before any work."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from cli import app
from data import SequenceLoader, TokenStore, prepare
from data.conversation_packing import ConversationStream
from models import ModelConfig
from models.convert import NATIVE_TO_HF, rename
from models.hf_config import config_to_hf
from tests.distributed import run_on_ranks
from tests.fixtures import burst_train, events, metrics
from tests.test_chat import CONVERSATIONS, LLAMA3_TEMPLATE, LLAMA_SPECIALS, chat_tokenizer, write_rows
from tests.test_tokenizers import refused
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.parallelize import build_model
from trainer.step import train_step

SEQ_LEN, SEQUENCES = 256, 4  # a step: 4 sequences of 256 tokens, in every layout


def conversation_rows(count: int) -> list[dict]:
    """`count` conversations of varied lengths (one to three answers), from the test conversations' messages."""
    rows = []
    for i in range(count):
        base = CONVERSATIONS[i % len(CONVERSATIONS)]
        turns = 1 + i % 3
        more = [message for k in range(1, turns) for message in (
            {"role": "user", "content": f"and {k} more?"}, {"role": "assistant", "content": f"{k * i} more."})]
        rows.append({"messages": [*base, *more]})
    return rows


@pytest.fixture(scope="module")
def chat_store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("instructions")
    tokenizer = chat_tokenizer(root / "tokenizer", LLAMA_SPECIALS, LLAMA3_TEMPLATE)
    rows = write_rows(root / "chat.jsonl", conversation_rows(60))
    prepare([rows], root / "store", tokenizer=tokenizer, val_fraction=0.1, chat=True, progress=False)
    return root / "store"


def model_config(store: TokenStore) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=store.vocab_size)


def config_for(cp: int, dp: int, grad_accum: int) -> TrainConfig:
    # max_grad_norm 0: the step reports the raw gradient norm
    return TrainConfig(model="debug", seq_len=SEQ_LEN, cp=cp, dp=dp, batch_size=SEQUENCES // dp // grad_accum,
                       grad_accum=grad_accum, precision="fp32", max_grad_norm=0.0, doc_mask=True, seed=3)


def hf_model(model: torch.nn.Module, config: ModelConfig) -> LlamaForCausalLM:
    """transformers' LlamaForCausalLM holding the weights of burst's `model` (one process)."""
    hf = LlamaForCausalLM(LlamaConfig.from_dict(config_to_hf(config, torch.float32), attn_implementation="eager"))
    hf.load_state_dict({rename(name, NATIVE_TO_HF): t for name, t in model.state_dict().items()}, strict=False)
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    return hf


def transformers_loss(hf: LlamaForCausalLM, store: TokenStore, seed: int, sequences: int) -> tuple[torch.Tensor, int]:
    """The mean token loss transformers computes over the first `sequences` sequences burst packs from `store`
    (seed `seed`), and its token count: each conversation (and each padding run) on its own, labels -100 where a
    token is not scored, the summed loss divided by the scored tokens of them all."""
    stream = ConversationStream(store, SEQ_LEN, seed)
    pieces = []
    for k in range(sequences):
        tokens, is_start, scored = (torch.from_numpy(a) for a in stream.sequence(k))
        edges = [*torch.nonzero(is_start).flatten().tolist(), SEQ_LEN + 1]
        pieces += [(tokens[a:b], torch.where(scored[a:b], tokens[a:b], -100)) for a, b in zip(edges, edges[1:],
                                                                                                strict=False)]
    count = sum(int((labels[1:] != -100).sum()) for _, labels in pieces)
    return sum(hf(input_ids=t[None], labels=lab[None], num_items_in_batch=count).loss for t, lab in pieces), count


def transformers_reference(store_dir: Path) -> tuple[float, float, int]:
    """Step 1's loss, gradient norm and scored tokens as transformers computes them."""
    config = config_for(1, 1, 1)
    store = TokenStore(store_dir).split("train")
    hf = hf_model(build_model(model_config(store), None, config, torch.device("cpu")), model_config(store))
    loss, count = transformers_loss(hf, store, config.seed, SEQUENCES)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), float("inf"))
    return loss.item(), grad_norm.item(), count


def _step_on_ranks(rank, world_size, store_dir, cp, dp, grad_accum, expected):
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp")) if world_size > 1 else None
    env = Distributed(rank, world_size, torch.device("cpu"), mesh)
    dp_rank, cp_rank = (mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()) if mesh is not None else (0, 0)
    config = config_for(cp, dp, grad_accum)
    store = TokenStore(store_dir).split("train")
    loader = SequenceLoader(store, SEQ_LEN, config.batch_size, dp_rank=dp_rank, dp_size=dp, cp_rank=cp_rank,
                            cp_size=cp, seed=config.seed, reset_positions=True,
                            cp_layout=config.sequence_layout)
    model = build_model(model_config(store), mesh, config, torch.device("cpu"))
    result = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), [next(loader) for _ in range(grad_accum)],
                        config, env)
    loss, grad_norm, count = expected
    assert result.scored_tokens == count
    assert abs(result.loss - loss) <= 1e-5, (result.loss, loss, cp, dp, grad_accum)
    assert result.grad_norm == pytest.approx(grad_norm, rel=1e-4)


@pytest.fixture(scope="module")
def reference(chat_store) -> tuple[float, float, int]:
    return transformers_reference(chat_store)


def test_the_reference_scores_only_answers(reference):
    _, _, count = reference
    assert 0 < count < SEQUENCES * SEQ_LEN // 2  # the prompts (system header, questions) are most tokens


@pytest.mark.parametrize("cp, dp, grad_accum", [(1, 1, 2), (2, 1, 2), (1, 2, 2)])
def test_the_loss_is_transformers_mean_over_the_answers_of_the_global_batch(chat_store, reference, cp, dp,
                                                                             grad_accum):
    if cp * dp == 1:
        _step_on_ranks(0, 1, chat_store, cp, dp, grad_accum, reference)
    else:
        run_on_ranks(_step_on_ranks, world_size=cp * dp, args=(chat_store, cp, dp, grad_accum, reference))


def test_burst_train_on_conversations_reports_answers_padding_and_long_conversations(chat_store, reference, tmp_path):
    out = tmp_path / "run"
    done = burst_train("--model", "debug", "--data", chat_store, "--seq-len", SEQ_LEN, "--batch-size", 2,
                       "--grad-accum", 2, "--steps", 3, "--lr", 0.01, "--warmup", 1, "--precision", "fp32",
                       "--doc-mask", "--seed", 3, "--max-grad-norm", 0, "--long-conversations", "truncate",
                       "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metrics(out)
    loss, _, count = reference
    assert abs(rows[0]["loss"] - loss) <= 1e-5 and rows[0]["scored_tokens"] == count
    assert rows[-1]["padding_tokens"] > 0
    [packing] = events(out, "conversations")
    store = TokenStore(chat_store).split("train")
    assert packing["sources"]["store"] == {"conversations": store.num_documents, "longer_than_sequence": 0,
                                           "policy": "truncate", "truncated_tokens": 0, "pieces": 0}
    output = " ".join(done.stdout.split())
    assert "of them padding" in output and "validation loss" in output
    assert "train_on_prompt = false" in (out / "config.toml").read_text()


def test_what_cannot_train_on_conversations_is_refused_before_any_work(chat_store, tmp_path):
    runner = CliRunner()
    out = tmp_path / "run"
    common = ["train", "--model", "debug", "--data", str(chat_store), "--steps", "1", "--out", str(out)]
    refused(runner.invoke(app, [*common, "--seq-len", "256", "--no-doc-mask"]), 2, "--no-doc-mask is refused",
            "instruction stores (`burst prepare --chat`)", "drop --no-doc-mask")
    longest = int(TokenStore(chat_store).document_lengths.max())
    refused(runner.invoke(app, [*common, "--doc-mask", "--seq-len", "32"]), 2,
            f"are longer than a sequence of --seq-len 32 (+ 1 label), the longest {longest} tokens",
            "set --long-conversations truncate")
    refused(runner.invoke(app, [*common, "--doc-mask", "--seq-len", "32", "--long-conversations", "truncate"]), 2,
            "their answers do not fit: set --long-conversations split")
    refused(runner.invoke(app, [*common, "--doc-mask", "--seq-len", "256", "--long-conversations", "cut"]), 2,
            "--long-conversations 'cut' is not one of refuse, truncate, split")
    plain = tmp_path / "plain"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("plain text, line after line\n" * 200)
    prepare([tmp_path / "docs"], plain, tokenizer=TokenStore(chat_store).directory, val_fraction=0, progress=False)
    refused(runner.invoke(app, ["train", "--model", "debug", "--data", str(plain), "--seq-len", "256", "--steps", "1",
                                "--train-on-prompt", "--out", str(out)]), 2,
            "--train-on-prompt scores the prompts", "no --data source is an instruction store")
    assert not out.exists()
    assert json.loads((chat_store / "metadata.json").read_text())["content"] == "conversations"
