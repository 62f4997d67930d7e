"""`burst bench attention --docs STORE`: the layouts side by side on real packed sequences.

The sequences are the trainer's (`burst train --doc-mask`): documents of a token store's train
split packed in its seeded order (the CLI reads them, `data.packing`). For each sequence and each
layout (zigzag, balanced) the plan is counted without running a kernel (`count_sequences`): each
rank's forward work (its queries' calls) and backward work (against its keys, where the "burst"
backward computes; the "ring" backward computes on the query side, the forward's share) in
tiles of 128 x 128, the slowest rank over the mean rank; the share of the computed tiles' area
that is masked; the ring steps between two ranks with no kernel call; the bytes each rank sends
(flat, one node), and the milliseconds planning takes: choosing the layout (not memoised) and
working out every pair of ranks' kernel calls and rows (more than any one rank needs).
This reaches cp 8 and 128K tokens on any machine.

Without --plan-only, the sequences at the given quantiles of zigzag's imbalance (by default the
p90-imbalanced one and the most balanced one) then run forward and backward on --nproc local
ranks, every layout and backward mode in alternation (A B A B ...), with random q, k, v: time
(the slowest rank), each rank's CPU seconds, and bytes sent. With --replay, each rank's kernel
calls run one rank after another in this process instead, timed in thread CPU seconds: each
rank's compute without ranks competing for cores, so cp 4 and 8 on a 2-core machine.

Sequences whose documents see earlier ones (prefix sharing: `DocumentsBenchConfig.sees`, burst_attn's
doc_sees) are counted and timed with those rectangles; the tiles computed over every rank are counted
for each, so that a sequence packed with and without sharing compares directly.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from bench.attention import DTYPES, AttentionBenchConfig, global_inputs, time_call
from burst.balance import OPTIONS, choose_chunks, plan_work
from burst.comm import SENT
from burst.cost import plan_bytes
from burst.kernels import default_scale, select_kernel
from burst.layout import LAYOUTS, check_layout, shard_sequence, zigzag_layout
from burst.operator import heads_first
from burst.ring import merge_block
from planner.attention import sequence_plan
from runtime.launch import run_local
from runtime.process import init_worker_process_group, leaving_process_group

MIB = 2**20


@dataclass
class DocumentsBenchConfig:
    attention: AttentionBenchConfig  # ranks, sequence length, heads, dtype, modes, iterations
    sequences: list[list[int]]  # document offsets of each packed sequence
    layouts: list[str] = field(default_factory=lambda: list(LAYOUTS))
    plan_only: bool = False
    replay: bool = False  # time each rank's kernel calls in this process instead of running ranks
    quantiles: list[float] = field(default_factory=lambda: [0.9, 0.0])  # of zigzag's imbalance: sequences to time
    # per sequence, the earlier document each document also sees whole, or -1 (burst_attn's doc_sees); None: none
    sees: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if not self.sequences:
            raise ValueError("--sequences must be at least 1")
        for layout in self.layouts:
            check_layout(layout, "--layouts layout")
        if not self.plan_only and "zigzag" not in self.layouts:
            raise ValueError("the timed sequences are picked by zigzag's imbalance: keep zigzag in --layouts, or "
                             "pass --plan-only")
        if not all(0 <= q <= 1 for q in self.quantiles):
            raise ValueError(f"--time-quantiles must be between 0 and 1, got {self.quantiles}")
        if self.attention.node_size not in (None, self.attention.nproc) or self.attention.topology not in (
                "auto", "flat"):
            raise ValueError("--docs runs the ranks as one node (flat): leave out --node-size and --topology")
        if self.sees is not None and len(self.sees) != len(self.sequences):
            raise ValueError(f"{len(self.sees)} rows of seen documents for {len(self.sequences)} sequences: give one "
                             "per sequence")

    def sees_of(self, index: int) -> list[int] | None:
        """Sequence `index`'s seen documents, or None."""
        return None if self.sees is None else self.sees[index]


@dataclass
class SequenceWork:
    """One sequence under one layout, counted from its plan."""

    sequence: int
    layout: str
    chunks_per_rank: int
    forward_imbalance: float  # slowest rank's forward tiles over the mean rank's
    backward_imbalance: float  # the same for the tiles against each rank's keys
    masked_share: float
    idle_steps: float  # share of the (rank, other rank) ring steps with no kernel call
    sent_mib_mean: float  # forward + backward, per rank
    sent_mib_max: float
    planning_ms: float
    tiles: int = 0  # 128 x 128 tiles computed in one forward, summed over the ranks

    @property
    def imbalance(self) -> float:
        """The worse pass: each waits for its slowest rank."""
        return max(self.forward_imbalance, self.backward_imbalance)


def _meta(config: AttentionBenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape-only q and k of one rank's shard."""
    shard = config.seq_len // config.nproc
    dtype = DTYPES[config.dtype]
    return (torch.empty(config.batch, shard, config.heads, config.head_dim, dtype=dtype, device="meta"),
            torch.empty(config.batch, shard, config.kv_heads, config.head_dim, dtype=dtype, device="meta"))


def count_sequence(index: int, boundaries: list[int], layout: str, config: AttentionBenchConfig,
                  sees: list[int] | None = None) -> SequenceWork:
    world, seq_len = config.nproc, config.seq_len
    started = time.perf_counter()
    if layout == "balanced":  # timed without the memo: what a new sequence costs
        choose_chunks(boundaries, seq_len, world, zigzag_layout(seq_len, world).chunks, OPTIONS, sees)
    plan = sequence_plan(config.seq_len, config.nproc, boundaries, sees, layout, config.batch)
    chosen = plan.layouts[0]
    for q_owner in range(world):  # every rank pair's calls and rows: more than any one rank works out
        for kv_owner in range(world):
            plan.key_rows(q_owner, kv_owner)
            plan.query_rows(q_owner, kv_owner)
    planning_ms = (time.perf_counter() - started) * 1e3
    work = plan_work(plan)
    q, k = _meta(config)
    mode = config.modes[0]
    sent = [sum(plan_bytes(plan, "flat", q, k, mode, world, rank)[0::2]) / MIB for rank in range(world)]

    def ratio(loads: tuple[int, ...]) -> float:
        return max(loads) / (sum(loads) / len(loads))

    return SequenceWork(index, layout, len(chosen.chunks[0]), ratio(work.forward), ratio(work.backward),
                        work.masked_share, work.idle_pairs / max(world * (world - 1), 1), statistics.mean(sent),
                        max(sent), planning_ms, sum(work.forward))


def count_sequences(config: DocumentsBenchConfig) -> list[SequenceWork]:
    return [count_sequence(i, boundaries, layout, config.attention, config.sees_of(i))
            for i, boundaries in enumerate(config.sequences) for layout in config.layouts]


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def summarize(plans: list[SequenceWork], layouts: list[str]) -> dict[str, dict[str, float]]:
    """Per layout: mean and p90 over the sequences of each figure."""
    summary = {}
    for layout in layouts:
        mine = [p for p in plans if p.layout == layout]
        row = {}
        for name in ("imbalance", "forward_imbalance", "backward_imbalance"):
            values = [getattr(p, name) for p in mine]
            row[name], row[f"{name}_p90"] = statistics.mean(values), p90(values)
        for name in ("masked_share", "idle_steps", "sent_mib_mean", "sent_mib_max", "chunks_per_rank", "tiles"):
            row[name] = statistics.mean(getattr(p, name) for p in mine)
        row["planning_ms"] = statistics.mean(p.planning_ms for p in mine)
        row["planning_ms_max"] = max(p.planning_ms for p in mine)
        summary[layout] = row
    return summary


def picked_sequences(plans: list[SequenceWork], quantiles: list[float]) -> list[int]:
    """The sequences at these quantiles of zigzag's imbalance (0: the most balanced, 1: the least)."""
    ranked = sorted((p for p in plans if p.layout == "zigzag"), key=lambda p: (p.imbalance, p.sequence))
    picks = []
    for q in quantiles:
        index = ranked[min(len(ranked) - 1, round(q * (len(ranked) - 1)))].sequence
        if index not in picks:
            picks.append(index)
    return picks


def _time_worker(config: DocumentsBenchConfig, picks: list[int]) -> dict[str, dict]:
    """Median seconds, CPU seconds and bytes of every (sequence, layout, mode) on this rank."""
    device = init_worker_process_group(config.attention.device)
    attention, results = config.attention, {}
    with leaving_process_group():
        full = global_inputs(attention, device)
        for index in picks:
            boundaries = [torch.tensor(config.sequences[index])] * attention.batch
            sees = None if config.sees is None else [torch.tensor(config.sees[index])] * attention.batch
            inputs = {layout: [shard_sequence(t, layout=layout, doc_boundaries=boundaries, doc_sees=sees) for t in full]
                      for layout in config.layouts}
            variants = [(layout, mode) for layout in config.layouts for mode in attention.modes]
            runs: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {v: [] for v in variants}
            sent = {}
            for i in range(attention.iters + 1):  # the first round warms up
                for layout, mode in variants:
                    # the ranks agree by construction (check_ranks off): only the ring's bytes are counted
                    measured = time_call(*inputs[layout], device, causal=True, backward=mode, layout=layout,
                                         kernel=attention.kernel, doc_boundaries=boundaries, doc_sees=sees,
                                         topology="flat", check_ranks=False)
                    sent[layout, mode] = (SENT.last_forward + SENT.last_backward) / MIB
                    if i:
                        runs[layout, mode].append(measured)
            for (layout, mode), measured in runs.items():
                results[f"{index}/{layout}/{mode}"] = {
                    "forward_s": statistics.median(m[0] for m in measured),
                    "backward_s": statistics.median(m[1] for m in measured),
                    "forward_cpu_s": statistics.median(m[2] for m in measured),
                    "backward_cpu_s": statistics.median(m[3] for m in measured), "sent_mib": sent[layout, mode]}
    return results


@dataclass
class TimedRun:
    sequence: int
    layout: str
    mode: str
    forward_s: float  # the slowest rank's
    backward_s: float
    forward_cpu_s: float  # the busiest rank's CPU seconds in forward
    backward_cpu_s: float  # and in backward
    cpu_s_mean: float  # forward + backward, the mean rank's
    sent_mib_max: float  # forward + backward, the rank that sent most

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def cpu_s(self) -> float:
        """Each pass waits for its busiest rank: the time on cores of its own, whatever else runs here."""
        return self.forward_cpu_s + self.backward_cpu_s


def time_sequences(config: DocumentsBenchConfig, picks: list[int]) -> list[TimedRun]:
    results = run_local(_time_worker, config.attention.nproc, (config, picks))
    runs = []
    for key in results[0]:
        index, layout, mode = key.split("/")
        per_rank = [results[r][key] for r in results]
        runs.append(TimedRun(int(index), layout, mode, max(r["forward_s"] for r in per_rank),
                             max(r["backward_s"] for r in per_rank), max(r["forward_cpu_s"] for r in per_rank),
                             max(r["backward_cpu_s"] for r in per_rank),
                             statistics.mean(r["forward_cpu_s"] + r["backward_cpu_s"] for r in per_rank),
                             max(r["sent_mib"] for r in per_rank)))
    return runs


def replay_sequences(config: DocumentsBenchConfig, picks: list[int]) -> list[TimedRun]:
    """Every rank's kernel calls (and merges) of one forward and backward, one rank after another in this
    process on one thread, timed in thread CPU seconds: what each rank computes, without ranks or other
    processes competing for the cores. Backward "burst" computes on the key side, "ring" on the query side.
    The variants take turns (A B A B ...) for --iters rounds; each rank's fastest round counts."""
    attention = config.attention
    variants = [(index, layout, mode) for index in picks for layout in config.layouts for mode in attention.modes]
    rounds = [[_replay_once(config.sequences[i], config.sees_of(i), layout, mode, attention)
               for i, layout, mode in variants]
              for _ in range(attention.iters)]
    runs = []
    for v, (index, layout, mode) in enumerate(variants):
        forward = [min(r[v][0][rank] for r in rounds) for rank in range(attention.nproc)]
        backward = [min(r[v][1][rank] for r in rounds) for rank in range(attention.nproc)]
        runs.append(TimedRun(index, layout, mode, 0.0, 0.0, max(forward), max(backward),
                             statistics.mean(f + b for f, b in zip(forward, backward, strict=True)), 0.0))
    return runs


def _replay_once(boundaries: list[int], sees: list[int] | None, layout: str, mode: str,
                 config: AttentionBenchConfig) -> tuple[list[float], list[float]]:
    """(forward, backward) thread CPU seconds of each rank's calls."""
    world, shard, scale = config.nproc, config.seq_len // config.nproc, default_scale(config.head_dim)
    plan = sequence_plan(config.seq_len, config.nproc, boundaries, sees, layout, config.batch)
    # random inputs: any cut into shards serves; heads-first memory, as burst_attn hands the CPU kernels
    q, k, v, dout = ([heads_first(x) for x in t.chunk(world, dim=1)] for t in global_inputs(config, "cpu"))
    kernel = select_kernel(torch.device("cpu"), q[0].dtype, config.kernel, head_dim=config.head_dim)
    forward, backward = [0.0] * world, [0.0] * world
    results = []
    for r in range(world):
        started = time.thread_time()
        out = torch.zeros_like(q[r], dtype=torch.float32)
        lse = torch.full((config.batch, config.heads, shard), float("-inf"))
        for owner in range(world):
            for seg in plan(r, owner):
                block = kernel.forward(q[r][seg.batch, seg.q_rows], k[owner][seg.batch, seg.kv_rows],
                                       v[owner][seg.batch, seg.kv_rows], seg.causal, scale)
                merge_block(out[seg.batch, seg.q_rows], lse[seg.batch, :, seg.q_rows], *block)
        forward[r] = time.thread_time() - started
        results.append((out.to(q[r].dtype), lse))
    for r in range(world):
        started = time.thread_time()
        for other in range(world):
            query, key = (other, r) if mode == "burst" else (r, other)
            out, lse = results[query]
            for seg in plan(query, key):
                rows, cols = (seg.batch, seg.q_rows), (seg.batch, seg.kv_rows)
                kernel.backward(dout[query][rows], q[query][rows], k[key][cols], v[key][cols], out[rows],
                                lse[seg.batch, :, seg.q_rows].contiguous(), seg.causal, scale)
        backward[r] = time.thread_time() - started
    return forward, backward


def run_documents_bench(config: DocumentsBenchConfig) -> tuple[list[SequenceWork], list[TimedRun]]:
    """Plan every sequence under every layout; unless plan_only, time the picked sequences (on ranks, or
    replayed)."""
    plans = count_sequences(config)
    if config.plan_only:
        return plans, []
    picks = picked_sequences(plans, config.quantiles)
    if config.replay:
        torch.set_num_threads(1)
        return plans, replay_sequences(config, picks)
    return plans, time_sequences(config, picks)


def print_documents(config: DocumentsBenchConfig, plans: list[SequenceWork], timed: list[TimedRun]) -> None:
    """Two tables that stay legible at 80 columns: the plans' figures (a row per measure, a column per layout)
    and the timed runs (the totals; the forward/backward split is in --json)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    attention, console = config.attention, Console()
    summary = summarize(plans, config.layouts)
    table = Table(title=f"{len(config.sequences)} packed sequences of {attention.seq_len:,} tokens on "
                        f"{attention.nproc} ranks, {attention.heads}/{attention.kv_heads} heads x "
                        f"{attention.head_dim}, {attention.dtype}", title_justify="left")
    table.add_column("per sequence")
    for layout in summary:
        table.add_column(layout, justify="right")
    measures = {
        "slowest rank / mean rank": lambda r: f"{r['imbalance']:.3f} [{r['imbalance_p90']:.3f}]",
        "  forward (queries' work)": lambda r: f"{r['forward_imbalance']:.3f} [{r['forward_imbalance_p90']:.3f}]",
        "  backward (keys' work)": lambda r: f"{r['backward_imbalance']:.3f} [{r['backward_imbalance_p90']:.3f}]",
        "masked share of computed tiles": lambda r: f"{100 * r['masked_share']:.1f}%",
        "pairs of ranks with no call": lambda r: f"{100 * r['idle_steps']:.0f}%",
        "chunks per rank": lambda r: f"{r['chunks_per_rank']:.1f}",
        "tiles computed, all ranks": lambda r: f"{r['tiles']:,.0f}",
        f"MiB sent per rank (bwd {attention.modes[0]})":
            lambda r: f"{r['sent_mib_mean']:.1f} [{r['sent_mib_max']:.1f}]",
        "plan ms": lambda r: f"{r['planning_ms']:.1f} [{r['planning_ms_max']:.1f}]",
    }
    for measure, cell in measures.items():
        table.add_row(measure, *(cell(row) for row in summary.values()))
    console.print(table)
    console.print("mean over the sequences [p90; for MiB and ms, max]; work in 128 x 128 tiles of the kernel calls "
                  "each rank makes; slowest / mean: the worse of forward and backward; plan ms: choosing the layout "
                  "(not memoised) and every pair of ranks' kernel calls and rows", style="dim")
    if not timed:
        return
    zigzag = {(r.sequence, r.mode): r for r in timed if r.layout == "zigzag"}
    imbalance = {p.sequence: p.imbalance for p in plans if p.layout == "zigzag"}
    title = (f"kernel calls of {attention.nproc} ranks replayed one after another on one thread" if config.replay
             else f"forward + backward on {attention.nproc} local ranks") + f", {attention.dtype}"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    columns = ["seq", "zigzag imb.", "layout", "bwd", *([] if config.replay else ["wall s", "x"]), "CPU s", "x",
               "mean CPU s", *([] if config.replay else ["MiB sent"])]
    for column in columns:
        table.add_column(column, justify="left" if column in ("layout", "bwd") else "right",
                         min_width=max(map(len, config.layouts)) if column == "layout" else None)
    for run in timed:
        base = zigzag[run.sequence, run.mode]
        wall = [] if config.replay else [f"{run.total_s:.2f}", f"{base.total_s / run.total_s:.2f}"]
        table.add_row(str(run.sequence), f"{imbalance[run.sequence]:.2f}", run.layout, run.mode, *wall,
                      f"{run.cpu_s:.2f}", f"{base.cpu_s / run.cpu_s:.2f}", f"{run.cpu_s_mean:.2f}",
                      *([] if config.replay else [f"{run.sent_mib_max:.1f}"]))
    console.print(table)
    if attention.dtype_reason:
        console.print(f"dtype {attention.dtype}: {attention.dtype_reason}", style="dim")
    console.print("wall s: forward + backward, the slowest rank, median of --iters; CPU s: the busiest rank's CPU "
                  "seconds in forward plus the busiest rank's in backward (each pass waits for its slowest rank; "
                  "unlike wall time it does not count waiting for cores that other processes hold); x: zigzag's / "
                  "this layout's, on the same sequence; mean CPU s: the mean rank's; MiB sent: forward + backward, "
                  "the rank that sent most", style="dim")


def write_documents_json(path: str, config: DocumentsBenchConfig, plans: list[SequenceWork],
                         timed: list[TimedRun]) -> None:
    with open(path, "w") as f:
        json.dump({"config": asdict(config.attention) | {"sequences": len(config.sequences), "layouts": config.layouts},
                   "summary": summarize(plans, config.layouts), "sequences": [asdict(p) for p in plans],
                   "timed": [asdict(r) | {"total_s": r.total_s, "cpu_s": r.cpu_s} for r in timed]}, f, indent=1)
