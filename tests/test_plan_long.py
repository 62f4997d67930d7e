"""`burst plan` for long sequences on the GPUs a user has: LoRA's trainable and frozen bytes counted from the model
itself, offloaded activations in host memory, the tiled MLP and loss, and --seq-len max (issue 44's figures)."""

from __future__ import annotations

import dataclasses
import json

import torch
from typer.testing import CliRunner

from cli import app
from models import ModelConfig, Transformer
from models.footprint import footprint
from models.lora import LoRAConfig, apply_lora
from planner.estimate import fits
from planner.hardware import gpu
from planner.memory import activation_bytes, host_bytes, memory_parts, trainable_parameters
from planner.search import memory_settings
from planner.shape import RunShape
from trainer.config import TrainConfig
from trainer.parallelize import parallelize

EIGHT_B = ModelConfig.from_name("llama3.1-8b")


def plan_json(tmp_path, *args) -> dict:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", *map(str, args), "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_lora_counts_the_parameters_the_model_trains_and_freezes():
    config = ModelConfig.from_name("tiny")
    for lora in (LoRAConfig(rank=8), LoRAConfig(rank=16, targets=("q", "v", "gate", "up", "down")),
                 LoRAConfig(rank=4, targets=("k", "o"), train_embeddings_and_norms=True)):
        with torch.device("meta"):
            model = apply_lora(Transformer(config), lora)
        trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        shape = RunShape(seq_len=1024, lora_rank=lora.rank, lora_targets=lora.targets,
                         train_embeddings_and_norms=lora.train_embeddings_and_norms)
        counted = trainable_parameters(shape, footprint(config))
        assert (counted.parameters, counted.frozen) == (trains, frozen), lora


def test_lora_holds_frozen_bf16_weights_and_the_adapters_state_only():
    h100 = gpu("h100", 1)
    full = memory_parts(RunShape(seq_len=8192, precision="bf16", activation_checkpointing="full"),
                        footprint(EIGHT_B), h100)
    lora = memory_parts(RunShape(seq_len=8192, precision="bf16", activation_checkpointing="full", lora_rank=16),
                        footprint(EIGHT_B), h100)
    parameters = footprint(EIGHT_B).parameters
    assert abs(lora["weights"] - 2 * parameters) < 0.01 * parameters  # bf16, plus the adapters' float32
    assert lora["optimizer state"] < 0.01 * full["optimizer state"] and full["optimizer state"] == 8 * parameters


def test_the_planned_lora_weights_are_the_bytes_a_bf16_run_holds_on_a_cpu_and_on_cuda():
    """The planner's weight bytes against the parallelized model's own: on a CPU a bf16 run keeps the blocks'
    frozen matrices in bf16 and the embeddings and norms in float32, on CUDA every frozen weight in bf16."""
    config = ModelConfig.from_name("tiny")
    train = TrainConfig(model="tiny", precision="bf16", lora_rank=16, lora_targets="q,v,gate")
    for device in ("cpu", "cuda"):
        with torch.device("meta"):
            model = parallelize(Transformer(config), None, train, device)
        held = sum(param.numel() * param.element_size() for param in model.parameters())
        hardware = dataclasses.replace(gpu("h100", 1), device=device)
        shape = RunShape(seq_len=1024, precision="bf16", lora_rank=16, lora_targets=("q", "v", "gate"))
        assert memory_parts(shape, footprint(config), hardware)["weights"] == held, device
        assert {param.dtype for param in model.parameters()} == {torch.float32, torch.bfloat16}, device


def test_offloading_moves_the_kept_inputs_to_host_memory_on_gpus_and_clones_them_on_a_cpu():
    shape = RunShape(seq_len=65536, precision="bf16", activation_checkpointing="full")
    offloaded = dataclasses.replace(shape, offload_activations=True)
    model = footprint(EIGHT_B)
    kept, moved = (activation_bytes(s, model, gpu("h100", 1), "full")[0] for s in (shape, offloaded))
    assert moved == 2 * kept // model.layers and host_bytes(offloaded, model, gpu("h100", 1)) == kept
    # one memory on a CPU: the "host copy" is a clone beside the input (trainer/memory.py's HostCopy), one block
    # input a layer more (tiny at 4,096 tokens, full recomputation: +64 MiB measured, 8 x 4,096 x 512 x 4 bytes)
    cpu = dataclasses.replace(gpu("h100", 1), device="cpu")
    kept, with_copies = (activation_bytes(s, model, cpu, "full")[0] for s in (shape, offloaded))
    assert with_copies == 2 * kept and host_bytes(offloaded, model, cpu) == 0


def test_the_tiled_mlp_and_loss_shrink_what_grows_with_the_sequence():
    shape = RunShape(seq_len=65536, precision="bf16", activation_checkpointing="full")
    tiled = dataclasses.replace(shape, mlp_tile=4096, loss_tile=256)
    whole, sliced = (memory_parts(s, footprint(EIGHT_B), gpu("h100", 1)) for s in (shape, tiled))
    assert sliced["backward working set"] < 0.7 * whole["backward working set"]
    assert sliced["loss chunk"] == whole["loss chunk"] // 4


def test_seq_len_max_on_one_h100_with_lora_and_on_eight_fine_tuning_whole(tmp_path):
    one = plan_json(tmp_path, "--gpu", "h100", "--gpus-per-node", 1, "--model", "llama3.1-8b", "--lora-rank", 16,
                    "--offload-activations", "--seq-len", "max")
    assert one["seq_len"] >= 256 * 1024 and one["fits"] and one["settings"]["offload_activations"]
    assert 0 < one["host_bytes"] <= one["host_capacity_bytes"]
    eight = plan_json(tmp_path, "--gpu", "h100", "--gpus-per-node", 8, "--model", "llama3.1-8b", "--seq-len", "max",
                      "--force")
    assert eight["seq_len"] >= 2 * 2**20 and eight["fits"] and eight["settings"]["lora_rank"] == 0
    assert eight["peak_memory_bytes"] <= gpu("h100").memory_bytes
    refused = CliRunner().invoke(app, ["plan", "--seq-len", "many"])
    assert refused.exit_code == 2 and "--seq-len 'many'" in refused.output


def test_the_search_offloads_and_tiles_where_a_layout_needs_it_and_names_the_longest_setting(tmp_path):
    lora = ("--gpu", "h100", "--gpus-per-node", 1, "--model", "llama3.1-8b", "--lora-rank", 16, "--search")
    found = plan_json(tmp_path, *lora, "--seq-len", 262144, "--force")["search"]
    assert [(row["activation_checkpointing"], row["offload_activations"], row["mlp_tile"]) for row in found] == \
        [("full", True, 8192)]
    plain = RunShape(seq_len=262144, precision="bf16", activation_checkpointing="full", lora_rank=16)
    h100, model = gpu("h100", 1), EIGHT_B
    assert not any(fits(dataclasses.replace(plain, offload_activations=offloaded, mlp_tile=tile), model, h100)
                   for offloaded, tile in ((False, 0), (False, 8192), (True, 0)))  # only both fit
    assert fits(dataclasses.replace(plain, offload_activations=True, mlp_tile=8192), model, h100)

    nothing = plan_json(tmp_path, *lora, "--seq-len", 2**23, "--force")  # 8M: the longest is named with its setting
    longest = plan_json(tmp_path, *lora[:-1], "--seq-len", "max", "--force")
    assert nothing["search"] == [] and nothing["longest_seq_len"] == longest["seq_len"] >= 256 * 1024
    assert "--offload-activations" in nothing["longest_settings"]
    cpu = memory_settings(dataclasses.replace(plain, seq_len=4096), dataclasses.replace(h100, device="cpu"))
    assert [(s.offload_activations, s.mlp_tile) for s in cpu] == [(False, 0), (False, 8192)]  # no offload on a CPU


def test_the_calibration_memory_rows_plan_the_settings_they_ran_with():
    from benchmarks.plan_calibration import LORA, MEMORY_GRID, memory_flags
    from planner.calibrate import shape_of

    settings = {**LORA, "mlp_tile": 1024, "loss_tile": 256, "offload_activations": True}
    row = {"model": "tiny", "seq_len": 4096, "cp": 1, "dp": 1, "mode": "full", "documents": "one",
           "doc_pattern": None, "memory": settings}
    shape, _ = shape_of(row)
    assert (shape.lora_rank, shape.lora_targets, shape.mlp_tile, shape.loss_tile, shape.offload_activations) == \
        (16, tuple(LORA["lora_targets"]), 1024, 256, True)
    assert memory_flags(settings) == ["--lora-rank", "16", "--lora-targets", "q,k,v,o,gate,up,down", "--mlp-tile",
                                      "1024", "--loss-tile", "256", "--offload-activations"]
    config = TrainConfig(model="tiny", seq_len=4096, **{**settings, "lora_targets": "q,k,v,o,gate,up,down"})
    assert (config.lora.targets, config.mlp_tile, config.offload_activations) == (shape.lora_targets, 1024, True)
    assert {} in [settings for *_, settings in MEMORY_GRID]  # each measured beside the shape without them
