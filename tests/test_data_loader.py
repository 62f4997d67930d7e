"""The sequence-parallel loader: packing, sharding over cp x dp ranks, resuming, validation."""

import json

import numpy as np
import pytest
import torch

import burst
from burst import balance
from burst.layout import zigzag_layout
from data import SequenceLoader, TokenStore
from data.loader import IGNORE_INDEX
from data.store import StoreWriter
from data.tokenizer import fingerprint

BOS, EOS = 1, 2


def make_store(directory, lengths, val_documents=()) -> TokenStore:
    """A store whose document d holds tokens 3 + d*1000 + j: every token says which document it is from."""
    directory.mkdir()
    writer = StoreWriter(directory, np.dtype(np.uint32))
    writer.append([list(range(3 + d * 1000, 3 + d * 1000 + n)) for d, n in enumerate(lengths)])
    digest = "0" * 64  # no tokenizer file: the loader reads only the ids
    writer.finish(np.array(val_documents, np.int64), {"tokenizer": {
        "kind": "sentencepiece", "files": {"tokenizer.model": digest}, "digest": digest,
        "fingerprint": fingerprint("sentencepiece", digest, BOS, EOS), "vocab_size": 300_000, "bos_id": BOS,
        "eos_id": EOS}})
    return TokenStore(directory)


LENGTHS = [1, 5, 40, 3, 17, 64, 2, 9, 30]  # 171 tokens + 18 BOS/EOS = 189 per epoch


@pytest.fixture
def store(tmp_path) -> TokenStore:
    return make_store(tmp_path / "store", LENGTHS, val_documents=[2])


def stream_of(loader: SequenceLoader, steps: int) -> np.ndarray:
    """The packed token stream a single-rank loader walks through (rows are consecutive)."""
    return torch.cat([b.tokens.reshape(-1) for b in (next(loader) for _ in range(steps))]).numpy()


def test_each_epoch_packs_every_document_once_between_bos_and_eos_in_a_new_order(store):
    loader = SequenceLoader(store, seq_len=16, batch_size=3, seed=5)
    stream = stream_of(loader, 12)  # 576 tokens: three epochs of 189 and a bit
    epochs = []
    for epoch in range(3):
        packed = stream[epoch * 189:(epoch + 1) * 189]
        starts = np.flatnonzero(packed == BOS)
        docs = [packed[s:e] for s, e in zip(starts, list(starts[1:]) + [189], strict=True)]
        assert all(d[-1] == EOS for d in docs)
        order = [(int(d[1]) - 3) // 1000 for d in docs]
        assert sorted(order) == list(range(len(LENGTHS)))
        assert all(np.array_equal(d[1:-1], store.document(i)) for i, d in zip(order, docs, strict=True))
        epochs.append(order)
    assert epochs[0] != epochs[1] != epochs[2]
    other_seed = stream_of(SequenceLoader(store, seq_len=16, batch_size=3, seed=6), 4)
    assert not np.array_equal(other_seed, stream[:len(other_seed)])
    assert np.array_equal(stream_of(SequenceLoader(store, seq_len=16, batch_size=3, seed=5), 12), stream)


@pytest.mark.parametrize("reset_positions", [False, True])
def test_labels_positions_and_boundaries_follow_the_packed_stream(store, reset_positions):
    seq_len = 24
    loader = SequenceLoader(store, seq_len=seq_len, batch_size=2, seed=1, reset_positions=reset_positions)
    batches = [next(loader) for _ in range(6)]
    stream = np.concatenate([b.tokens.reshape(-1).numpy() for b in batches] + [next(loader).tokens[0, :1].numpy()])
    for step, batch in enumerate(batches):
        for row in range(2):
            begin = (step * 2 + row) * seq_len
            tokens, following = stream[begin:begin + seq_len], stream[begin + 1:begin + seq_len + 1]
            assert np.array_equal(batch.tokens[row].numpy(), tokens)
            assert np.array_equal(batch.labels[row].numpy(), np.where(following == BOS, IGNORE_INDEX, following))
            boundaries = sorted({0, seq_len, *np.flatnonzero(tokens == BOS).tolist()})
            assert batch.doc_boundaries[row].tolist() == boundaries
            segment_start = np.repeat(boundaries[:-1], np.diff(boundaries))
            expected = np.arange(seq_len) - (segment_start if reset_positions else 0)
            assert np.array_equal(batch.positions[row].numpy(), expected)
        assert batch.num_tokens == int((batch.labels != IGNORE_INDEX).sum())
        assert batch.rope_length == (int(batch.positions.max()) + 1 if reset_positions else seq_len)
        assert batch.tokens.dtype == batch.labels.dtype == batch.positions.dtype == torch.int64


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("dp_size", [1, 2])
def test_shards_over_cp_and_dp_ranks_cover_every_token_exactly_once(store, cp_size, dp_size):
    seq_len, batch_size, steps = 32, 2, 5
    reference = SequenceLoader(store, seq_len, batch_size * dp_size, seed=3, reset_positions=True)
    ranks = {(dp, cp): SequenceLoader(store, seq_len, batch_size, dp_rank=dp, dp_size=dp_size, cp_rank=cp,
                                      cp_size=cp_size, seed=3, reset_positions=True)
             for dp in range(dp_size) for cp in range(cp_size)}
    for _ in range(steps):
        full = next(reference)
        shards = {rank: next(loader) for rank, loader in ranks.items()}
        for dp in range(dp_size):
            rows = slice(dp * batch_size, (dp + 1) * batch_size)
            parts = [shards[dp, cp] for cp in range(cp_size)]
            assert all(p.tokens.shape == (batch_size, seq_len // cp_size) for p in parts)
            for field in ("tokens", "labels", "positions"):
                assert torch.equal(burst.unshard([getattr(p, field) for p in parts]), getattr(full, field)[rows])
            for cp, part in enumerate(parts):
                assert torch.equal(part.tokens, burst.shard_for_rank(full.tokens[rows], cp, cp_size))
                assert [b.tolist() for b in part.doc_boundaries] == [b.tolist() for b in full.doc_boundaries[rows]]
            assert sum(p.num_tokens for p in parts) == int((full.labels[rows] != IGNORE_INDEX).sum())
            # RoPE's sequence length is the whole sequences', on every cp rank alike (with reset positions: the
            # longest document part + 1, as transformers computes max(position_ids) + 1).
            assert {p.rope_length for p in parts} == {int(full.positions[rows].max()) + 1}


@pytest.mark.parametrize("cp_size", [2, 4])
def test_balanced_shards_follow_each_sequence_layout_and_reassemble_it(store, cp_size, monkeypatch):
    monkeypatch.setattr(balance, "OPTIONS", balance.BalanceOptions(tile=2, min_chunk_tiles=1))  # short sequences
    seq_len, rows = 64, 3
    reference = SequenceLoader(store, seq_len, rows, seed=4, reset_positions=True)
    ranks = [SequenceLoader(store, seq_len, rows, cp_rank=cp, cp_size=cp_size, seed=4, reset_positions=True,
                            cp_layout="balanced") for cp in range(cp_size)]
    permuted = 0
    for _ in range(4):
        full, parts = next(reference), [next(loader) for loader in ranks]
        cut = {"layout": "balanced", "doc_boundaries": full.doc_boundaries}
        for field in ("tokens", "labels", "positions"):
            assert torch.equal(burst.unshard([getattr(p, field) for p in parts], **cut), getattr(full, field))
        for cp, part in enumerate(parts):
            layouts = [burst.balanced_layout(tuple(b.tolist()), seq_len, cp_size, balance.OPTIONS)
                       for b in full.doc_boundaries]
            for row, layout in enumerate(layouts):
                held = layout.positions(cp)
                assert torch.equal(part.tokens[row], full.tokens[row, held])
                assert torch.equal(part.positions[row], full.positions[row, held])  # document offsets, as in cp 1
                permuted += layout != layouts[0] or layout.chunks != zigzag_layout(seq_len, cp_size).chunks
            assert [b.tolist() for b in part.doc_boundaries] == [b.tolist() for b in full.doc_boundaries]
        assert sum(p.num_tokens for p in parts) == full.num_tokens
    assert permuted  # some sequences got a layout of their own


@pytest.mark.parametrize("dp_size, cp_size", [(1, 1), (2, 2)])
def test_a_restored_loader_continues_with_exactly_the_next_batches(store, dp_size, cp_size):
    def make(dp_rank=1 % dp_size):
        return SequenceLoader(store, 16, 3, dp_rank=dp_rank, dp_size=dp_size, cp_rank=cp_size - 1, cp_size=cp_size,
                              seed=9)

    running = make()
    for _ in range(5):
        next(running)
    state = json.loads(json.dumps(running.state_dict()))  # it must survive a checkpoint as JSON
    restored = make()
    restored.load_state_dict(state)
    for _ in range(8):  # 8 steps x 3 x dp_size x 16 tokens crosses several 189-token epochs
        a, b = next(running), next(restored)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.positions, b.positions) and a.num_tokens == b.num_tokens
    assert running.sequences_by_source == restored.sequences_by_source
    assert running.sequences_by_source[0] * 16 >= 3 * 189  # past the third epoch


def test_documents_longer_than_a_sequence_continue_into_the_next(tmp_path):
    store = make_store(tmp_path / "long", [100])
    batch = next(SequenceLoader(store, seq_len=40, batch_size=3))
    assert batch.tokens[0, 0] == BOS and batch.tokens[1, 0] == 3 + 39 and batch.tokens[2, 0] == 3 + 79
    assert [b.tolist() for b in batch.doc_boundaries] == [[0, 40], [0, 40], [0, 22, 40]]  # 102 tokens, then BOS


def test_bad_arguments_and_states_are_refused_clearly(store, tmp_path):
    with pytest.raises(ValueError, match="multiple of 2 x world size = 8"):
        SequenceLoader(store, seq_len=20, batch_size=1, cp_size=4)
    with pytest.raises(ValueError, match="cp_rank 2 is out of range for cp_size 2"):
        SequenceLoader(store, seq_len=16, batch_size=1, cp_rank=2, cp_size=2)
    with pytest.raises(ValueError, match="unknown cp_layout 'striped'; choose one of zigzag, balanced"):
        SequenceLoader(store, seq_len=16, batch_size=1, cp_layout="striped")
    with pytest.raises(ValueError, match="dp_rank -1 is out of range"):
        SequenceLoader(store, seq_len=16, batch_size=1, dp_rank=-1)
    empty_val = make_store(tmp_path / "no_val", [5, 6]).split("val")
    with pytest.raises(ValueError, match="no documents"):
        SequenceLoader(empty_val, seq_len=16, batch_size=1)
    state = SequenceLoader(store, 16, 1, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 but this loader has 2"):
        SequenceLoader(store, 16, 1, seed=2).load_state_dict(state)


def test_a_split_is_loaded_alone(store):
    val = store.split("val")
    batch = next(SequenceLoader(val, seq_len=42, batch_size=1))
    assert batch.tokens[0].tolist() == [BOS, *range(3 + 2000, 3 + 2040), EOS]


def test_131k_token_sequences_are_cut_quickly(tmp_path):
    store = make_store(tmp_path / "big", [50_000, 200_000, 1_000, 90_000])
    loader = SequenceLoader(store, seq_len=131_072, batch_size=2, cp_rank=1, cp_size=2, reset_positions=True)
    for _ in range(3):
        batch = next(loader)
        assert batch.tokens.shape == batch.positions.shape == (2, 65_536)
