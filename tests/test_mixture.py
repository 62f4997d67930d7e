"""Data mixtures: --data parsing and checks, the source schedule, the mixed loader, and a mixed training run."""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from burst import shard_for_rank
from cli import app
from data import SequenceLoader, prepare
from data.mixture import MixtureSchedule, SourceSpec, open_sources, parse_mixture, parse_source
from tests.fixtures import burst_train, burst_train_together, make_text, metrics
from tests.test_chat import LLAMA3_TEMPLATE, LLAMA_SPECIALS, chat_tokenizer, write_rows
from tests.test_data_loader import BOS, make_store
from tests.test_instruction_training import conversation_rows


def test_a_source_is_name_store_share_and_min_doc_read_from_the_right(tmp_path):
    (tmp_path / "s:k=v").mkdir()
    assert parse_source("books=/data/books:0.3:min_doc=65536") == SourceSpec("books", "/data/books", 0.3, 65536)
    assert parse_source("/data/web:0.7") == SourceSpec("web", "/data/web", 0.7)
    assert parse_source("stores/a:b/web", single=True) == SourceSpec("web", "stores/a:b/web", 1.0)  # ':' in a path
    assert parse_source("x=a=b:1", single=True) == SourceSpec("x", "a=b", 1.0)
    assert parse_source(f"{tmp_path}/s:k=v", single=True).path == f"{tmp_path}/s:k=v"  # a store named so, if it is
    assert parse_source('my "quoted" dir', single=True).name == "my__quoted__dir"
    spec = SourceSpec("code", "/s/code", 0.25, 100)
    assert parse_source(str(spec)) == spec  # config.toml's canonical text reads back


@pytest.mark.parametrize("texts, message", [
    (["a=/s/a:0.5", "b=/s/b:0.4"], "shares sum to 0.9, not 1"),
    (["a=/s/a:0.5", "b=/s/b"], "gives no share; with several sources each needs one"),
    (["a=/s/a:0.5", "a=/s/b:0.5"], "distinct names, ['a'] is given twice"),
    (["a=/s/a:0.5", "b=/s/a:0.5"], "names the same store twice"),
    (["a=/s/a:1.5"], "share 1.5 must be in (0, 1]"),
    (["a=/s/a:0.5:min_doc=lots", "b=/s/b:0.5"], "min_doc='lots' must be a whole number"),
    (["a=:0.5"], "names no store"),
    (["sft=/s/sft:1:mindoc=400"], "--data 'sft=/s/sft:1:mindoc=400': unknown option mindoc (did you mean min_doc?)"),
    (["a=/s/a:0.5:min-doc=4", "b=/s/b:0.5"], "unknown option min-doc (did you mean min_doc?)"),
    (["a=/s/a:shares=1"], "unknown option shares; write [NAME=]STORE[:SHARE][:min_doc=TOKENS]"),
])
def test_bad_mixtures_are_refused_naming_the_fix(texts, message):
    with pytest.raises(ValueError) as refused:
        parse_mixture(texts)
    assert message in str(refused.value)


@pytest.mark.parametrize("shares", [[0.5, 0.3, 0.2], [0.6, 0.4], [0.9, 0.1], [1 / 3, 1 / 3, 1 / 3],
                                    [0.01, 0.495, 0.495]])
def test_the_schedule_keeps_every_source_within_one_sequence_of_its_share(shares):
    schedule = MixtureSchedule(shares)
    picks = [schedule.next() for _ in range(2000)]
    for n in range(1, 2001):
        for source, share in enumerate(shares):
            assert abs(picks[:n].count(source) - share * n) < 1, (n, source)
    assert MixtureSchedule(shares).next() == picks[0]  # deterministic


@pytest.fixture
def stores(tmp_path):
    """Three stores whose tokens name their store (1xxxxx, 2xxxxx, 3xxxxx)."""
    lengths = {1: [5, 40, 3, 17, 64], 2: [2, 9, 30, 7], 3: [100, 50]}
    made = []
    for source, docs in lengths.items():
        store = make_store(tmp_path / f"s{source}", docs)
        store._tokens = np.asarray(store._tokens) + source * 100_000  # in memory: every token names its source
        made.append(store)
    return made


def source_of(row: torch.Tensor) -> set[int]:
    return {int(t) // 100_000 for t in row if t != BOS and t >= 100_000} or {0}


def test_every_sequence_comes_from_one_source_in_the_scheduled_shares(stores):
    shares = [0.5, 0.3, 0.2]
    loader = SequenceLoader(stores, seq_len=16, batch_size=5, shares=shares, seed=1)
    rows = [row for _ in range(20) for row in next(loader).tokens]
    sources = [source_of(row) for row in rows]
    assert all(len(s) == 1 for s in sources)
    counts = [sum(s == {k} for s in sources) for k in (1, 2, 3)]
    assert counts == [50, 30, 20] and loader.sequences_by_source == counts
    # each source's rows are exactly the stream its own loader gives (source 0 also seeds as a single store does)
    alone = SequenceLoader([stores[0]], seq_len=16, batch_size=1, seed=1)
    assert all(torch.equal(row, next(alone).tokens[0]) for row, s in zip(rows, sources, strict=True) if s == {1})


@pytest.mark.parametrize("dp_size, cp_size", [(2, 1), (2, 2)])
def test_mixed_batches_over_dp_and_cp_and_a_restored_loader(stores, dp_size, cp_size):
    shares, seq_len, rows = [0.5, 0.3, 0.2], 16, 2
    reference = SequenceLoader(stores, seq_len, rows * dp_size, shares=shares, seed=4)

    def rank(dp, cp):
        return SequenceLoader(stores, seq_len, rows, shares=shares, dp_rank=dp, dp_size=dp_size, cp_rank=cp,
                              cp_size=cp_size, seed=4)

    ranks = {(dp, cp): rank(dp, cp) for dp in range(dp_size) for cp in range(cp_size)}
    for step in range(6):
        if step == 3:  # every rank resumes from its state as JSON, as from a checkpoint
            states = {key: json.loads(json.dumps(loader.state_dict())) for key, loader in ranks.items()}
            ranks = {key: rank(*key) for key in ranks}
            for key, loader in ranks.items():
                loader.load_state_dict(states[key])
        full = next(reference)
        for (dp, cp), loader in ranks.items():
            part = next(loader)
            assert torch.equal(part.tokens, shard_for_rank(full.tokens[dp * rows:(dp + 1) * rows], cp, cp_size))
            assert loader.sequences_by_source == reference.sequences_by_source


def test_min_doc_keeps_long_documents_and_sources_must_share_a_tokenizer(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for i in range(12):
        (corpus / f"d{i}.py").write_text(make_text(rng, rng.randint(5, 120)))
    first = prepare([corpus], tmp_path / "a", vocab_size=320, val_fraction=0.0, progress=False).out_dir
    same = prepare([corpus], tmp_path / "b", tokenizer=first / "tokenizer.model", val_fraction=0.0,
                   progress=False).out_dir
    other = prepare([corpus], tmp_path / "c", vocab_size=330, val_fraction=0.0, progress=False).out_dir
    long_enough = int(np.median(open_sources(parse_mixture([str(first)]))[0].store.document_lengths))
    a, b = open_sources(parse_mixture([f"a={first}:0.5", f"b={same}:0.5:min_doc={long_enough}"]))
    assert a.store.num_documents == 12 and 0 < b.store.num_documents < 12
    assert b.store.document_lengths.min() >= long_enough
    with pytest.raises(ValueError, match="prepared with another tokenizer than --data a"):
        open_sources(parse_mixture([f"a={first}:0.5", f"c={other}:0.5"]))
    with pytest.raises(ValueError, match="no training document of .* has min_doc=1,000,000 tokens"):
        open_sources(parse_mixture([f"a={first}:0.5", f"b={same}:0.5:min_doc=1000000"]))


@pytest.fixture(scope="module")
def three_stores(tmp_path_factory):
    """Three token stores of one tokenizer, with different documents."""
    root = tmp_path_factory.mktemp("mix")
    stores = []
    for index, name in enumerate(("code", "books", "short")):
        corpus = root / f"{name}-docs"
        corpus.mkdir()
        rng = random.Random(index)
        for i in range(10):
            (corpus / f"d{i}.py").write_text(make_text(rng, rng.randint(40, 160) * (3 if name == "books" else 1)))
        tokenizer = {"vocab_size": 320} if not stores else {"tokenizer": stores[0] / "tokenizer.model"}
        stores.append(prepare([corpus], root / name, val_fraction=0.1, progress=False, **tokenizer).out_dir)
    return stores


def test_a_three_source_mixture_at_cp2_keeps_its_shares_and_resumes_bit_exactly(three_stores, tmp_path):
    code, books, short = three_stores
    data = ["--data", f"code={code}:0.5", "--data", f"books={books}:0.3", "--data", f"short={short}:0.2"]
    common = ["--model", "debug", *data, "--seq-len", 128, "--batch-size", 4, "--steps", 25, "--cp", 2,
              "--precision", "fp32", "--log-every", 1]
    whole, first = burst_train_together([*common, "--out", tmp_path / "whole"],
                                        [*common, "--stop-after", 11, "--out", tmp_path / "split"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    rows = metrics(tmp_path / "whole")
    assert rows[-1]["tokens_by_source"] == {"code": 50 * 128, "books": 30 * 128, "short": 20 * 128}
    for row in rows:  # within 1% of the targets at every logged step past the first few
        total = sum(row["tokens_by_source"].values())
        assert total == row["step"] * 4 * 128
        if row["step"] >= 25:
            shares = {name: tokens / total for name, tokens in row["tokens_by_source"].items()}
            assert all(abs(shares[n] - t) <= 0.01 for n, t in (("code", 0.5), ("books", 0.3), ("short", 0.2)))
    assert 'data = ["code=' in (tmp_path / "whole" / "config.toml").read_text()
    assert first.returncode == 0, first.stderr[-3000:]
    second = burst_train("--resume", "--out", tmp_path / "split")
    assert second.returncode == 0, second.stderr[-3000:]
    assert [r["loss"] for r in metrics(tmp_path / "split")] == [r["loss"] for r in rows]  # bit for bit


def test_a_mixture_whose_shares_do_not_sum_to_one_is_refused_before_any_work(three_stores, tmp_path):
    code, books, _ = three_stores
    done = burst_train("--model", "debug", "--data", f"code={code}:0.5", "--data", f"books={books}:0.4",
                       "--out", tmp_path / "run")
    assert done.returncode == 2 and "shares sum to 0.9, not 1" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def chat_stores(tmp_path_factory) -> dict[str, Path]:
    """Stores of one tokenizer's ids: documents (its files hold no chat template), and conversations rendered
    with LLaMA-3's template and with another (its date changed)."""
    root = tmp_path_factory.mktemp("chat-mix")
    templated = chat_tokenizer(root / "llama3", LLAMA_SPECIALS, LLAMA3_TEMPLATE)
    plain, dated = root / "plain", root / "dated"
    for directory, template in ((plain, None), (dated, LLAMA3_TEMPLATE.replace("26 Jul 2024", "1 Jan 2025"))):
        directory.mkdir()
        shutil.copy(templated / "tokenizer.json", directory)
        fields = {**json.loads((templated / "tokenizer_config.json").read_text()), "chat_template": template}
        (directory / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in fields.items() if v}))
    corpus = root / "docs"
    corpus.mkdir()
    rng = random.Random(3)
    for i in range(10):
        (corpus / f"d{i}.py").write_text(make_text(rng, rng.randint(40, 160)))
    rows = write_rows(root / "chat.jsonl", conversation_rows(30))
    return {"docs": prepare([corpus], root / "docs-store", tokenizer=plain, val_fraction=0, progress=False).out_dir,
            "sft": prepare([rows], root / "sft", tokenizer=templated, val_fraction=0, chat=True,
                           progress=False).out_dir,
            "dated": prepare([rows], root / "sft-dated", tokenizer=dated, val_fraction=0, chat=True,
                             progress=False).out_dir}


def test_instruction_stores_rendered_with_different_chat_templates_do_not_mix(chat_stores):
    """They used to train together silently, the export carrying neither template for sure."""
    with pytest.raises(ValueError, match=r"--data dated \(.*\) was rendered with another chat template "
                                         r"\(tokenizer_config.json\) than --data sft"):
        open_sources(parse_mixture([f"sft={chat_stores['sft']}:0.5", f"dated={chat_stores['dated']}:0.5"]))
    assert len(open_sources(parse_mixture([f"docs={chat_stores['docs']}:0.5", f"sft={chat_stores['sft']}:0.5"]))) == 2


def test_a_mixture_run_and_its_export_keep_the_chat_template_of_its_instruction_source(chat_stores, tmp_path):
    """The run kept the first source's tokenizer files only: an instruction store listed second lost its chat
    template from the run and from every export. Now it keeps that source's, and every other source's files aside."""
    out = tmp_path / "run"
    done = burst_train("--model", "debug", "--data", f"docs={chat_stores['docs']}:0.5", "--data",
                       f"sft={chat_stores['sft']}:0.5", "--seq-len", 256, "--doc-mask", "--steps", 1,
                       "--precision", "fp32", "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == LLAMA3_TEMPLATE
    kept_aside = json.loads((out / "tokenizers" / "docs" / "tokenizer_config.json").read_text())  # the other files
    assert "chat_template" not in kept_aside and (out / "tokenizers" / "docs" / "tokenizer.json").is_file()
    result = CliRunner().invoke(app, ["convert-checkpoint", str(out), str(tmp_path / "hf"), "--to", "hf"])
    assert result.exit_code == 0, result.output
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == LLAMA3_TEMPLATE
