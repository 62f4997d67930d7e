"""`burst bench attention`: forward/backward time, bytes sent and peak memory of burst_attn.

Every backward mode runs on N local ranks over the same global inputs, next to a
single-process run of the same kernels over the whole sequence (in the launching process),
so the table shows what the split costs and saves. Modes are timed in alternation
(A B A B ...) so that a noisy machine blurs them alike.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from burst.attention import burst_attn
from burst.checks import check_backward_mode
from burst.comm import SENT
from burst.kernels import check_kernel_name
from burst.kernels.choice import check_kernel_serves
from burst.layout import check_layout, check_sequence_length, shard_sequence
from burst.topology import check_topology
from runtime.device import resolve_device
from runtime.launch import run_local, threads_per_process
from runtime.memory import peak_memory_mib, reset_peak_memory
from runtime.precision import resolve_precision
from runtime.process import init_worker_process_group, leaving_process_group

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class AttentionBenchConfig:
    nproc: int = 2
    seq_len: int = 8192
    heads: int = 8
    kv_heads: int | None = None  # None: same as heads (MHA)
    head_dim: int = 64
    batch: int = 1
    dtype: str = "auto"  # a key of DTYPES, or "auto" (runtime/precision.py), resolved on construction
    causal: bool = True
    iters: int = 2
    modes: list[str] = field(default_factory=lambda: ["burst", "ring"])
    doc_length: int | None = None  # packed documents of this many tokens: masked runs beside unmasked ones
    window: int | None = None  # a sliding window: windowed runs beside full causal ones (bench/window.py counts them)
    single_process: bool = True
    layouts: list[str] = field(default_factory=lambda: ["zigzag"])  # of the document-masked runs (burst/layout.py)
    topology: str = "auto"  # how blocks travel between nodes (burst/topology.py)
    node_size: int | None = None  # local ranks per simulated node (None: all on one node)
    dtype_reason: str = ""  # why "auto" became `dtype`
    device: str | None = None  # auto, cpu or cuda (runtime/device.py), resolved on construction to the ranks' kind
    device_reason: str = ""  # why `device` is what it is
    kernel: str = "auto"  # the local attention kernel of every run (burst.select_kernel's names)

    def __post_init__(self) -> None:
        if self.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of auto, {', '.join(DTYPES)}")
        where = resolve_device(self.device, local_ranks=self.nproc, ranks_flag="--nproc")
        self.device, self.device_reason = where.kind, where.reason
        if self.dtype == "auto":
            chosen = resolve_precision("auto", torch.device(where.kind))
            self.dtype, self.dtype_reason = chosen.name, chosen.reason
        for flag, value in (("--nproc", self.nproc), ("--iters", self.iters), ("--heads", self.heads),
                            ("--kv-heads", self.kv_heads), ("--head-dim", self.head_dim), ("--batch", self.batch)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} {value} must be at least 1")
        self.kv_heads = self.heads if self.kv_heads is None else self.kv_heads
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")
        for mode in self.modes:
            check_backward_mode(mode, "--modes backward mode")
        check_sequence_length(self.seq_len, self.nproc)
        check_topology(self.topology, "--topology")
        check_kernel_name(self.kernel, "--attention-kernel")
        if self.node_size is not None and (self.node_size < 1 or self.nproc % self.node_size):
            raise ValueError(f"--node-size {self.node_size} must divide --nproc {self.nproc}")
        if self.doc_length is not None and not 0 < self.doc_length <= self.seq_len:
            raise ValueError(f"--doc-length must be between 1 and --seq-len {self.seq_len}, got {self.doc_length}")
        for layout in self.layouts:
            check_layout(layout, "--layouts layout")
        if self.window is not None and (self.window < 1 or not self.causal):
            raise ValueError(f"--window {self.window} must be a positive number of positions, with --causal")
        if self.layouts != ["zigzag"] and self.doc_length is None:
            raise ValueError("--layouts other than zigzag need packed documents: pass --doc-length N, or --docs STORE "
                             "for real ones")
        check_kernel_serves(torch.device(self.device), DTYPES[self.dtype], self.head_dim, self.kernel)

    def variants(self) -> list[tuple[str, str, bool, str, int | None]]:
        """(name, backward mode, document-masked, layout, window) of each run; unmasked runs (zigzag, full causal)
        come too for comparison."""
        runs = [(mode, mode, False, "zigzag", None) for mode in self.modes]
        if self.window:
            runs += [(f"{mode} window {self.window}", mode, False, "zigzag", self.window) for mode in self.modes]
        if self.doc_length:
            runs += [(f"{mode} docs{'' if layout == 'zigzag' else ' ' + layout}", mode, True, layout, None)
                     for layout in self.layouts for mode in self.modes]
        return runs

    def doc_boundaries(self) -> list[torch.Tensor] | None:
        """Packed documents of doc_length tokens (the last one shorter), the same in every batch row."""
        if self.doc_length is None:
            return None
        offsets = list(range(0, self.seq_len, self.doc_length)) + [self.seq_len]
        return [torch.tensor(offsets)] * self.batch


@dataclass
class BenchRow:
    name: str
    ranks: int
    forward_s: float
    backward_s: float
    sent_forward_mib: float  # per rank, the largest over ranks
    sent_backward_mib: float
    sent_inter_node_mib: float  # forward + backward, to ranks on other (simulated) nodes
    peak_memory_mib: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def global_inputs(config: AttentionBenchConfig, device: torch.device) -> list[torch.Tensor]:
    """The same q, k, v, dout on every rank: [batch, seq, heads, head_dim]."""
    g = torch.Generator().manual_seed(0)
    shape_q = (config.batch, config.seq_len, config.heads, config.head_dim)
    shape_kv = (config.batch, config.seq_len, config.kv_heads, config.head_dim)
    dtype = DTYPES[config.dtype]
    return [torch.randn(s, generator=g).to(device, dtype) for s in (shape_q, shape_kv, shape_kv, shape_q)]


def time_call(q, k, v, dout, device: torch.device, **attention) -> tuple[float, float, float, float]:
    """(forward s, backward s, forward CPU s, backward CPU s) of one burst_attn(q, k, v, **attention) and its
    backward, each pass between barriers (and CUDA synchronisations); CPU seconds are this process's."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    barrier()
    cpu, start = time.process_time(), time.perf_counter()
    out = burst_attn(q, k, v, **attention)
    sync()
    forward_cpu = time.process_time() - cpu
    barrier()
    cpu, middle = time.process_time(), time.perf_counter()
    out.backward(dout)
    sync()
    backward_cpu = time.process_time() - cpu
    barrier()
    return middle - start, time.perf_counter() - middle, forward_cpu, backward_cpu


def _measure(config: AttentionBenchConfig, variants: list[tuple[str, str, bool, str, int | None]], inputs,
             device) -> dict[str, dict]:
    """Median forward/backward seconds, bytes sent and peak memory of each variant on this rank.
    inputs: layout -> (q, k, v, dout) as the ranks hold them."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in variants}
    peaks: dict[str, float] = {}
    sent: dict[str, tuple[int, int, int]] = {}
    for i in range(config.iters + 1):  # the first round warms up
        for name, mode, masked, layout, window in variants:
            reset_peak_memory(device)
            node_size = config.node_size if dist.is_initialized() else None  # the single process is one node
            fwd, bwd, _, _ = time_call(*inputs[layout], device, causal=config.causal, backward=mode,
                                       kernel=config.kernel, topology=config.topology, node_size=node_size,
                                       layout=layout, doc_boundaries=config.doc_boundaries() if masked else None,
                                       window=window)
            peaks[name] = max(peaks.get(name, 0.0), peak_memory_mib(device))
            sent[name] = (SENT.last_forward, SENT.last_backward,
                          SENT.last_forward_inter_node + SENT.last_backward_inter_node)
            if i:
                times[name].append((fwd, bwd))
    return {n: {"forward_s": statistics.median(t[0] for t in times[n]),
                "backward_s": statistics.median(t[1] for t in times[n]),
                "sent_forward": sent[n][0], "sent_backward": sent[n][1], "sent_inter_node": sent[n][2],
                "peak_mib": peaks[n]} for n in times}


def _worker(config: AttentionBenchConfig) -> dict[str, dict]:
    device = init_worker_process_group(config.device)
    with leaving_process_group():
        full = global_inputs(config, device)
        inputs = {layout: [shard_sequence(t, layout=layout, doc_boundaries=config.doc_boundaries()) for t in full]
                  for layout in {v[3] for v in config.variants()}}
        return _measure(config, config.variants(), inputs, device)


def _rows(name: str, ranks: int, per_rank: list[dict]) -> BenchRow:
    """One row from every rank's figures: the slowest rank's time, the largest bytes and memory."""
    mib = 2**20
    return BenchRow(name, ranks, max(r["forward_s"] for r in per_rank), max(r["backward_s"] for r in per_rank),
                    max(r["sent_forward"] for r in per_rank) / mib, max(r["sent_backward"] for r in per_rank) / mib,
                    max(r["sent_inter_node"] for r in per_rank) / mib, max(r["peak_mib"] for r in per_rank))


def run_attention_bench(config: AttentionBenchConfig) -> list[BenchRow]:
    """Measure each backward mode on `config.nproc` local ranks, and the single-process run."""
    results = run_local(_worker, config.nproc, (config,))
    rows = [_rows(f"{name} x{config.nproc}", config.nproc, [results[r][name] for r in results])
            for name, *_ in config.variants()]
    if config.single_process:
        device = torch.device(config.device)
        torch.set_num_threads(threads_per_process(config.nproc))  # the same cores per process as a rank
        variants = [("single process", "auto", False, "zigzag", None)]
        if config.window:
            variants.append((f"single process window {config.window}", "auto", False, "zigzag", config.window))
        if config.doc_length:
            variants.append(("single process docs", "auto", True, "zigzag", None))
        single = _measure(config, variants, {"zigzag": global_inputs(config, device)}, device)
        rows[:0] = [_rows(name, 1, [single[name]]) for name, *_ in variants]
    return rows


def print_table(config: AttentionBenchConfig, rows: list[BenchRow]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    title = (f"burst_attn: {config.seq_len:,} tokens, {config.heads}/{config.kv_heads} heads x {config.head_dim}, "
             f"{config.dtype}, {'causal' if config.causal else 'full'}, batch {config.batch}"
             + (f", docs of {config.doc_length:,} tokens" if config.doc_length else "")
            + (f", window {config.window:,}" if config.window else "")
             + f", topology {config.topology}" + (f", nodes of {config.node_size}" if config.node_size else ""))
    # light borders, one space between columns: the table fits 80 columns
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    for column in ("run", "fwd s", "bwd s", "total s", "speedup", "fwd MiB", "bwd MiB", "x-node MiB",
                   "peak MiB"):
        table.add_column(column, justify="left" if column == "run" else "right")
    single = rows[0].total_s if rows[0].ranks == 1 else None
    for row in rows:
        speedup = f"{single / row.total_s:.2f}x" if single else "-"
        table.add_row(row.name, f"{row.forward_s:.3f}", f"{row.backward_s:.3f}", f"{row.total_s:.3f}", speedup,
                      f"{row.sent_forward_mib:.1f}", f"{row.sent_backward_mib:.1f}", f"{row.sent_inter_node_mib:.1f}",
                      f"{row.peak_memory_mib:.0f}")
    Console().print(table)
    if config.dtype_reason:
        Console().print(f"dtype {config.dtype}: {config.dtype_reason}", style="dim")
    Console().print(f"device {config.device}: {config.device_reason}", style="dim")
    Console().print("time: the slowest rank; speedup: the single process's time / this run's; MiB: sent per rank "
                    "in forward, in backward, the largest rank (x-node: fwd + bwd to ranks on other nodes); peak: "
                    "resident memory of the largest process on CPU, allocated memory on CUDA", style="dim")


def write_json(path: str, config: AttentionBenchConfig, rows: list[BenchRow]) -> None:
    with open(path, "w") as f:
        json.dump({"config": asdict(config), "runs": [asdict(r) | {"total_s": r.total_s} for r in rows]}, f, indent=1)
