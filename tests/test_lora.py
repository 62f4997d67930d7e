"""LoRA (models/lora.py) on SmolLM2-135M against Hugging Face PEFT on transformers' model: the same loss and adapter
gradients at cp 1, cp 2 and dp 2; `--to peft` loads in PEFT with burst's logits, `--to hf` merges them; a PEFT
adapter starts a run (--init-adapter); a LoRA DPO run's reference is the base model's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from typer.testing import CliRunner

from checkpoints import read_checkpoint
from cli import app
from data import SequenceLoader, TokenStore
from data.loader import IGNORE_INDEX
from models import Transformer
from models.convert import read_checkpoint as read_model
from models.lora import TARGETS, LoRAConfig, apply_lora, merged
from tests.distributed import run_on_ranks
from tests.fixtures import burst_train, burst_train_together, metrics
from tests.test_instruction_training import hf_model as hf_of_burst
from tests.test_instruction_training import model_config
from tests.test_parallelize import full_batch, rank_batches
from tests.test_preference import make_pair_store
from tests.test_smollm2 import corpus, hf_model, store  # noqa: F401 -- fixtures
from trainer.config import TrainConfig
from trainer.distributed import Distributed
from trainer.parallelize import build_model, model_name
from trainer.preference import compute_reference
from trainer.step import train_step

ALL = ",".join(TARGETS)
SEQ_LEN = 128


def peft_adapter(base: Path, out: Path, rank: int = 4) -> Path:
    """A PEFT adapter on every linear layer with random A and B (a non-zero update), saved to `out`."""
    torch.manual_seed(0)
    model = peft.get_peft_model(hf_model(base), peft.LoraConfig(
        r=rank, lora_alpha=8, target_modules=[hf for _, hf in TARGETS.values()], init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    model.save_pretrained(out)
    return out


def peft_loss_and_gradients(base: Path, adapter: Path) -> tuple[float, dict[str, torch.Tensor]]:
    """PEFT's mean token loss of test_parallelize's batch and its adapter gradients, under burst's names."""
    model = peft.PeftModel.from_pretrained(hf_model(base), adapter, is_trainable=True)
    tokens, labels = full_batch()
    logits = model(input_ids=tokens).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    by_hf = {hf: target for target, (_, hf) in TARGETS.items()}
    gradients = {}
    for name, param in model.named_parameters():
        if "lora_" in name:  # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
            parts = name.split(".")
            layer, module, matrix = parts[4], parts[6], parts[7]
            gradients[f"layers.{layer}.{TARGETS[by_hf[module]][0]}.lora_{matrix[-1].lower()}"] = param.grad.clone()
    return loss.item(), gradients


def config_for(base: Path, adapter: Path, cp: int, dp: int) -> TrainConfig:
    return TrainConfig(model=str(base), init_adapter=str(adapter), seq_len=64, cp=cp, dp=dp, batch_size=2 // dp,
                       precision="fp32", max_grad_norm=0.0)


def adapter_step(config: TrainConfig, env: Distributed, dp_rank: int, cp_rank: int, base: Path):
    """The loss and the adapters' gradients (full tensors) of one step on this rank's share."""
    model = build_model(read_model(base).config, env.mesh, config, env.device, checkpoint=base)
    trainable = {model_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)  # the rest frozen
    optimizer = torch.optim.SGD(trainable.values(), lr=1.0)
    before = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in trainable.items()}
    result = train_step(model, optimizer, rank_batches(dp_rank, config.dp, cp_rank, config.cp, 1), config, env)
    after = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in trainable.items()}
    assert not any(p.grad is not None for p in model.parameters() if not p.requires_grad)
    return result.loss, {name: before[name] - after[name] for name in before}


def check_against_peft(loss, gradients, expected) -> None:
    want_loss, want_gradients = expected
    assert loss == pytest.approx(want_loss, abs=1e-5)
    assert set(gradients) == set(want_gradients)
    for name, grad in want_gradients.items():
        torch.testing.assert_close(gradients[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _layout(rank, world_size, base, adapter, cp, dp, expected):
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    env = Distributed(rank, world_size, torch.device("cpu"), mesh)
    loss, gradients = adapter_step(config_for(base, adapter, cp, dp), env, mesh["dp"].get_local_rank(),
                                   mesh["cp"].get_local_rank(), base)
    check_against_peft(loss, gradients, expected)


@pytest.fixture(scope="module")
def random_adapter(smollm2_2_layers, tmp_path_factory) -> Path:
    return peft_adapter(smollm2_2_layers, tmp_path_factory.mktemp("adapter") / "peft")


def test_lora_loss_and_adapter_gradients_equal_peft_at_cp1_cp2_dp2(smollm2_2_layers, random_adapter):
    expected = peft_loss_and_gradients(smollm2_2_layers, random_adapter)
    loss, gradients = adapter_step(config_for(smollm2_2_layers, random_adapter, 1, 1),
                                   Distributed(0, 1, torch.device("cpu"), None), 0, 0, smollm2_2_layers)
    check_against_peft(loss, gradients, expected)
    for cp, dp in ((2, 1), (1, 2)):
        run_on_ranks(_layout, world_size=2, args=(smollm2_2_layers, random_adapter, cp, dp, expected))


def test_a_bf16_run_keeps_the_frozen_linear_weights_in_bf16_and_computes_the_same_values(smollm2_2_layers,
                                                                                        random_adapter):
    """On a CPU bf16 is autocast over float32 weights, which rounds every linear layer's weight to bf16 before each
    use: keeping the frozen ones in bf16 (trainer/parallelize.py's keep_frozen_in_bf16) drops their float32 copy
    and changes no value. The reference keeps them in float32 (built as an fp32 run) and steps under the same
    autocast."""
    env = Distributed(0, 1, torch.device("cpu"), None)
    bf16 = dataclasses.replace(config_for(smollm2_2_layers, random_adapter, 1, 1), precision="bf16")
    models = [build_model(read_model(smollm2_2_layers).config, None, config, env.device, checkpoint=smollm2_2_layers)
              for config in (bf16, dataclasses.replace(bf16, precision="fp32"))]
    frozen_linears = {f"layers.{block}.{linear}.weight" for block in range(2) for linear, _ in TARGETS.values()}
    dtypes = {model_name(name): param.dtype for name, param in models[0].named_parameters()}
    assert len(dtypes) > len(frozen_linears) and "tok_embeddings.weight" in dtypes and "norm.weight" in dtypes
    # adapters, embeddings and norms stay float32: they train, or compute in float32 under CPU autocast
    assert dtypes == {name: torch.bfloat16 if name in frozen_linears else torch.float32 for name in dtypes}
    assert all(param.dtype == torch.float32 for param in models[1].parameters())
    losses, gradients = [], []
    for model in models:
        trainable = [param for param in model.parameters() if param.requires_grad]
        before = [param.detach().clone() for param in trainable]
        optimizer = torch.optim.SGD(trainable, lr=1.0)  # the step's change is the gradient
        losses.append(train_step(model, optimizer, rank_batches(0, 1, 0, 1, 1), bf16, env).loss)
        gradients.append([old - param.detach() for old, param in zip(before, trainable, strict=True)])
    assert losses[0] == losses[1] and all(change.any() for change in gradients[0])
    assert all(torch.equal(kept, reference) for kept, reference in zip(*gradients, strict=True))


def test_a_merged_weight_keeps_a_small_update_to_a_bf16_frozen_weight():
    """A bf16 run's frozen weights are bf16; the merged export (W + B A alpha / rank) is float32, or bf16's 8 bits
    of mantissa would round most of a small adapter update away."""
    lora = LoRAConfig(rank=4, alpha=8)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=generator).to(torch.bfloat16)
    lora_a, lora_b = torch.randn(4, 32, generator=generator) * 1e-2, torch.randn(64, 4, generator=generator) * 1e-3
    result = merged(weight, lora_a, lora_b, lora)
    assert result.dtype == torch.float32
    # within float32 rounding of W + update (|W| < 5: 3e-7), where bf16 would be 8e-3 off at |W| = 1
    torch.testing.assert_close(result - weight.float(), (lora_b @ lora_a) * lora.scaling, rtol=0, atol=3e-7)


def burst_lora_logits(base: Path, run: Path, tokens: torch.Tensor) -> torch.Tensor:
    """burst's own LoRA model: the base weights with the run's adapters beside them (not merged)."""
    adapter = read_checkpoint(run).adapter()
    base_checkpoint = read_model(base)
    model = apply_lora(Transformer(base_checkpoint.config), adapter.lora)
    model.load_state_dict({**dict(base_checkpoint.tensors()), **adapter.tensors})
    with torch.no_grad():
        return model(tokens)


def run_flags(model: Path, token_store) -> tuple:
    """The flags the adapter tests' runs share: the model, the store, fp32, no validation."""
    return ("--model", model, "--data", token_store.directory, "--seq-len", SEQ_LEN, "--val-tokens", 0,
            "--precision", "fp32")


def check_first_loss_is_peft(common: tuple, adapter: Path, out: Path, peft_logits: torch.Tensor, batch) -> None:
    """A run started from the PEFT directory `adapter` has PEFT's loss on `batch` as its first."""
    done = burst_train(*common, "--steps", 1, "--init-adapter", adapter, "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    want = F.cross_entropy(peft_logits[0], batch.labels[0], ignore_index=IGNORE_INDEX).item()
    assert metrics(out)[0]["loss"] == pytest.approx(want, rel=1e-5)


def test_a_trained_adapter_exports_to_peft_and_merged_and_starts_a_run(smollm2_2_layers, tmp_path,
                                                                        store):  # noqa: F811
    out = tmp_path / "run"
    common = run_flags(smollm2_2_layers, store)
    done = burst_train(*common, "--steps", 2, "--lr", 1e-2, "--warmup", 1, "--lora-rank", 4, "--lora-alpha", 8,
                       "--lora-targets", ALL, "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    for to in ("peft", "hf"):
        converted = CliRunner().invoke(app, ["convert-checkpoint", str(out), str(tmp_path / to), "--to", to])
        assert converted.exit_code == 0, converted.output
    refused = CliRunner().invoke(app, ["convert-checkpoint", str(smollm2_2_layers), str(tmp_path / "x"),
                                       "--to", "peft"])
    assert refused.exit_code == 2 and "holds no LoRA adapter" in refused.output

    batch = next(SequenceLoader(store.split("train"), SEQ_LEN, batch_size=1, seed=0))
    with torch.no_grad():
        trained = peft.PeftModel.from_pretrained(hf_model(smollm2_2_layers), tmp_path / "peft")
        peft_logits = trained(input_ids=batch.tokens).logits
        merged_logits = hf_model(tmp_path / "hf")(input_ids=batch.tokens).logits
        base_logits = hf_model(smollm2_2_layers)(input_ids=batch.tokens).logits
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapter trained
    torch.testing.assert_close(burst_lora_logits(smollm2_2_layers, out, batch.tokens), peft_logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(merged_logits, peft_logits, rtol=0, atol=1e-4)

    # the exported adapter starts a run: its first loss is PEFT's
    check_first_loss_is_peft(common, tmp_path / "peft", tmp_path / "started", peft_logits, batch)


def test_trained_embeddings_and_norms_export_as_peft_modules_to_save_and_start_a_run(smollm2_2_layers, tmp_path,
                                                                                     store):  # noqa: F811
    out = tmp_path / "run"
    common = run_flags(smollm2_2_layers, store)
    done = burst_train(*common, "--steps", 2, "--lr", 1e-2, "--warmup", 1, "--lora-rank", 4, "--lora-alpha", 8,
                       "--lora-targets", "q,v,down", "--train-embeddings-and-norms", "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    converted = CliRunner().invoke(app, ["convert-checkpoint", str(out), str(tmp_path / "peft"), "--to", "peft"])
    assert converted.exit_code == 0, converted.output

    batch = next(SequenceLoader(store.split("train"), SEQ_LEN, batch_size=1, seed=0))
    base = hf_model(smollm2_2_layers)
    with torch.no_grad():
        trained = peft.PeftModel.from_pretrained(hf_model(smollm2_2_layers), tmp_path / "peft")
        peft_logits = trained(input_ids=batch.tokens).logits
        saved = {name for name, _ in trained.named_parameters() if ".modules_to_save." in name}
        assert any("embed_tokens" in name for name in saved) and any("layernorm" in name for name in saved)
        embeddings = trained.get_input_embeddings().weight  # PEFT's trained copy of the tied matrix
        assert (embeddings - base.get_input_embeddings().weight).abs().max() > 1e-4
        base_logits = base(input_ids=batch.tokens).logits
    assert (peft_logits - base_logits).abs().max() > 1e-3
    torch.testing.assert_close(burst_lora_logits(smollm2_2_layers, out, batch.tokens), peft_logits, rtol=0, atol=1e-4)

    # read back as --init-adapter, embeddings and norms included: PEFT's loss
    check_first_loss_is_peft(common, tmp_path / "peft", tmp_path / "started", peft_logits, batch)


def test_a_lora_dpo_runs_reference_is_the_base_models(tmp_path):
    store_dir = make_pair_store(tmp_path)
    pairs = TokenStore(store_dir).split("train")
    config = TrainConfig(model="debug", seq_len=384, batch_size=2, precision="fp32", doc_mask=True, seed=3,
                         objective="dpo", prefix_sharing=False, lora_rank=4, lora_targets=ALL)
    env = Distributed(0, 1, torch.device("cpu"), None)
    model = build_model(model_config(pairs), None, config, env.device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.normal_(0, 0.05)  # an adapter that changes the model: the reference must not see it
    reference = compute_reference(model, pairs, config, env)
    base = hf_of_burst(build_model(model_config(pairs), None, TrainConfig(model="debug", seed=3, precision="fp32"),
                                   env.device), model_config(pairs)).eval()
    with torch.no_grad():
        with_adapter = model(torch.from_numpy(pairs.document(0).astype(np.int64))[None])
        without = base(input_ids=torch.from_numpy(pairs.document(0).astype(np.int64))[None]).logits
    assert (with_adapter - without).abs().max() > 1e-3
    for document in range(pairs.num_documents):
        prompt, chosen, _ = pairs.pair_lengths_of(document)
        ids = torch.from_numpy(pairs.document(document).astype(np.int64))
        for column, answer in enumerate((ids[prompt:prompt + chosen], ids[prompt + chosen:])):
            with torch.no_grad():
                logits = base(input_ids=torch.cat([ids[:prompt], answer])[None]).logits[0]
            want = logits[prompt - 1:-1].log_softmax(-1).gather(1, answer[:, None]).sum().item()
            assert reference[document, column] == pytest.approx(want, abs=1e-4), (document, column)


def test_lora_settings_are_refused_in_one_line():
    for settings, message in ((dict(lora_rank=-1), "--lora-rank -1"), (dict(lora_rank=4, lora_targets="q,x"),
                                                                       "--lora-targets"),
                              (dict(lora_rank=4, lora_dropout=1.0), "--lora-dropout"),
                              (dict(train_embeddings_and_norms=True), "--train-embeddings-and-norms"),
                              (dict(mlp_tile=-1), "--mlp-tile"), (dict(loss_tile=0), "--loss-tile")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(**settings)
    assert LoRAConfig(rank=8, alpha=16).scaling == 2.0
    assert TrainConfig(offload_activations=True).activation_checkpointing == "full"  # what it offloads


def test_a_lora_run_with_dropout_resumes_exactly(tmp_path):
    common = ("--model", "debug", "--seq-len", 128, "--steps", 4, "--lora-rank", 4, "--lora-dropout", 0.1,
              "--val-tokens", 0, "--precision", "fp32")
    runs = burst_train_together((*common, "--out", tmp_path / "whole"),
                                (*common, "--stop-after", 2, "--out", tmp_path / "resumed"))
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
    done = burst_train("--resume", "--out", tmp_path / "resumed")
    assert done.returncode == 0, done.stderr[-3000:]
    whole, resumed = ([row["loss"] for row in metrics(tmp_path / run)] for run in ("whole", "resumed"))
    assert len(whole) == 4 and resumed == whole  # the adapters, AdamW's moments and the dropout draws
