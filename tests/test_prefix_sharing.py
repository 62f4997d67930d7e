"""Prefix sharing: documents that also see an earlier document whole (`doc_sees`), as a preference pair
[prompt][chosen][rejected] packs with both answers seeing the prompt. burst_attn against the float64
dense-mask reference on 1-4 gloo ranks, the plan's rows (nothing of the chosen answer travels to a rank
whose queries are rejected ones), the balanced layout's counts, bad input, and the model at cp 1 against
each answer run after its prompt alone."""

import dataclasses
import itertools
import random

import pytest
import torch

import burst
from bench.attention import AttentionBenchConfig
from bench.documents import DocumentsBenchConfig, count_sequences
from burst import balance
from burst.balance import chunk_work, plan_work
from burst.cost import plan_bytes
from burst.layout import balanced_layout, row_layouts, zigzag_layout
from burst.plan import AttentionPlan, Rows
from models import LocalAttention, ModelConfig, init_model
from planner.attention import sequence_plan
from tests.distributed import run_on_ranks
from tests.test_balance import SMALL_TILES
from tests.test_burst_attn import make_inputs
from tests.test_doc_mask import reference

OUT_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-4  # float32 inputs against the float64 reference


def pair_rows(seq: int) -> tuple[list[list[int]], list[list[int]]]:
    """(boundaries, sees) of two batch rows of `seq` tokens: one pair (prompt minus its last token, chosen,
    rejected) and a plain document; a plain document and two pairs."""
    def at(*fractions):
        return [0, *(round(f * seq) for f in fractions), seq]
    return ([at(5 / 8, 6 / 8, 29 / 32), at(1 / 32, 10 / 32, 13 / 32, 15 / 32, 23 / 32, 27 / 32)],
            [[-1, 0, 0, -1], [-1, -1, 1, 1, -1, 4, 4]])


def check_shared(world_size, boundaries, sees, mode, layout="zigzag", topology="flat", node_size=None,
                 heads=(4, 2), causal=True):
    seq = boundaries[0][-1]
    q, k, v, dout = make_inputs(seq, *heads, torch.float32, seed=world_size, head_dim=8)
    expected = reference(q, k, v, dout, boundaries, causal, sees)
    cut = {"layout": layout, "doc_boundaries": [torch.tensor(b) for b in boundaries],
           "doc_sees": [torch.tensor(s) for s in sees]}
    lq, lk, lv = (burst.shard_sequence(t, **cut).requires_grad_() for t in (q, k, v))
    out, lse = burst.burst_attn(lq, lk, lv, causal=causal, backward=mode, topology=topology, node_size=node_size,
                                return_lse=True, **cut)
    out.backward(burst.shard_sequence(dout, **cut))
    got = [burst.gather_sequence(out.detach(), **cut), burst.gather_sequence(lse, dim=2, **cut)]
    got += [burst.gather_sequence(t.grad, **cut) for t in (lq, lk, lv)]
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        err = (g.double() - e).abs().max().item()
        limit = OUT_TOLERANCE if name in ("out", "lse") else GRAD_TOLERANCE
        assert err <= limit, f"{name}: {err:.2e} (world {world_size}, {mode}, {layout}, {topology}, {heads=})"


def test_one_process_matches_the_reference():
    boundaries, sees = pair_rows(48)
    for mode, causal in itertools.product(("burst", "ring"), (True, False)):
        check_shared(1, boundaries, sees, mode, causal=causal)


def _cases(rank, world_size):
    balance.OPTIONS = SMALL_TILES  # chunks of 8 tokens and more: real permutations on short sequences
    boundaries, sees = pair_rows(2 * world_size * 24)
    chosen = row_layouts("balanced", boundaries, boundaries[0][-1], world_size, 2, sees)
    assert any(lay != zigzag_layout(boundaries[0][-1], world_size) for lay in chosen)
    cases = {2: [("burst", "zigzag"), ("ring", "zigzag"), ("burst", "balanced"), ("ring", "balanced")],
             3: [("ring", "zigzag"), ("burst", "balanced")],
             4: [("burst", "zigzag"), ("ring", "balanced")]}[world_size]
    for mode, layout in cases:
        check_shared(world_size, boundaries, sees, mode, layout)
    if world_size == 2:
        check_bytes_follow_the_plan(rank)
        check_ranks_that_disagree_are_refused(rank)
    if world_size == 4:  # the other topologies, on 2 simulated nodes of 2
        check_shared(4, boundaries, sees, "ring", "zigzag", "two-level", 2)
        check_shared(4, boundaries, sees, "burst", "balanced", "ulysses", 2)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_match_the_reference(world_size):
    """Both backward modes, zigzag and balanced, at 2-4 ranks; two-level and Ulysses on 2 x 2."""
    run_on_ranks(_cases, world_size, timeout_s=300)


def rejected_on_rank_0() -> tuple[list[int], list[int]]:
    """At 2 ranks of 12-token zigzag chunks, rank 0 holds chunks 0 and 3 (the prompt's first 12 tokens and the
    rejected answer), rank 1 chunks 1 and 2 (the rest of the prompt and the chosen answer)."""
    return [0, 30, 36, 48], [-1, 0, 0]


def test_a_rank_of_rejected_queries_gets_no_chosen_keys():
    boundaries, sees = rejected_on_rank_0()
    plan = AttentionPlan(row_layouts("zigzag", None, 48, 2, 1), True, [boundaries], [sees])
    # rank 1's shard: the prompt's positions 12..29 at rows 0..17, the chosen answer's 30..35 at rows 18..23
    assert plan.key_rows(0, 1) == Rows(((0, 18),), 24)  # the prompt's rows only
    assert plan.query_rows(0, 1) == Rows(((12, 24),), 24)  # only the rejected queries (rows 12..23) see them
    assert plan.key_rows(1, 0) == Rows(((0, 12),), 24)  # rank 1's prompt and chosen queries: the prompt's start
    plain = AttentionPlan(row_layouts("zigzag", None, 48, 2, 1), True, [boundaries])
    assert plain.key_rows(0, 1) is None  # without sharing the rejected answer sees nothing of rank 1


def check_bytes_follow_the_plan(rank):
    boundaries, sees = rejected_on_rank_0()
    plan = AttentionPlan(row_layouts("zigzag", None, 48, 2, 1), True, [boundaries], [sees])
    for mode in ("burst", "ring"):
        q = burst.shard_sequence(torch.randn(1, 48, 2, 8)).requires_grad_()
        burst.burst_attn(q, q, q, doc_boundaries=[torch.tensor(boundaries)], doc_sees=[torch.tensor(sees)],
                         backward=mode, check_ranks=False).sum().backward()
        planned = plan_bytes(plan, "flat", q, q, mode, 2, rank)
        assert (burst.SENT.last_forward, burst.SENT.last_backward) == (planned[0], planned[2]), mode


def check_ranks_that_disagree_are_refused(rank):
    boundaries, sees = rejected_on_rank_0()
    q = burst.shard_sequence(torch.randn(1, 48, 2, 8))
    mine = [torch.tensor(sees if rank == 0 else [-1, 0, -1])]
    with pytest.raises(ValueError, match="doc_sees: rank 0 fingerprint .*, rank 1 fingerprint"):
        burst.burst_attn(q, q, q, doc_boundaries=[torch.tensor(boundaries)], doc_sees=mine)


def test_every_visible_pair_is_computed_once_and_sharing_adds_only_the_seen_rectangles():
    seq, world = 192, 3
    boundaries, sees = pair_rows(seq)
    for layout in (zigzag_layout(seq, world), balanced_layout(tuple(boundaries[1]), seq, world, SMALL_TILES,
                                                              tuple(sees[1]))):
        shared = plan_work(AttentionPlan([layout], True, boundaries[1:], sees[1:]), tile=4)
        plain = plan_work(AttentionPlan([layout], True, boundaries[1:]), tile=4)
        offsets, seen = boundaries[1], sees[1]
        lengths = [b - a for a, b in itertools.pairwise(offsets)]
        assert plain.visible_pairs == sum(n * (n + 1) // 2 for n in lengths)
        assert shared.visible_pairs == plain.visible_pairs + sum(lengths[i] * lengths[j] for i, j in enumerate(seen)
                                                                 if j >= 0)


def packed_pairs(seq: int, seed: int) -> tuple[list[int], list[int]]:
    """(boundaries, sees) of preference pairs (prompts of 500-4,000 tokens, answers of 50-400) packed into `seq`
    tokens as the pair packer lays them out, the rest one plain document."""
    rng, boundaries, sees = random.Random(seed), [0], []
    while True:
        prompt, chosen, rejected = rng.randrange(500, 4000), rng.randrange(50, 400), rng.randrange(50, 400)
        start = boundaries[-1]
        if start + prompt + chosen + rejected + 1 > seq:
            break
        boundaries += [start + prompt - 1, start + prompt + chosen, start + prompt + chosen + rejected + 1]
        sees += [-1, len(boundaries) - 4, len(boundaries) - 4]
    return boundaries + [seq], sees + [-1]


def test_the_balanced_layout_counts_the_seen_rectangles():
    """A long prompt's keys are seen by both answers: the chunk model counts them, and a layout chosen with them
    balances the ranks where one chosen without them does not."""
    seq = 8192
    boundaries, sees = [0, 3000, 3300, 3600, seq], [-1, 0, 0, -1]
    work, plain = chunk_work(boundaries, seq, 8, 128, sees), chunk_work(boundaries, seq, 8, 128)
    assert all(work.backward[c] > plain.backward[c] for c in range(3))  # the prompt fills chunks 0-2
    assert work.forward[3] > plain.forward[3]  # the answers' queries (chunk 3) see the prompt's keys
    assert sum(work.forward) == sum(work.backward)
    seq, worst = 16384, []
    for world, seed in itertools.product((2, 4), range(4)):
        boundaries, sees = packed_pairs(seq, seed)
        layouts = {"aware": balanced_layout(tuple(boundaries), seq, world, sees=tuple(sees)),
                   "blind": balanced_layout(tuple(boundaries), seq, world), "zigzag": zigzag_layout(seq, world)}
        slowest = {}
        for name, layout in layouts.items():
            counted = plan_work(AttentionPlan([layout], True, [boundaries], [sees]))
            slowest[name] = max(max(counted.forward), max(counted.backward)) / (sum(counted.forward) / world)
        assert slowest["aware"] <= slowest["zigzag"] + 1e-9, (world, seed, slowest)
        if (world, seed) == (4, 1):
            assert slowest["blind"] >= 1.3, slowest  # the seen rectangles matter: without them the layout is off
        worst.append(slowest["aware"])
    assert max(worst) <= 1.1 and sum(worst) / len(worst) <= 1.07, worst


def test_documents_that_see_none_are_plain_document_masking():
    boundaries, _ = pair_rows(48)
    q, k, v, _ = make_inputs(48, 4, 2, torch.float32, head_dim=8)
    docs = [torch.tensor(b) for b in boundaries]
    none = [torch.full((len(b) - 1,), -1) for b in boundaries]
    plain = burst.burst_attn(q, k, v, doc_boundaries=docs, return_lse=True)
    same = burst.burst_attn(q, k, v, doc_boundaries=docs, doc_sees=none, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, same, strict=True))
    assert torch.equal(LocalAttention()(q, k, v, docs), LocalAttention()(q, k, v, docs, none))
    layout = zigzag_layout(48, 3)
    with_none = AttentionPlan([layout] * 2, True, boundaries, [[-1] * (len(b) - 1) for b in boundaries])
    without = AttentionPlan([layout] * 2, True, boundaries)
    assert all(with_none(a, b) == without(a, b) for a in range(3) for b in range(3))


@pytest.mark.parametrize("sees, message", [
    ([[-1, 1, 0]], "document 1 sees 1, but a document may only see an earlier one"),
    ([[-1, 0, 2]], "document 2 sees 2"),
    ([[-2, 0, 0]], "document 0 sees -2"),
    ([[-1, 0]], "doc_sees row 0 has 2 entries but doc_boundaries row 0 has 3 documents"),
    ([[-1, 0, 0], [-1, 0, 0]], "doc_sees has 2 rows but doc_boundaries has 1"),
])
def test_bad_doc_sees_are_refused(sees, message):
    """The ring and the one-process attention check doc_sees with the same words."""
    q = torch.randn(1, 48, 2, 8)
    docs, sees = [torch.tensor([0, 30, 36, 48])], [torch.tensor(s) for s in sees]
    with pytest.raises(ValueError, match=message):
        burst.burst_attn(q, q, q, doc_boundaries=docs, doc_sees=sees)
    with pytest.raises(ValueError, match=message):
        LocalAttention()(q, q, q, docs, sees)


def test_doc_sees_needs_doc_boundaries():
    q = torch.randn(1, 48, 2, 8)
    for attention in (lambda: burst.burst_attn(q, q, q, doc_sees=[torch.tensor([-1])]),
                      lambda: LocalAttention()(q, q, q, None, [torch.tensor([-1])])):
        with pytest.raises(ValueError, match="pass doc_boundaries too"):
            attention()


def test_a_packed_pair_gives_each_answer_the_logits_of_its_prompt_alone():
    """[prompt minus its last token][prompt's last token + chosen][prompt's last token + rejected]: each answer
    document, with positions continued from the prompt's end, gets the logits of prompt + answer unpacked,
    through LocalAttention and through burst_attn at cp 1."""
    config = dataclasses.replace(ModelConfig.from_name("debug"), n_layers=2)
    model = init_model(config, seed=3)
    g = torch.Generator().manual_seed(0)
    prompt, chosen, rejected = (torch.randint(config.vocab_size, (n,), generator=g) for n in (13, 5, 7))
    p = len(prompt)
    tokens = torch.cat([prompt, chosen, prompt[-1:], rejected])[None]
    positions = torch.cat([torch.arange(p + len(chosen)), torch.arange(p - 1, p + len(rejected))])[None]
    boundaries = [torch.tensor([0, p - 1, p + len(chosen), tokens.shape[1]])]
    sees = [torch.tensor([-1, 0, 0])]
    alone = {name: model(torch.cat([prompt, answer])[None])[0] for name, answer in
             (("chosen", chosen), ("rejected", rejected))}
    for core in (LocalAttention(), burst.BurstAttention()):
        for layer in model.layers:
            layer.attention.core_attention = core
        with torch.no_grad():
            packed = model(tokens, positions, boundaries, sees)[0]
        torch.testing.assert_close(packed[:p - 1], alone["chosen"][:p - 1], rtol=0, atol=1e-5)  # the prompt
        torch.testing.assert_close(packed[p - 1:p + len(chosen)], alone["chosen"][p - 1:], rtol=0, atol=1e-5)
        torch.testing.assert_close(packed[p + len(chosen):], alone["rejected"][p - 1:], rtol=0, atol=1e-5)
        loss_sum, count = model.loss(tokens, tokens, positions, boundaries, sees)
        assert count == tokens.shape[1] and torch.isfinite(loss_sum)


def test_the_documents_bench_counts_a_shared_pair_against_two_unshared_sequences():
    """An 8K-token prompt with two 256-token answers at cp 2, counted by `burst bench attention --docs`'s planner:
    packed once with sharing, the attention computes at least 1.6x fewer tiles than prompt+chosen and
    prompt+rejected packed as two documents."""
    prompt, answer = 8192, 256
    plain = DocumentsBenchConfig(AttentionBenchConfig(seq_len=2 * (prompt + answer), heads=32, kv_heads=8,
                                                      head_dim=128, dtype="bf16"),
                                 [[0, prompt + answer, 2 * (prompt + answer)]], plan_only=True)
    end = prompt + 2 * answer + 1  # the prompt's last token once more, before the rejected answer
    shared = DocumentsBenchConfig(dataclasses.replace(plain.attention, seq_len=end + 3),
                                  [[0, prompt - 1, prompt + answer, end, end + 3]], plan_only=True,
                                  sees=[[-1, 0, 0, -1]])
    (plain_zigzag, _), (shared_zigzag, shared_balanced) = count_sequences(plain), count_sequences(shared)
    assert plain_zigzag.tiles / shared_zigzag.tiles >= 1.6
    assert shared_balanced.tiles <= shared_zigzag.tiles * 1.05
    counted = plan_work(sequence_plan(shared.attention.seq_len, shared.attention.nproc, shared.sequences[0],
                                    shared.sees[0], "zigzag", shared.attention.batch))
    assert shared_zigzag.tiles == sum(counted.forward)
    with pytest.raises(ValueError, match="2 rows of seen documents for 1 sequences"):
        dataclasses.replace(shared, sees=[[-1, 0, 0, -1]] * 2)
