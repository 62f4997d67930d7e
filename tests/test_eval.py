"""`burst eval`: perplexity, loss by position and passkey retrieval, through the CLI and piece by piece."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

from cli import app
from data import SequenceLoader, TokenStore, passkey_sample, prepare, train_tokenizer
from data.loader import IGNORE_INDEX
from data.passkey import FILLER, INTRO, NEEDLE, QUESTION
from evaluation import (
    EvalCheckpoint,
    EvalConfig,
    evaluate,
    evaluate_passkey,
    greedy_answer,
    load_for_eval,
)
from evaluation.distributed import use_burst_attention
from evaluation.perplexity import available_sequences, bucket_starts
from models import (
    ModelConfig,
    Transformer,
    chunked_cross_entropy,
    convert_checkpoint,
    init_model,
    load_model,
    save_model,
    token_losses,
)
from tests.distributed import run_on_ranks

SEQ_LEN = 128
DOCUMENT_SEQ_LEN = 512  # about half of the fixture's validation documents (422 to 722 tokens) are this long
NOUNS = ["cat", "dog", "ring", "rank", "shard", "tensor", "model", "token", "grass", "sky"]
VERBS = ["sees", "sends", "holds", "keeps", "finds", "splits"]


def make_document(rng: random.Random) -> str:
    """Generated prose with some structure to learn, and the passkey texts so the tokenizer knows them."""
    sentences = [f"The {rng.choice(NOUNS)} {rng.choice(VERBS)} the {rng.choice(NOUNS)} {rng.randrange(100)} times."
                 for _ in range(rng.randint(20, 60))]
    return " ".join(sentences) + f" {INTRO} {FILLER} {NEEDLE.format(passkey=rng.randrange(10**5))} {QUESTION}\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> TokenStore:
    rng = random.Random(0)
    corpus = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (corpus / f"doc{i}.txt").write_text(make_document(rng))
    out = tmp_path_factory.mktemp("store") / "store"
    prepare([corpus], out, vocab_size=400, val_fraction=0.2, progress=False)
    return TokenStore(out)


@pytest.fixture(scope="module")
def checkpoint(store, tmp_path_factory):
    """A `debug` model after a few optimisation steps on the store, saved as a native model directory."""
    config = ModelConfig.from_name("debug")
    model = init_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    loader = SequenceLoader(store.split("train"), SEQ_LEN, batch_size=2)
    for _ in range(20):
        batch = next(loader)
        loss_sum, count = model.loss(batch.tokens, batch.labels, batch.positions)
        optimizer.zero_grad()
        (loss_sum / count).backward()
        optimizer.step()
    path = tmp_path_factory.mktemp("ckpt") / "debug"
    save_model(model, config, path)
    return path


def reference_loss(model: Transformer, split: TokenStore, sequences: int) -> tuple[float, int]:
    """Token-weighted mean loss of the first validation sequences from full logits and F.cross_entropy."""
    loader = SequenceLoader(split, SEQ_LEN, batch_size=1)
    total, count = 0.0, 0
    with torch.no_grad():
        for _ in range(sequences):
            batch = next(loader)
            logits = model(batch.tokens)  # [1, seq, vocab]: fine at this size
            total += F.cross_entropy(logits[0], batch.labels[0], ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += int((batch.labels != IGNORE_INDEX).sum())
    return total / count, count


def invoke(*args: str):
    return CliRunner().invoke(app, ["eval", *map(str, args)])


def test_cli_writes_json_and_plot_with_consistent_figures(store, checkpoint, tmp_path):
    out = tmp_path / "report" / "eval.json"
    result = invoke("--checkpoint", checkpoint, "--data", store.directory, "--seq-len", SEQ_LEN, "--batches", 3,
                    "--buckets", 4, "--passkey-lengths", "128,256", "--passkey-depths", "0,0.5,1",
                    "--passkey-trials", 2, "--json", out)
    assert result.exit_code == 0, result.output
    assert "loss by position in packed sequence" in result.output and "passkey retrieval accuracy" in result.output
    report = json.loads(out.read_text())

    loss, count = reference_loss(load_model(checkpoint), store.split("val"), sequences=3)
    assert report["positions"] == "packed" and report["sequences"] == 3 and report["tokens"] == count
    assert report["loss"] == pytest.approx(loss, rel=1e-5)
    assert report["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert 1.5 < report["loss"] < math.log(400)  # trained: well below uniform over the tokenizer's vocabulary

    buckets = report["loss_by_position"]
    assert [(b["start"], b["end"]) for b in buckets] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert sum(b["tokens"] for b in buckets) == count
    assert sum(b["mean_loss"] * b["tokens"] for b in buckets) / count == pytest.approx(loss, rel=1e-5)

    passkey = report["passkey"]
    assert passkey["lengths"] == [128, 256] and passkey["depths"] == [0.0, 0.5, 1.0]
    assert len(passkey["grid"]) == 2 and all(len(row) == 3 for row in passkey["grid"])
    assert all(0 <= a <= 1 for row in passkey["grid"] for a in row)
    assert all(c["trials"] == 2 and c["accuracy"] == c["retrieved"] / 2 for c in passkey["cells"])
    assert passkey["accuracy"] == pytest.approx(sum(map(sum, passkey["grid"])) / 6)
    assert report["warnings"] == []

    plot = out.with_suffix(".png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_hugging_face_directory_gives_the_native_figures(store, checkpoint, tmp_path):
    hf = convert_checkpoint(checkpoint, tmp_path / "hf", to="hf")
    opened = load_for_eval(hf)
    assert opened.format == "hf" and load_for_eval(checkpoint).format == "burst"
    tokens = torch.from_numpy(store.document(0)[:64].astype("int64"))[None]  # [1, 64]
    with torch.no_grad():
        assert torch.equal(opened.model()(tokens), load_model(checkpoint)(tokens))
    figures = [evaluate(EvalConfig(checkpoint=path, data=store.directory, seq_len=SEQ_LEN, batches=2, buckets=2,
                                   passkey_trials=0)).perplexity for path in (checkpoint, hf)]
    assert figures[0] == figures[1]


class NextTokenOracle(nn.Module):
    """A rigged model whose greedy prediction at every position is the next token of its input (or the current one)."""

    def __init__(self, vocab_size: int, shift: int = 1):
        super().__init__()
        self.output_weight = torch.eye(vocab_size)  # hidden states are one-hot logits
        self.shift = shift

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor, rope_length: int) -> torch.Tensor:
        return F.one_hot(tokens.roll(-self.shift, dims=1), self.output_weight.shape[0]).float()


def test_passkey_scoring_reads_exactly_the_answer_positions(store):
    tokenizer = store.tokenizer()
    oracle = NextTokenOracle(tokenizer.vocab_size)
    sample = passkey_sample(tokenizer, 200, 0.5, seed=3)
    assert greedy_answer(oracle, sample) == sample.answer_ids
    result = evaluate_passkey(oracle, tokenizer, [128, 200], [0.0, 1.0], trials=3)
    assert result.accuracy == 1.0 and [c.retrieved for c in result.cells] == [3, 3, 3, 3]
    off_by_one = evaluate_passkey(NextTokenOracle(tokenizer.vocab_size, shift=0), tokenizer, [128], [0.5], trials=3)
    assert off_by_one.accuracy == 0.0


def test_token_losses_match_the_chunked_cross_entropy():
    torch.manual_seed(0)
    hidden, weight = torch.randn(37, 16), torch.randn(50, 16)
    labels = torch.randint(0, 50, (37,))
    labels[[0, 5, 36]] = IGNORE_INDEX
    losses = token_losses(hidden, weight, labels, chunk_size=8)
    loss_sum, count = chunked_cross_entropy(hidden, weight, labels)
    assert losses[[0, 5, 36]].eq(0).all() and count == 34
    assert losses.sum().item() == pytest.approx(loss_sum.item(), rel=1e-6)
    assert torch.allclose(losses, F.cross_entropy(hidden @ weight.t(), labels, reduction="none"), atol=1e-5)


def test_buckets_and_available_sequences(store):
    assert bucket_starts(128, 4) == [0, 32, 64, 96] and bucket_starts(10, 3) == [0, 4, 7]
    val = store.split("val")
    stream = int(val.document_lengths.sum()) + 2 * val.num_documents
    assert available_sequences(val, SEQ_LEN) == (stream - 1) // SEQ_LEN
    loader = SequenceLoader(val, SEQ_LEN, batch_size=1)
    for _ in range(available_sequences(val, SEQ_LEN)):
        next(loader)
    # every available sequence, and the label after it, lies inside the first pass over the split
    assert loader.sequences_by_source[0] * SEQ_LEN + 1 <= loader.streams[0].epoch_tokens


def test_a_model_with_a_short_context_is_warned_about(store, checkpoint, tmp_path):
    short = tmp_path / "short"
    config = dataclasses.replace(ModelConfig.from_name("debug"), max_seq_len=64)
    save_model(load_model(checkpoint), config, short)
    result = evaluate(EvalConfig(checkpoint=short, data=store.directory, seq_len=SEQ_LEN, batches=1000,
                                 passkey_trials=0))
    assert result.passkey is None and result.perplexity.sequences == available_sequences(store.split("val"), SEQ_LEN)
    assert any("longer than the model's max_seq_len 64" in w for w in result.warnings)
    assert any("not --batches 1000" in w for w in result.warnings)


def test_bad_input_is_refused_before_any_work(store, checkpoint, tmp_path):
    def refused(*args) -> str:
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        return " ".join(result.output.split())  # rich wraps long lines

    data = ("--data", store.directory)
    assert "does not exist" in refused("--checkpoint", tmp_path / "nope", *data)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"hello": 1}')
    assert "is not a recognised checkpoint" in refused("--checkpoint", tmp_path / "odd", *data)
    assert "multiple of 2 x world size = 4" in refused("--checkpoint", checkpoint, *data, "--seq-len", 130, "--cp", 2)
    assert "--passkey-lengths: sequence length 130" in refused("--checkpoint", checkpoint, *data, "--seq-len", 128,
                                                                "--passkey-lengths", 130, "--cp", 2)
    assert "needs at least" in refused("--checkpoint", checkpoint, *data, "--seq-len", 128, "--passkey-lengths", 16)
    assert "not enough for one sequence of 65,536" in refused("--checkpoint", checkpoint, *data, "--seq-len", 65536)
    assert "--positions 'depth' is not one of packed, document" in refused("--checkpoint", checkpoint, *data,
                                                                            "--positions", "depth")
    assert "--precision 'fp8'" in refused("--checkpoint", checkpoint, *data, "--precision", "fp8")
    assert "--buckets 0" in refused("--checkpoint", checkpoint, *data, "--buckets", 0)
    assert "depth 2.0 must be in [0, 1]" in refused("--checkpoint", checkpoint, *data, "--passkey-depths", "0,2")

    no_val = tmp_path / "no-val"
    (tmp_path / "one.txt").write_text("def only(document):\n    return document\n")
    prepare([tmp_path / "one.txt"], no_val, tokenizer=store.directory, val_fraction=0, progress=False)
    assert "validation split" in refused("--checkpoint", checkpoint, "--data", no_val, "--seq-len", 64)

    small_vocab = tmp_path / "small-vocab"
    save_model(init_model(dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=300)),
               dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=300), small_vocab)
    assert "has a vocabulary of 300" in refused("--checkpoint", small_vocab, *data)
    other_tokenizer = tmp_path / "other-tokenizer"
    convert_checkpoint(checkpoint, other_tokenizer, to="burst")
    train_tokenizer([f"other {i} text\n" for i in range(300)], other_tokenizer / "tokenizer.model", vocab_size=320)
    assert "was prepared with another tokenizer than the model" in refused("--checkpoint", other_tokenizer, *data)
    (other_tokenizer / "tokenizer.model").write_bytes(b"not the store's tokenizer")
    assert "tokenizer.model is not a SentencePiece .model file" in refused("--checkpoint", other_tokenizer, *data)


def long_validation_documents(store: TokenStore) -> list[int]:
    """Indices of the validation documents document mode may score, found independently of evaluation/."""
    return [i for i, length in enumerate(store.split("val").document_lengths.tolist()) if length >= DOCUMENT_SEQ_LEN]


def test_document_mode_scores_the_starts_of_long_enough_documents(store, checkpoint, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    long_enough = long_validation_documents(store)
    assert long_enough[:3] != [0, 1, 2]  # short documents come first and must be skipped
    x_labels, savefig = [], Figure.savefig

    def savefig_noting_the_x_label(figure, *args, **kwargs):
        x_labels.append(figure.axes[0].get_xlabel())
        savefig(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig_noting_the_x_label)
    out = tmp_path / "document.json"
    result = invoke("--checkpoint", checkpoint, "--data", store.directory, "--seq-len", DOCUMENT_SEQ_LEN,
                    "--batches", 3, "--buckets", 4, "--positions", "document", "--passkey-trials", 0, "--json", out)
    assert result.exit_code == 0, result.output
    assert "loss by depth into document (tokens)" in result.output
    assert x_labels == ["depth into document (tokens), bucket centre"]
    report = json.loads(out.read_text())
    assert report["positions"] == "document" and report["warnings"] == []
    assert report["sequences"] == 3 and report["tokens"] == 3 * DOCUMENT_SEQ_LEN
    assert [b["tokens"] for b in report["loss_by_position"]] == [3 * DOCUMENT_SEQ_LEN // 4] * 4

    val, model = store.split("val"), load_model(checkpoint)
    losses = []
    with torch.no_grad():
        for index in long_enough[:3]:
            document = torch.from_numpy(val.document(index)[:DOCUMENT_SEQ_LEN].astype("int64"))  # [seq]
            inputs = torch.cat([torch.tensor([store.bos_id]), document[:-1]])[None]  # [1, seq]
            losses.append(F.cross_entropy(model(inputs)[0], document, reduction="none"))  # [seq]
    by_depth = torch.stack(losses).view(3, 4, DOCUMENT_SEQ_LEN // 4)  # [documents, buckets, bucket tokens]
    assert report["loss"] == pytest.approx(by_depth.mean().item(), rel=1e-5)
    assert [b["mean_loss"] for b in report["loss_by_position"]] == pytest.approx(
        by_depth.mean(dim=(0, 2)).tolist(), rel=1e-5)


def test_document_mode_needs_a_long_enough_document_and_warns_when_there_are_few(store, checkpoint, monkeypatch):
    val = store.split("val")
    longest = int(val.document_lengths.max())

    def no_weights(*_):
        raise AssertionError("weights were read before the input was checked")

    with monkeypatch.context() as patch:
        patch.setattr(EvalCheckpoint, "model", no_weights)
        with pytest.raises(ValueError, match=rf"holds {val.num_documents} documents, the longest of {longest} "
                                             r"tokens; lower --seq-len, or prepare a store with longer documents"):
            evaluate(EvalConfig(checkpoint=checkpoint, data=store.directory, seq_len=longest + 2 - longest % 2,
                                positions="document", passkey_trials=0))

    long_enough = long_validation_documents(store)
    result = evaluate(EvalConfig(checkpoint=checkpoint, data=store.directory, seq_len=DOCUMENT_SEQ_LEN, batches=100,
                                 positions="document", passkey_trials=0))
    assert result.warnings == [f"the validation split holds {len(long_enough)} documents of at least "
                               f"{DOCUMENT_SEQ_LEN} tokens; scoring {len(long_enough)}, not --batches 100"]
    assert result.perplexity.sequences == len(long_enough)
    assert result.perplexity.tokens == len(long_enough) * DOCUMENT_SEQ_LEN


def cp_config(checkpoint, store: TokenStore, cp: int) -> EvalConfig:
    return EvalConfig(checkpoint=checkpoint, data=store.directory, seq_len=SEQ_LEN, batches=3, buckets=4,
                      passkey_lengths=[128, 256], passkey_depths=[0.0, 1.0], passkey_trials=2, cp=cp)


def _evaluate_on_ranks(rank: int, world_size: int, checkpoint, store_dir, expected: dict) -> None:
    store = TokenStore(store_dir)
    result = evaluate(cp_config(checkpoint, store, cp=world_size))
    assert abs(result.perplexity.perplexity - expected["perplexity"]) < 1e-4
    assert result.perplexity.tokens == expected["tokens"]
    for bucket, loss in zip(result.perplexity.loss_by_position, expected["bucket_losses"], strict=True):
        assert abs(bucket.mean_loss - loss) < 1e-5
    assert [c.retrieved for c in result.passkey.cells] == expected["retrieved"]
    model = load_for_eval(checkpoint).model()
    use_burst_attention(model, dist.group.WORLD)
    sample = passkey_sample(store.tokenizer(), 256, 0.5, seed=1)
    assert greedy_answer(model, sample, dist.group.WORLD) == expected["greedy"]


def test_two_context_parallel_ranks_give_the_single_process_figures(store, checkpoint):
    single = evaluate(cp_config(checkpoint, store, cp=1))
    sample = passkey_sample(store.tokenizer(), 256, 0.5, seed=1)
    expected = {"perplexity": single.perplexity.perplexity, "tokens": single.perplexity.tokens,
                "bucket_losses": [b.mean_loss for b in single.perplexity.loss_by_position],
                "retrieved": [c.retrieved for c in single.passkey.cells],
                "greedy": greedy_answer(load_for_eval(checkpoint).model(), sample)}
    run_on_ranks(_evaluate_on_ranks, world_size=2, args=(checkpoint, store.directory, expected))


def document_config(checkpoint, store_dir, cp: int) -> EvalConfig:
    return EvalConfig(checkpoint=checkpoint, data=store_dir, seq_len=DOCUMENT_SEQ_LEN, batches=2, buckets=4,
                      positions="document", passkey_trials=0, cp=cp)


def _evaluate_documents_on_ranks(rank: int, world_size: int, checkpoint, store_dir, expected: dict) -> None:
    result = evaluate(document_config(checkpoint, store_dir, cp=world_size)).perplexity
    assert result.tokens == expected["tokens"] and result.positions == "document"
    assert abs(result.perplexity - expected["perplexity"]) < 1e-4
    for bucket, loss in zip(result.loss_by_position, expected["bucket_losses"], strict=True):
        assert abs(bucket.mean_loss - loss) < 1e-4


def test_two_context_parallel_ranks_give_the_single_process_figures_by_document_depth(store, checkpoint):
    single = evaluate(document_config(checkpoint, store.directory, cp=1)).perplexity
    assert single.tokens == 2 * DOCUMENT_SEQ_LEN
    expected = {"perplexity": single.perplexity, "tokens": single.tokens,
                "bucket_losses": [b.mean_loss for b in single.loss_by_position]}
    run_on_ranks(_evaluate_documents_on_ranks, world_size=2, args=(checkpoint, store.directory, expected))


def test_cli_starts_the_context_parallel_ranks_itself(store, checkpoint, tmp_path):
    out = tmp_path / "cp2.json"
    result = invoke("--checkpoint", checkpoint, "--data", store.directory, "--seq-len", SEQ_LEN, "--batches", 2,
                    "--passkey-trials", 0, "--cp", 2, "--json", out)
    assert result.exit_code == 0, result.output
    single = evaluate(EvalConfig(checkpoint=checkpoint, data=store.directory, seq_len=SEQ_LEN, batches=2,
                                 passkey_trials=0))
    report = json.loads(out.read_text())
    assert report["cp"] == 2 and report["passkey"] is None and report["tokens"] == single.perplexity.tokens
    assert abs(report["perplexity"] - single.perplexity.perplexity) < 1e-4


def test_a_world_that_does_not_match_cp_is_refused(store, checkpoint, monkeypatch):
    monkeypatch.setenv("RANK", "0")  # as torchrun would start us
    monkeypatch.setenv("WORLD_SIZE", "3")
    for cp in (1, 2):
        result = invoke("--checkpoint", checkpoint, "--data", store.directory, "--seq-len", SEQ_LEN, "--cp", cp)
        assert result.exit_code == 2
        assert f"--cp {cp} evaluates on {cp} ranks but 3 processes were started" in " ".join(result.output.split())


def test_without_matplotlib_the_plot_is_skipped_and_the_json_says_how_to_get_it(store, checkpoint, tmp_path,
                                                                                  monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    out = tmp_path / "eval.json"
    evaluate(EvalConfig(checkpoint=checkpoint, data=store.directory, seq_len=SEQ_LEN, batches=1, passkey_trials=0,
                        json_path=out))
    assert not out.with_suffix(".png").exists()
    assert "pip install 'burst-attention[plot]'" in json.loads(out.read_text())["warnings"][-1]
    # printed whole: the hint's [plot] is no markup, and a line into a pipe is not wrapped at 80 columns
    err = capsys.readouterr().err
    assert "perplexity: sequence 1 of 1 scored" in err  # a progress line per sequence scored
    warning = next(line for line in err.splitlines() if "was skipped" in line)
    assert len(warning) > 80 and warning.endswith("(pip install 'burst-attention[plot]')")


def test_passkey_retrieval_says_how_far_it_is_on_stderr(store, checkpoint, capsys):
    """A progress line after the first, every tenth and the last sample, on stderr: stdout holds only the results."""
    evaluate(EvalConfig(checkpoint=checkpoint, data=store.directory, seq_len=SEQ_LEN, batches=1,
                        passkey_lengths=[SEQ_LEN], passkey_depths=[0.0, 0.25, 0.5, 0.75, 1.0], passkey_trials=2))
    out, err = capsys.readouterr()
    said = [line.split(" (")[0] for line in err.splitlines() if "samples answered" in line]
    assert said == ["passkey: 1/10 samples answered", "passkey: 10/10 samples answered"], err
    assert "samples answered" not in out and "passkey retrieval" in out


def test_a_run_is_scored_on_the_store_it_trained_on_without_data(store, tmp_path):
    """A run on the user's own data (its own tokenizer): the embedded corpus would be refused by the tokenizer
    check; without --data, eval takes the run's recorded store and scores what --data STORE scores."""
    out = tmp_path / "run"
    done = CliRunner().invoke(app, ["train", "--model", "debug", "--data", str(store.directory), "--seq-len", "64",
                                    "--steps", "1", "--precision", "fp32", "--val-tokens", "0", "--out", str(out)])
    assert done.exit_code == 0, done.output
    common = ("--seq-len", 64, "--batches", 2, "--passkey-trials", 0)
    implied = invoke("--checkpoint", out, *common, "--json", tmp_path / "implied.json")
    assert implied.exit_code == 0, implied.output
    given = invoke("--checkpoint", out / "checkpoints" / "step-000001", "--data", store.directory, *common,
                   "--json", tmp_path / "given.json")
    assert given.exit_code == 0, given.output
    figures = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("implied", "given")]
    assert figures[0]["data"] == str(store.directory) and figures[0]["perplexity"] == figures[1]["perplexity"]
