import pytest
import torch

import burst
from burst.layout import check_sequence_length, zigzag_positions
from tests.distributed import run_on_ranks


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shards_cover_every_position_once_and_unshard_inverts(world_size):
    seq = 8 * world_size
    x = torch.arange(2 * seq).reshape(2, seq)
    parts = [burst.shard_for_rank(x, r, world_size, dim=1) for r in range(world_size)]
    assert all(p.shape == (2, seq // world_size) for p in parts)
    assert torch.equal(burst.unshard(parts, dim=1), x)
    positions = torch.cat([zigzag_positions(seq, r, world_size) for r in range(world_size)])
    assert sorted(positions.tolist()) == list(range(seq))
    for r, p in enumerate(parts):  # positions name exactly the tokens of the shard
        assert torch.equal(p[0], x[0, zigzag_positions(seq, r, world_size)])


def test_zigzag_pairs_early_and_late_chunks():
    assert zigzag_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 1, 2).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("seq_len", [0, 6, 10])
def test_bad_sequence_length_says_how_to_fix(seq_len):
    with pytest.raises(ValueError, match="multiple of 2 x world size = 4"):
        check_sequence_length(seq_len, 2)


def test_single_process_is_world_of_one():
    x = torch.randn(1, 6, 3)
    assert torch.equal(burst.shard_sequence(x), x)
    assert torch.equal(burst.gather_sequence(x), x)
    assert burst.sequence_positions(6).tolist() == list(range(6))


def _gather_roundtrip(rank, world_size):
    torch.manual_seed(0)
    x = torch.randn(2, 4 * world_size, 3)
    local = burst.shard_sequence(x, dim=1)
    assert torch.equal(local[0, :, 0], x[0, burst.sequence_positions(x.shape[1]), 0])
    assert torch.equal(burst.gather_sequence(local, dim=1), x)


def test_gather_sequence_over_gloo():
    run_on_ranks(_gather_roundtrip, world_size=3)
