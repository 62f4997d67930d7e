"""The balanced layout: a deterministic permutation of equal chunks that evens the ranks' work, and
burst_attn under it against the float64 reference on 2-4 gloo ranks, with the bytes its plan needs."""

import itertools
import random

import pytest
import torch
import torch.distributed as dist

import burst
from burst import balance
from burst.balance import BalanceOptions, choose_chunks, chunk_work, layout_cost, plan_work
from burst.cost import plan_bytes
from burst.layout import balanced_layout, row_layouts, zigzag_layout
from burst.plan import AttentionPlan
from tests.distributed import run_on_ranks
from tests.test_burst_attn import TOLERANCE, make_inputs
from tests.test_doc_mask import reference
from tests.test_topology import check_case

# Packed lengths (BOS + document + EOS) of 48 documents drawn with seed 0 from the default corpus
# (the standard library's train split: median 2,154, p90 15,558).
REAL_LENGTHS = [10, 16, 41, 46, 56, 72, 130, 174, 303, 314, 355, 602, 809, 834, 854, 968, 1228, 1374, 1849, 1909,
                1926, 1945, 2360, 2474, 3027, 3041, 3137, 3263, 3496, 3819, 4275, 5422, 5477, 5848, 6661, 6847, 7129,
                8153, 8346, 8830, 9722, 9728, 13317, 16259, 18073, 23411, 29145, 30557]
# A tile of 4 tokens: chunks of 2 tiles and more, so that short test sequences reach several chunks per rank.
SMALL_TILES = BalanceOptions(tile=4, min_chunk_tiles=2)


def packed(seq_len: int, seed: int, scale: float = 1.0) -> list[int]:
    """Document offsets of a sequence packed as the loader packs it: REAL_LENGTHS x `scale` in a seeded
    order, the first document continued from the previous sequence."""
    rng = random.Random(seed)
    lengths = [max(1, round(n * scale)) for n in REAL_LENGTHS]
    rng.shuffle(lengths)
    offsets, end = [0], -rng.randrange(lengths[0])
    for n in lengths * 4:
        end += n
        if end >= seq_len:
            break
        if end > 0:
            offsets.append(end)
    return offsets + [seq_len]


def imbalance(layout, boundaries, causal=True, tile=128) -> tuple[float, float]:
    """Slowest rank's forward and backward tiles over the mean rank's, counted from the plan's calls."""
    work = plan_work(AttentionPlan([layout], causal, [boundaries]), tile)
    return (max(work.forward) / (sum(work.forward) / len(work.forward)),
            max(work.backward) / (sum(work.backward) / len(work.backward)))


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_a_layout_is_a_permutation_of_equal_chunks_and_the_same_every_time(world_size):
    seq_len = 2 * 3 * 4 * 8 * 128
    for seed in range(6):
        boundaries = tuple(packed(seq_len, seed, seq_len / 32768))
        layout = balanced_layout(boundaries, seq_len, world_size)
        held = [c for chunks in layout.chunks for c in chunks]
        assert sorted(held) == list(range(seq_len // layout.chunk))
        assert len({len(chunks) for chunks in layout.chunks}) == 1
        assert all(list(chunks) == sorted(chunks) for chunks in layout.chunks)
        assert layout.chunk % 128 == 0 and (layout.chunk >= 512 or len(layout.chunks[0]) == 2)
        recomputed = choose_chunks(boundaries, seq_len, world_size, zigzag_layout(seq_len, world_size).chunks)
        assert recomputed == (layout.chunk, layout.chunks)  # the same when computed again, not only remembered
        positions = torch.cat([layout.positions(r) for r in range(world_size)])
        assert sorted(positions.tolist()) == list(range(seq_len))


def test_known_inputs_balance_exactly():
    seq_len, world = 8192, 4
    one_document = balanced_layout((0, seq_len), seq_len, world)
    assert imbalance(one_document, [0, seq_len]) == (1.0, 1.0)  # zigzag's case: it stays perfect
    aligned = tuple(range(0, seq_len + 1, seq_len // 8))  # 8 equal documents on chunk boundaries
    assert imbalance(balanced_layout(aligned, seq_len, world), list(aligned)) == (1.0, 1.0)


@pytest.mark.parametrize("world_size", [4, 8])
def test_real_lengths_balance_within_the_targets_and_never_worse_than_zigzag(world_size):
    seq_len, worst = 32768, []
    for seed in range(8):
        boundaries = packed(seq_len, seed)
        balanced = balanced_layout(tuple(boundaries), seq_len, world_size)
        zigzag = zigzag_layout(seq_len, world_size)
        worst.append(max(imbalance(balanced, boundaries)))
        assert worst[-1] <= max(imbalance(zigzag, boundaries)) + 1e-9, seed
        work = chunk_work(boundaries, seq_len, 2 * world_size, 128)  # in the cost model: never worse
        assert layout_cost(balanced.chunks, chunk_work(boundaries, seq_len, seq_len // balanced.chunk, 128),
                           1.0) <= layout_cost(zigzag.chunks, work, 1.0) + 1e-9
    assert sum(worst) / len(worst) <= 1.08 and max(worst) <= 1.15, worst


def test_masked_tiles_are_few_and_every_visible_pair_is_computed_once():
    seq_len, world = 32768, 8
    boundaries = packed(seq_len, 3)
    layout = balanced_layout(tuple(boundaries), seq_len, world)
    work = plan_work(AttentionPlan([layout], True, [boundaries]), 128)
    visible = sum((b - a) * (b - a + 1) // 2 for a, b in itertools.pairwise(boundaries))
    assert work.visible_pairs == visible
    assert work.masked_share < 0.05


def _balanced_cases(rank, world_size):
    balance.OPTIONS = SMALL_TILES
    seq = 384
    rows = [packed(seq, 7, seq / 8192), packed(seq, 11, seq / 8192)]
    layouts = row_layouts("balanced", rows, seq, world_size, 2)
    assert any(lay != zigzag_layout(seq, world_size) for lay in layouts)  # the test exercises real permutations
    mine = [torch.tensor([c for chunks in lay.chunks for c in chunks]) for lay in layouts]
    every = [None] * world_size
    dist.all_gather_object(every, [m.tolist() for m in mine])
    assert all(e == every[0] for e in every), "ranks chose different layouts"
    cases = {2: [(True, (4, 2), "burst"), (True, (4, 4), "ring"), (False, (4, 4), "burst")],
             3: [(True, (4, 2), "ring"), (True, (4, 4), "burst")],
             4: [(True, (4, 2), "burst")]}[world_size]
    for causal, heads, mode in cases:
        check_balanced(world_size, rows, causal, heads, mode)
    if world_size == 3:
        check_bytes_follow_the_plan(rank, world_size)
    if world_size == 2:
        check_ranks_that_chose_differently_are_refused(rank, rows)
    if world_size == 4:  # the other topologies, on 2 simulated nodes of 2
        check_case(4, 2, "two-level", True, (4, 2), "ring", docs=True, layout="balanced", boundaries=rows)
        check_case(4, 2, "ulysses", True, (4, 2), "burst", docs=True, layout="balanced", boundaries=rows)


def check_ranks_that_chose_differently_are_refused(rank, rows):
    """Ranks whose options differ (as two machines' arithmetic might) choose different layouts for the same
    documents: the agreement check says so on every rank instead of computing on mismatched shards."""
    seq = rows[0][-1]
    assert row_layouts("balanced", rows, seq, 2, 2) != [balanced_layout(tuple(r), seq, 2) for r in rows]
    if rank == 1:
        balance.OPTIONS = balance.DEFAULT_OPTIONS
    q = burst.shard_sequence(torch.randn(2, seq, 2, 8), layout="balanced", doc_boundaries=rows)
    with pytest.raises(ValueError, match="chosen layouts: rank 0 fingerprint .*, rank 1 fingerprint"):
        burst.burst_attn(q, q, q, doc_boundaries=rows, layout="balanced")
    balance.OPTIONS = SMALL_TILES
    dist.barrier()


def check_balanced(world_size, rows, causal, heads, mode):
    seq = rows[0][-1]
    q, k, v, dout = make_inputs(seq, *heads, torch.float32, seed=world_size)
    expected = reference(q, k, v, dout, rows, causal)
    cut = {"layout": "balanced", "doc_boundaries": [torch.tensor(b) for b in rows]}
    lq, lk, lv = (burst.shard_sequence(t, **cut).requires_grad_() for t in (q, k, v))
    out, lse = burst.burst_attn(lq, lk, lv, causal=causal, backward=mode, return_lse=True, **cut)
    out.backward(burst.shard_sequence(dout, **cut))
    got = [burst.gather_sequence(out.detach(), **cut), burst.gather_sequence(lse, dim=2, **cut)]
    got += [burst.gather_sequence(t.grad, **cut) for t in (lq, lk, lv)]
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        err = (g.double() - e).abs().max().item()
        assert err <= TOLERANCE[torch.float32], f"{name}: {err:.2e} (world {world_size}, {causal=}, {heads=}, {mode})"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_balanced_layout_matches_the_reference_and_sends_what_its_plan_needs(world_size):
    """Causal and not, MHA and GQA, both backward modes, each topology (flat at 2-4 ranks, two-level and
    Ulysses on 2 x 2); at 3 ranks, steps without kernel calls send nothing."""
    run_on_ranks(_balanced_cases, world_size, timeout_s=300)


def check_bytes_follow_the_plan(rank, world_size):
    seq = 8 * world_size
    docs = [torch.tensor(list(range(0, seq + 1, 4)))]  # a document per zigzag chunk: no rank needs another's block
    q = burst.shard_sequence(torch.randn(1, seq, 2, 8)).requires_grad_()
    burst.burst_attn(q, q, q, doc_boundaries=docs, backward="burst", check_ranks=False).sum().backward()
    assert burst.SENT.last_forward == 0 and burst.SENT.last_backward == 0
    docs = [torch.tensor([0, 6, seq])]  # two documents: some pairs of ranks share one, others not
    plan = AttentionPlan(row_layouts("zigzag", None, seq, world_size, 1), True, [docs[0].tolist()])
    for mode in ("burst", "ring"):
        q = burst.shard_sequence(torch.randn(1, seq, 2, 8)).requires_grad_()
        burst.burst_attn(q, q, q, doc_boundaries=docs, backward=mode, check_ranks=False).sum().backward()
        planned = plan_bytes(plan, "flat", q, q, mode, world_size, rank)
        assert (burst.SENT.last_forward, burst.SENT.last_backward) == (planned[0], planned[2])
        full = (world_size - 1) * 2 * q.numel() * q.element_size()
        idle = plan_work(plan).idle_pairs / (world_size * (world_size - 1))  # share of steps without a call
        assert idle > 0
        # bytes fall at least in proportion to the steps without work, summed over the ranks
        every = [None] * world_size
        dist.all_gather_object(every, burst.SENT.last_forward)
        assert sum(every) <= (1 - idle) * full * world_size + 1e-9


def test_balanced_without_documents_is_refused():
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match="layout 'balanced' is chosen from the documents' boundaries"):
        burst.burst_attn(q, q, q, layout="balanced")
    with pytest.raises(ValueError, match="unknown layout 'diagonal'"):
        burst.burst_attn(q, q, q, layout="diagonal")
