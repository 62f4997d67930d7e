"""Sliding windows (`window=W`: the query at i sees keys i - W < j <= i) against a float64 dense-mask reference:
the plan's band segments, one process, 2 and 4 gloo ranks in both backward modes, both layouts, two-level and
Ulysses, with packed documents and prefix sharing; blocks outside every window cost no call and no bytes."""

import dataclasses
import itertools
import json
import random

import pytest
import torch
from typer.testing import CliRunner

import burst
from burst import balance
from burst.balance import plan_work, windowed_work
from burst.comm import SENT
from burst.cost import plan_bytes
from burst.layout import balanced_layout, row_layouts, zigzag_layout
from burst.plan import ALL, AttentionPlan, band_segments, band_strip
from cli import app
from models import LocalAttention, ModelConfig
from models.footprint import footprint
from planner.hardware import gpu
from planner.shape import RunShape
from planner.time import model_flops, time_parts
from tests.distributed import run_on_ranks
from tests.test_balance import SMALL_TILES
from tests.test_bench import legible_at_80_columns
from tests.test_burst_attn import make_inputs

OUT_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-4  # float32 inputs against the float64 reference


def visible_mask(n: int, window: int, offsets: list[int] | None = None, sees: list[int] | None = None) -> torch.Tensor:
    """bool [n, n]: key j visible to query i. Within a document i - window < j <= i; a document that sees an
    earlier one sees the keys of it that a run of the two alone (the seen one first) would put in its window."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    offsets = [0, n] if offsets is None else offsets
    doc = torch.bucketize(torch.arange(n), torch.tensor(offsets[1:-1]), right=True)
    visible = (doc[:, None] == doc[None, :]) & (j <= i) & (i - j < window)
    if sees is not None:
        start, end = torch.tensor(offsets[:-1]), torch.tensor(offsets[1:])
        seen = torch.tensor(sees)[doc]  # [n]: the document each query's document sees, or -1
        virtual = i - start[doc][:, None] + end[seen.clamp(min=0)][:, None]  # the query's position after it
        visible |= (seen[:, None] >= 0) & (seen[:, None] == doc[None, :]) & (virtual - j < window)
    return visible


def reference(q, k, v, dout, masks: list[torch.Tensor]):
    """float64 (out, lse, dq, dk, dv) of attention with one visibility mask [s, s] per batch row."""
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    kh, vh = (t.repeat_interleave(groups, 2).transpose(1, 2) for t in (kr, vr))
    scores = qr.transpose(1, 2) @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5  # [b, h, s, s]
    scores = scores.masked_fill(~torch.stack(masks)[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = (torch.softmax(scores, -1) @ vh).transpose(1, 2)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad


def compare(got, expected, what: str) -> None:
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        err = (g.double() - e).abs().max().item()
        limit = OUT_TOLERANCE if name in ("out", "lse") else GRAD_TOLERANCE
        assert err <= limit, f"{name}: {err:.2e} ({what})"


# ---- the plan


def dense(segments, rows: int, cols: int) -> torch.Tensor:
    """How many segments cover each pair [rows, cols], checking each segment's promises on the way."""
    covered = torch.zeros(rows, cols, dtype=torch.int64)
    for s in segments:
        n_r, n_c = s.q_rows.stop - s.q_rows.start, s.kv_rows.stop - s.kv_rows.start
        r, c = torch.arange(n_r)[:, None], torch.arange(n_c)[None, :]
        if s.band is not None:
            lo, hi = s.band
            seen = (r - c >= lo) & (r - c <= hi)
            assert seen.any(1).all() and seen.any(0).all(), f"a row or column of {s} sees nothing"
            assert n_r <= 512 and n_c <= 1023, f"band segment {s} is larger than the masks' bound"
        else:
            assert not s.causal or n_r == n_c
            seen = r >= c if s.causal else torch.ones(n_r, n_c, dtype=torch.bool)
        covered[s.q_rows, s.kv_rows] += seen
    return covered


def test_band_segments_cover_the_band_once():
    """Every pair of a rectangle inside the window is computed by exactly one segment, none outside it."""
    rng = random.Random(0)
    for _ in range(400):
        rows, cols, distance = rng.randint(1, 300), rng.randint(1, 300), rng.randint(-40, 700)
        window = rng.choice([rng.randint(1, 40), rng.randint(1, 400), rng.randint(100, 1200)])
        d = distance + torch.arange(rows)[:, None] - torch.arange(cols)[None, :]
        want = ((d >= 0) & (d < window)).long()
        got = dense(band_segments(ALL, slice(0, rows), slice(0, cols), distance, True, window), rows, cols)
        assert torch.equal(got, want), (rows, cols, distance, window)


def test_band_strips_waste_little():
    """At a realistic window the computed area (band segments in full, causal squares by half) is within 1.25x
    of the band's own, in 3 calls per strip of query rows."""
    window, rows = 512, 4096
    segments = band_segments(ALL, slice(0, rows), slice(0, rows), 0, True, window)
    area = sum((s.q_rows.stop - s.q_rows.start) * (s.kv_rows.stop - s.kv_rows.start) // (2 if s.causal else 1)
               for s in segments)
    band = sum(min(i + 1, window) for i in range(rows))
    assert area <= 1.25 * band
    assert len(segments) <= 3 * rows // band_strip(window)


def test_far_shards_get_nothing():
    """At 4 ranks of 2 chunks of 64 with a window of 20, a rank's queries see only the chunk before each of
    theirs: the other shards have no work and send no rows; of the ones it needs only the last 19 rows travel."""
    layout = zigzag_layout(512, 4)
    plan = AttentionPlan([layout], True, None, window=20)
    for query_owner, kv_owner in itertools.product(range(4), repeat=2):
        chunks = {c for c in layout.chunks[query_owner]} | {c - 1 for c in layout.chunks[query_owner]}
        needed = bool(chunks & set(layout.chunks[kv_owner]))
        assert plan.has_work(query_owner, kv_owner) == needed, (query_owner, kv_owner)
        rows = plan.key_rows(query_owner, kv_owner)
        if needed and query_owner != kv_owner:
            assert rows.count == 19, (query_owner, kv_owner, rows)


def test_the_balance_counts_each_chunks_band():
    """`windowed_work`: each chunk's queries' visible pairs, and the queries that see each chunk's keys, as the
    dense mask counts them (in tiles' area), with documents and prefix sharing."""
    seq, chunks, tile, window = 240, 8, 4, 37
    boundaries, sees = [0, 100, 160, 200, 240], [-1, 0, 0, -1]
    mask = visible_mask(seq, window, boundaries, sees).double()
    work = windowed_work(boundaries, seq, chunks, tile, window, sees)
    per_chunk = lambda counts: counts.view(chunks, -1).sum(1) / tile**2  # noqa: E731
    assert torch.allclose(torch.tensor(work.forward, dtype=torch.float64), per_chunk(mask.sum(1)))
    assert torch.allclose(torch.tensor(work.backward, dtype=torch.float64), per_chunk(mask.sum(0)))


def test_a_windowed_model_is_laid_out_for_its_windows():
    """A model whose layers all have a window of 512 keeps zigzag on long documents (its work is even along
    them), where the causal layout cuts them into more chunks; the layout balances the windowed plan's work."""
    seq, world, window = 32768, 4, 512
    boundaries = (0, 3000, 3900, 23900, seq)
    causal = balanced_layout(boundaries, seq, world)
    windowed = balanced_layout(boundaries, seq, world, windows=(window,) * 4)
    assert len(causal.chunks[0]) > len(windowed.chunks[0])
    work = plan_work(AttentionPlan([windowed], True, [list(boundaries)], window=window))
    for loads in (work.forward, work.backward):
        assert max(loads) <= 1.05 * sum(loads) / world


def test_bad_windows_are_refused():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="positive number"):
        burst.local_attn(q, q, q, window=0)
    with pytest.raises(ValueError, match="causal=True"):
        burst.local_attn(q, q, q, window=4, causal=False)


# ---- one process


CASES_ONE_PROCESS = {  # name -> (seq, window, boundaries per row or None, sees per row or None)
    "narrower than a strip": (200, 13, None, None),
    "strips with full middles": (600, 300, None, None),
    "wider than the sequence": (96, 500, None, None),
    "documents": (300, 40, [[0, 50, 51, 170, 300], [0, 300]], None),
    "prefix sharing": (320, 70, [[0, 100, 160, 200, 320], [0, 40, 200, 260, 320]], [[-1, 0, 0, -1], [-1, -1, 1, 1]]),
}


@pytest.mark.parametrize("case", CASES_ONE_PROCESS)
def test_one_process_matches_the_reference(case):
    seq, window, boundaries, sees = CASES_ONE_PROCESS[case]
    q, k, v, dout = make_inputs(seq, 4, 2, torch.float32, seed=3, head_dim=8)
    masks = [visible_mask(seq, window, None if boundaries is None else boundaries[r],
                          None if sees is None else sees[r]) for r in range(2)]
    expected = reference(q, k, v, dout, masks)
    documents = {} if boundaries is None else {"doc_boundaries": [torch.tensor(b) for b in boundaries]}
    if sees is not None:
        documents["doc_sees"] = [torch.tensor(s) for s in sees]
    for kernel in ("cpu", "math"):
        lq, lk, lv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = burst.local_attn(lq, lk, lv, window=window, kernel=kernel, return_lse=True, **documents)
        out.backward(dout)
        compare([out.detach(), lse, lq.grad, lk.grad, lv.grad], expected, f"{case}, {kernel}")


def test_the_model_attention_takes_a_window():
    """A model's attention module passes its layer's window on (models/attention.py)."""
    q, k, v, dout = make_inputs(64, 4, 2, torch.float32, seed=4, head_dim=8)
    expected = reference(q, k, v, dout, [visible_mask(64, 9)] * 2)
    out = LocalAttention()(q, k, v, window=9)
    assert (out.double() - expected[0]).abs().max() <= OUT_TOLERANCE


# ---- ranks


def check_ranks(world_size, window, boundaries, sees, mode, layout="zigzag", topology="flat", node_size=None,
                check_ranks_agree=True, layout_windows=None):
    seq = 2 * world_size * 24
    q, k, v, dout = make_inputs(seq, 4, 2, torch.float32, seed=world_size, head_dim=8)
    masks = [visible_mask(seq, window, None if boundaries is None else boundaries[r],
                          None if sees is None else sees[r]) for r in range(2)]
    expected = reference(q, k, v, dout, masks)
    cut = {"layout": layout, "layout_windows": layout_windows}
    if boundaries is not None:
        cut["doc_boundaries"] = [torch.tensor(b) for b in boundaries]
    if sees is not None:
        cut["doc_sees"] = [torch.tensor(s) for s in sees]
    lq, lk, lv = (burst.shard_sequence(t, **cut).requires_grad_() for t in (q, k, v))
    out, lse = burst.burst_attn(lq, lk, lv, backward=mode, topology=topology, node_size=node_size, return_lse=True,
                                window=window, check_ranks=check_ranks_agree, **cut)
    out.backward(burst.shard_sequence(dout, **cut))
    got = [burst.gather_sequence(out.detach(), **cut), burst.gather_sequence(lse, dim=2, **cut)]
    got += [burst.gather_sequence(t.grad, **cut) for t in (lq, lk, lv)]
    compare(got, expected, f"world {world_size}, window {window}, {boundaries}, {sees}, {mode}, {layout}, {topology}")
    return lq, lk


def documents(seq: int) -> tuple[list[list[int]], list[list[int]]]:
    """(boundaries, sees) of two rows: a preference pair and a plain document; plain documents of three lengths."""
    return ([[0, seq * 5 // 8, seq * 6 // 8, seq * 29 // 32, seq], [0, 7, seq // 3, seq // 2 + 1, seq]],
            [[-1, 0, 0, -1], [-1, -1, -1, -1]])


def check_bytes_follow_the_plan(rank, world_size, window):
    """The bytes each rank sends are what the plan counts (the ranks' agreement check aside): the window's
    rows, nothing to far shards."""
    lq, lk = check_ranks(world_size, window, None, None, "burst", check_ranks_agree=False)  # no all-gather counted
    plan = AttentionPlan(row_layouts("zigzag", None, lq.shape[1] * world_size, world_size, 2), True, None,
                         window=window)
    forward, _, backward, _ = plan_bytes(plan, "flat", lq, lk, "burst", world_size, rank)
    assert (SENT.last_forward, SENT.last_backward) == (forward, backward)
    # zigzag: chunk r's last window - 1 keys go to the holder of chunk r + 1 (rank r + 1, or itself at the
    # middle), chunk 2W - 1 - r's to the holder of chunk 2W - r (rank r - 1): k and v of 2 batch rows
    targets = (rank + 1 < world_size) + (rank > 0)
    assert forward == targets * (window - 1) * 2 * lk.shape[0] * lk[0, 0].numel() * lk.element_size()


def check_the_module_passes_a_layers_window(world_size):
    """`BurstAttention`, as parallelize swaps it in, attends with the window the model's layer passes."""
    q, k, v, dout = make_inputs(2 * world_size * 24, 4, 2, torch.float32, seed=5, head_dim=8)
    expected = reference(q, k, v, dout, [visible_mask(q.shape[1], 11)] * 2)[0]
    out = burst.BurstAttention()(*(burst.shard_sequence(t) for t in (q, k, v)), window=11)
    assert (burst.gather_sequence(out).double() - expected).abs().max() <= OUT_TOLERANCE


def _cases(rank, world_size):
    balance.OPTIONS = SMALL_TILES  # chunks of 8 tokens and more: real permutations on short sequences
    seq = 2 * world_size * 24
    boundaries, sees = documents(seq)
    for window, mode in itertools.product((5, 30, 70), ("burst", "ring")):
        check_ranks(world_size, window, None, None, mode)
    check_ranks(world_size, 30, boundaries, None, "burst", "balanced")
    check_ranks(world_size, 30, boundaries, sees, "ring", "balanced", layout_windows=(30, None, 70))
    check_ranks(world_size, 70, boundaries, sees, "burst")
    check_bytes_follow_the_plan(rank, world_size, 5)
    check_the_module_passes_a_layers_window(world_size)
    if world_size == 2:
        q = burst.shard_sequence(torch.randn(1, 96, 2, 8))
        with pytest.raises(ValueError, match="window: rank 0 5, rank 1 6"):
            burst.burst_attn(q, q, q, window=5 + rank)
        # documents balanced for causal layers, given to the attention of a windowed model as the model gives them
        causal = burst.Documents.of([boundaries[1]], seq, world_size, "balanced")
        module = burst.BurstAttention(layout="balanced", layout_windows=(30, None))
        with pytest.raises(ValueError, match=r"weighs no sliding window, but the attention's layers have the sliding "
                                             r"windows \[30, None\]"):
            module(q, q, q, causal, window=30)
    if world_size == 4:  # the other topologies, on 2 simulated nodes of 2
        check_ranks(4, 30, boundaries, sees, "ring", "zigzag", "two-level", 2)
        check_ranks(4, 30, boundaries, sees, "burst", "balanced", "ulysses", 2, layout_windows=(30,))
        check_ranks(4, 70, None, None, "burst", "zigzag", "two-level", 2)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_match_the_reference(world_size):
    """Both backward modes, zigzag and balanced, with documents and prefix sharing; two-level and Ulysses on 2 x 2."""
    run_on_ranks(_cases, world_size, timeout_s=300)


# ---- the benchmark


def test_bench_counts_each_rank_against_the_band(tmp_path):
    """`burst bench attention --window --plan-only`: every rank's computed pairs and bytes within 1.25x of what the
    window itself asks of it (worked out from the positions the ranks hold), far below full causal's; its tiles of
    128 x 128 the band's own, counted on the dense mask; its kernel calls the fewest any plan can make."""
    out = tmp_path / "window.json"
    result = CliRunner().invoke(app, ["bench", "attention", "--window", "512", "--seq-len", "8192", "--nproc", "4",
                                      "--plan-only", "--modes", "burst", "--dtype", "bf16", "--json", str(out)],
                                env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    legible_at_80_columns(result.output, "per rank", "causal / window")
    written = json.loads(out.read_text())
    ranks, batch = written["ranks"], written["config"]["batch"]
    # the band's own tiles, from the dense mask: a rank's queries 128 at a time against the 128-key tiles
    visible, layout = visible_mask(8192, 512), zigzag_layout(8192, 4)
    for rank, (window, band) in enumerate(zip(ranks["window"], ranks["band"], strict=True)):
        rows = visible[layout.positions(rank)].view(-1, 128, 64, 128)  # [query tile, row, key tile, column]
        assert band["tiles"] == batch * int(rows.any(3).any(1).sum())
        assert window["tiles"] == band["tiles"]  # the plan computes the band's tiles, no more
    # the fewest calls: a chunk of 1,024 positions against its own stretch and the one before it (rank 3 holds
    # chunks 3 and 4 as one stretch, rank 0 chunk 0 with nothing before it); the plan makes exactly those, one
    # band call each, for a kernel that takes the window (tests/test_window_kernels.py counts the ranks' calls)
    assert [band["calls"] for band in ranks["band"]] == [3, 4, 4, 2]
    assert [window["calls"] for window in ranks["window"]] == [3, 4, 4, 2]
    for window, causal, band in zip(ranks["window"], ranks["causal"], ranks["band"], strict=True):
        assert window["steps"] == band["steps"] < causal["steps"]
        assert band["visible_pairs"] <= window["computed_pairs"] <= 1.25 * band["visible_pairs"]
        for sent in ("sent_forward_mib", "sent_backward_mib"):
            assert 0 < band[sent] <= window[sent] <= 1.25 * band[sent]
            assert causal[sent] > 4 * window[sent]
        assert causal["computed_pairs"] > 4 * window["computed_pairs"]


def test_bench_times_windowed_runs_beside_full_causal(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "attention", "--window", "16", "--nproc", "2", "--seq-len", "256",
                                      "--heads", "2", "--head-dim", "16", "--iters", "1", "--modes", "burst",
                                      "--dtype", "bf16", "--json", str(out)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    runs = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"single process", "single process window 16", "burst x2", "burst window 16 x2"}
    # the window's 15 keys of k and v before rank 1's first chunk, against all of rank 0's shard
    assert runs["burst window 16 x2"]["sent_forward_mib"] < runs["burst x2"]["sent_forward_mib"] / 4


# ---- burst plan


def test_the_planner_counts_each_layers_window():
    """A model whose layers have windows: the FLOPs and attention time count each layer's band, the FLOPs exactly
    the band's pairs (sum over queries of min(i + 1, W)) against the causal triangle's."""
    seq, window = 4096, 256
    model = footprint(ModelConfig.from_name("tiny"))
    local = dataclasses.replace(model, windows=(window,) * (model.layers - 1) + (None,))  # one global layer
    shape = RunShape(seq_len=seq, cp=2)
    band = sum(min(i + 1, window) for i in range(seq))
    causal = seq * (seq + 1) // 2
    saved = 3 * 4 * model.heads * model.head_dim * (model.layers - 1) * (causal - band)  # forward and backward
    assert model_flops(shape, model) - model_flops(shape, local) == saved
    hardware = gpu("h200")
    assert time_parts(shape, local, hardware)["attention"] < time_parts(shape, model, hardware)["attention"] / 2
