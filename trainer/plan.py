"""`burst plan`: what a run needs per rank and how fast it goes, before it starts, from the planner (planner/).

The request's settings are those `burst train` takes; its model is resolved as `burst train` resolves it
(trainer/preflight.py's resolve_model) and reduced to a run shape (preflight's run_shape). `plan(request)`
estimates that shape; `search(request)` ranks the cp x dp x recomputation settings of the hardware's GPUs that fit
by tokens per second, or finds the longest sequence that fits. Both print through `format_*` and write JSON
through `to_json`; the CLI only parses flags.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from models import PRESETS, ModelConfig
from planner import Estimate, RunShape, estimate
from planner.attention import effective_doc_len
from planner.hardware import Hardware, foreign_constants, gpu, local_hardware, planned_machine
from planner.search import layouts, longest_settings, memory_settings
from trainer.config import TrainConfig
from trainer.preflight import resolve_model, run_shape

GIB = 2**30


@dataclass(frozen=True)
class PlanRequest:
    config: TrainConfig  # the settings `burst train` would get
    gpu: str | None = None  # a GPU of the table (planner/hardware.py); None: this machine
    gpus_per_node: int | None = None
    nodes: int = 1
    vocab_size: int | None = None  # replace the preset's vocabulary (a store prepared with another tokenizer)
    doc_len: int | None = None  # with --doc-mask: the packed documents' length (None: one per sequence)
    generate: int | None = None  # plan `burst generate` of this many new tokens after a --seq-len prompt

    def __post_init__(self) -> None:
        """Refuse hardware and document settings that cannot describe a run, naming the flag."""
        for flag, value in (("--gpus-per-node", self.gpus_per_node), ("--nodes", self.nodes),
                            ("--vocab-size", self.vocab_size)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} {value} must be at least 1 (leave it out for "
                                 f"{'the table' if flag != '--vocab-size' else 'the preset'}'s or this machine's)")
        if self.generate is not None and self.generate < 1:
            raise ValueError(f"--generate {self.generate} must be at least 1 new token (leave it out to plan training)")
        if self.doc_len is not None and self.doc_len < 1:
            raise ValueError(f"--doc-len {self.doc_len} must be at least 1 token: the packed documents' length; leave "
                             f"it out to take the stores' length-weighted mean")
        if self.gpu is not None and self.config.device == "cpu":
            raise ValueError("--gpu plans for GPUs of the table, --device cpu for this machine's CPU: drop one")


def calibrate_here(request: PlanRequest) -> None:
    """`burst plan --calibrate`: fit this machine's constants (trainer/calibrate.py) on the device and in the precision
    the request's run would take here; progress on stderr."""
    if request.gpu is not None:
        raise ValueError("--calibrate measures this machine, --gpu plans for a GPU of the table: drop one")
    import sys

    import torch

    from runtime.device import resolve_device
    from runtime.precision import resolve_precision
    from trainer.calibrate import calibrate

    device = resolve_device(request.config.device).kind
    precision = resolve_precision(request.config.precision, torch.device(device)).name
    calibrate(device, precision, say=lambda line: print(line, file=sys.stderr, flush=True))


def check_json_path(path: Path, force: bool) -> None:
    """Refuse a --json that would replace a file (without --force), or that is a directory, before any work."""
    if path.is_dir():
        raise ValueError(f"--json {path} is a directory; pass a file, e.g. {path / 'plan.json'}")
    if path.exists() and not force:
        raise ValueError(f"--json: {path} already exists; choose another file, or pass --force to replace it")


def hardware_of(request: PlanRequest) -> Hardware:
    if request.gpu is not None:
        return gpu(request.gpu, request.gpus_per_node, request.nodes)
    import torch

    from runtime.device import resolve_device
    from runtime.precision import resolve_precision

    device = resolve_device(request.config.device).kind  # --device, else BURST_DEVICE, else auto: as train takes it
    # the CPU's rate is measured in the precision the run would take (bf16 with AMX runs several times fp32's)
    precision = resolve_precision(request.config.precision, torch.device(device)).name
    return local_hardware(request.gpus_per_node, request.nodes, precision, device)


def first_store(config: TrainConfig):
    """The first --data store (a mixture's stores share one tokenizer), or None without --data."""
    if not config.data:
        return None
    from data import TokenStore
    from data.mixture import parse_mixture

    return TokenStore(Path(parse_mixture(config.data)[0].path))


def model_config_of(request: PlanRequest) -> ModelConfig:
    """The model `burst train` would build (trainer/preflight.py's resolve_model): a preset takes the --data store's
    vocabulary, as `burst train` gives it (without --data, the preset's own: a plan for another machine's data);
    --vocab-size replaces either."""
    model, _, _ = resolve_model(request.config, first_store(request.config))
    if request.vocab_size is not None:
        model = dataclasses.replace(model, vocab_size=request.vocab_size)
    return model


def documents_length(request: PlanRequest) -> int | None:
    """The packed documents' length the attention term counts: --doc-len, else with --doc-mask (nll) that of the
    stores `burst train` would read (--data, by share, or the embedded corpus): `store_doc_len` of each."""
    config = request.config
    if request.doc_len is not None and not config.doc_mask:
        raise ValueError("--doc-len is the length of documents --doc-mask keeps apart; without --doc-mask a sequence "
                         "attends as one document: add --doc-mask, or drop --doc-len")
    if request.doc_len is not None and request.doc_len >= config.seq_len:
        return None  # one document fills every sequence: counted as one (format_plan says so)
    if request.doc_len is not None or not config.doc_mask or config.objective != "nll":
        return request.doc_len
    from data import default_store
    from data.mixture import parse_mixture

    sources = parse_mixture(config.data) if config.data else None
    stores = [(default_store(progress=False), 1.0, 0)] if sources is None else [
        (Path(s.path), s.share, s.min_doc or 0) for s in sources]
    return round(sum(share * store_doc_len(path, config.seq_len, min_doc) for path, share, min_doc in stores))


def store_doc_len(path: Path, seq_len: int, min_doc: int = 0) -> int:
    """A token store's documents as the loader packs them into `seq_len` (each framed by BOS and EOS), in the one
    length that counts their attention pairs (planner/attention.py's effective_doc_len)."""
    from data import TokenStore

    store = TokenStore(path)
    lengths = store.document_lengths[store.document_lengths >= min_doc]
    return effective_doc_len(lengths + len(store.document_prefix) + 1, seq_len)


def resolved(config: TrainConfig, hardware: Hardware) -> TrainConfig:
    """`config` with --precision auto resolved as the hardware would: bf16 on GPUs; on this CPU, its own choice."""
    if config.precision != "auto":
        return config
    if hardware.device == "cuda":
        return dataclasses.replace(config, precision="bf16")
    import torch

    from runtime.precision import resolve_precision

    return dataclasses.replace(config, precision=resolve_precision("auto", torch.device("cpu")).name)


def with_data_settings(request: PlanRequest) -> PlanRequest:
    """The request with --doc-mask resolved from the --data stores as `burst train` resolves it (on for instruction
    and preference stores) and refused where `burst train` refuses it (--no-doc-mask there, a preference store with
    --objective nll, an objective without one); without --data (data elsewhere) --doc-mask defaults to the
    objective's: on for a preference objective."""
    config = request.config
    if not config.data:
        return dataclasses.replace(request, config=dataclasses.replace(
            config, doc_mask=config.objective != "nll" if config.doc_mask is None else config.doc_mask))
    from data.mixture import open_sources, parse_mixture
    from trainer.preference import check_preferences
    from trainer.preflight import check_conversations
    from trainer.resolve import document_mask

    sources = open_sources(parse_mixture(config.data))
    config = dataclasses.replace(config, doc_mask=document_mask(config.doc_mask, [s.store for s in sources]).value)
    check_preferences(config, sources)
    check_conversations(config, sources)
    return dataclasses.replace(request, config=config)


def plan(request: PlanRequest) -> tuple[RunShape, Estimate, Hardware]:
    """The estimate of the request's own settings."""
    request = with_data_settings(request)
    hardware = hardware_of(request)
    config = resolved(request.config, hardware)
    gpus = hardware.gpus_per_node * hardware.nodes
    if hardware.device == "cuda" and config.world_size > gpus:
        raise ValueError(f"--cp {config.cp} x --dp {config.dp} = {config.world_size} ranks, but {hardware.nodes} "
                         f"node(s) of {hardware.gpus_per_node} GPUs have {gpus}; raise --gpus-per-node or --nodes")
    shape = run_shape(config, documents_length(request))
    if request.generate is not None:  # forward only, one cp group, and the KV cache of prompt and new tokens
        shape = dataclasses.replace(shape, forward_only=True, new_tokens=request.generate, dp=1, grad_accum=1,
                                    activation_checkpointing="none")
    return shape, estimate(shape, model_config_of(request), hardware), hardware


def processors(hardware: Hardware, config: TrainConfig) -> int:
    """The ranks a search lays out: every GPU of the nodes, or on a CPU the run's own cp x dp processes."""
    return hardware.gpus_per_node * hardware.nodes if hardware.device == "cuda" else config.world_size


@dataclass(frozen=True)
class Candidate:
    shape: RunShape
    estimate: Estimate


def search(request: PlanRequest, top: int = 8) -> tuple[list[Candidate], RunShape | None, Hardware]:
    """The settings of every GPU (cp x dp = gpus_per_node x nodes, each recomputation mode) that fit, fastest first
    (tokens/s per GPU), at most `top`, each layout as it is or else with the first of planner/search.py's
    `memory_settings` that fits (a tiled MLP, on GPUs offloaded activations); and when none fits, the longest
    sequence that fits and its setting (`longest_settings`; None: not even 1,024 tokens)."""
    request = with_data_settings(request)
    hardware = hardware_of(request)
    config = resolved(request.config, hardware)
    model = model_config_of(request)
    gpus = processors(hardware, config)
    shape = run_shape(config, documents_length(request))
    found = []
    for layout in layouts(shape, gpus):
        fitting = (Candidate(setting, result) for setting in memory_settings(layout, hardware)
                   if (result := estimate(setting, model, hardware)).fits)
        if (first := next(fitting, None)) is not None:
            found.append(first)
    found.sort(key=lambda candidate: -candidate.estimate.tokens_per_s)
    longest = None
    if not found:
        longest = (longest_settings(shape, model, hardware, gpus) or (None, None))[1]
    return found[:top], longest, hardware


def longest(request: PlanRequest) -> tuple[RunShape, Estimate, Hardware] | None:
    """--seq-len max: the longest sequence any setting of the hardware's GPUs fits (planner/search.py's
    `longest_settings`: cp x dp, recomputation, offloaded activations and a tiled MLP on GPUs), its setting and its
    estimate; None: not even 1,024 tokens fit."""
    request = with_data_settings(request)
    hardware = hardware_of(request)
    config = resolved(request.config, hardware)
    model = model_config_of(request)
    found = longest_settings(run_shape(config, documents_length(request)), model, hardware,
                             processors(hardware, config))
    if found is None:
        return None
    _, shape = found
    return shape, estimate(shape, model, hardware), hardware


def format_longest(config: TrainConfig, shape: RunShape, result: Estimate, hardware: Hardware) -> str:
    """The longest sequence's line, then its plan."""
    return (f"longest sequence that fits {model_name(config)} on {processors(hardware, config)} x {hardware.name}: "
            f"{shape.seq_len:,} tokens, with {shape.describe()}\n" + format_plan(config, shape, result, hardware))


def model_name(config: TrainConfig) -> str:
    return config.model or (f"--init-from {config.init_from}" if config.init_from else "tiny")


def format_plan(config: TrainConfig, shape: RunShape, result: Estimate, hardware: Hardware,
                doc_len: int | None = None) -> str:
    """The plan as `burst plan` prints it; doc_len: --doc-len as given."""
    lines = [f"plan: {model_name(config)}, --seq-len {shape.seq_len:,}, {shape.describe()}, --batch-size "
             f"{shape.batch_size}, --precision {shape.precision}, on {hardware.name} "
             f"({hardware.nodes} x {hardware.gpus_per_node})"]
    lines.append(f"model: {result.vocab_size:,}-token vocabulary"
                 + (" (the preset's: pass --data or --vocab-size for a store's)" if not config.data and
                    (config.model or "tiny") in PRESETS and config.init_from is None else ""))
    if isinstance(result.doc_len, int):
        lines.append(f"documents: attention counted for documents of {result.doc_len:,} tokens (--doc-len, or the "
                     "stores' length-weighted mean)")
    elif doc_len is not None and result.doc_len is None:
        lines.append(f"documents: --doc-len {doc_len:,} is not shorter than --seq-len {shape.seq_len:,}: one document "
                     f"a sequence, counted as one")
    lines.append("memory per rank (GiB):")
    lines += [f"  {name:<18} {size / GIB:10,.2f}" for name, size in result.memory_bytes.items()]
    verdict = "fits" if result.fits else "does NOT fit"
    lines.append(f"  {'peak':<18} {result.peak_memory_bytes / GIB:10,.2f}  of {result.capacity_bytes / GIB:,.1f}: "
                 f"{verdict}")
    if result.host_bytes:
        lines.append(f"host memory per node (GiB): offloaded activations {result.host_bytes / GIB:,.2f} of "
                     f"{result.host_capacity_bytes / GIB:,.0f}" + ("" if result.host_fits else ": does NOT fit"))
    lines.append("step time (s):")
    lines += [f"  {name:<20} {seconds:10.3f}" for name, seconds in result.step_time_parts.items()]
    lines.append(f"  {'step':<20} {result.step_time_s:10.3f}")
    lines.append(f"tokens/s per GPU {result.tokens_per_s:,.0f}; MFU {result.mfu:.1%}")
    if foreign_constants(hardware):
        lines.append(f"note: the estimate's constants were fitted on {hardware.record.machine}, not on "
                     f"{hardware.name if hardware.device == 'cuda' else planned_machine(hardware)}, and do not carry "
                     f"over exactly"
                     + ("; `burst plan --calibrate` fits them on this machine in a few minutes"
                        if hardware.device == "cpu" or hardware.source.startswith("torch.cuda") else ""))
    if hardware.device == "cpu" and shape.precision == "bf16" and not native_cpu_bf16():
        lines.append("note: this CPU has no native bf16, where bf16 runs many times slower than fp32; the estimate's "
                     "bf16 constants come from a CPU that has it (docs/plan.md), so its step time is not this "
                     "CPU's (--precision fp32 plans what it runs fast)")
    return "\n".join(lines)


def native_cpu_bf16() -> bool:
    import torch

    from runtime.precision import resolve_precision

    return resolve_precision("auto", torch.device("cpu")).name == "bf16"


def format_search(config: TrainConfig, found: list[Candidate], longest: RunShape | None, hardware: Hardware) -> str:
    ranks = processors(hardware, config)
    where = f"{ranks} x {hardware.name}" if hardware.device == "cuda" else \
        f"{ranks} process{'es' if ranks > 1 else ''} on {hardware.name}"
    head = f"settings that fit {model_name(config)} at --seq-len {config.seq_len:,} on {where}"
    if not found:
        return (f"nothing fits {model_name(config)} at --seq-len {config.seq_len:,} on {where}; "
                + (f"the longest sequence that fits is {longest.seq_len:,}, with {longest.describe()}"
                   if longest else "not even 1,024 tokens fit"))
    rows = [head + ", fastest first:",
            f"  {'cp':>3} {'dp':>3} {'recompute':<10} {'peak GiB':>9} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6}  "
            f"memory"]
    rows += [f"  {c.shape.cp:>3} {c.shape.dp:>3} {c.shape.activation_checkpointing:<10} "
             f"{c.estimate.peak_memory_bytes / GIB:9.1f} {c.estimate.step_time_s:8.2f} "
             f"{c.estimate.tokens_per_s:10,.0f} {c.estimate.mfu:6.1%}  {memory_flags(c.shape)}" for c in found]
    return "\n".join(rows)


def memory_flags(shape: RunShape) -> str:
    """The flags of `shape` that hold less memory per token (--offload-activations, --mlp-tile), or "-"."""
    flags = (["--offload-activations"] if shape.offload_activations else []) + (
        [f"--mlp-tile {shape.mlp_tile}"] if shape.mlp_tile else [])
    return " ".join(flags) or "-"


def to_json(config: TrainConfig, shape: RunShape, result: Estimate, hardware: Hardware,
            found: list[Candidate] | None = None, longest: RunShape | None = None) -> dict:
    """The plan as one JSON object (see docs/plan.md for the keys); with --search, the ranked settings, and where
    none fits, the longest sequence that does (`longest_seq_len`, null: not even 1,024 tokens)."""
    document = {**result.to_json(), "seq_len": shape.seq_len,
                "settings": {"model": config.model, "seq_len": shape.seq_len, "cp": shape.cp,
                             "dp": shape.dp, "batch_size": shape.batch_size,
                             "activation_checkpointing": shape.activation_checkpointing,
                             "precision": shape.precision, "lora_rank": shape.lora_rank,
                             "offload_activations": shape.offload_activations, "mlp_tile": shape.mlp_tile,
                             "loss_tile": shape.loss_tile},
                "hardware": hardware_json(hardware)}
    if found is not None:
        document["search"] = [{"cp": c.shape.cp, "dp": c.shape.dp,
                               "activation_checkpointing": c.shape.activation_checkpointing,
                               "offload_activations": c.shape.offload_activations, "mlp_tile": c.shape.mlp_tile,
                               **c.estimate.to_json()}
                              for c in found]
        if not found:
            document["longest_seq_len"] = None if longest is None else longest.seq_len
            document["longest_settings"] = None if longest is None else longest.describe()
    return document


def hardware_json(hardware: Hardware) -> dict:
    """The hardware as the JSON shows it: its figures, and the calibration record its constants come from."""
    figures = {field.name: getattr(hardware, field.name) for field in dataclasses.fields(hardware)
               if field.name != "calibration"}
    record = hardware.record
    return {**figures, "calibration": {"machine": record.machine, "source": record.source,
                                       "this_machine": not foreign_constants(hardware),
                                       "constants": dataclasses.asdict(record)}}


def write_json(path: Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n")
