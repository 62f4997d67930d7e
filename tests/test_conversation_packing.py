"""Packing an instruction store: whole conversations per sequence, padding as a document of its own, answers as
the only labels, the long-conversation policies, resuming, sharding and mixing with a store of documents."""

import numpy as np
import pytest
import torch

import burst
from data import SequenceLoader, TokenStore
from data.conversation_packing import ConversationStream
from data.loader import IGNORE_INDEX
from data.mixture import MixtureSchedule
from data.store import StoreWriter
from data.tokenizer import fingerprint
from tests.test_data_loader import BOS, EOS, make_store

LENGTHS = [7, 12, 3, 20, 9, 15, 5, 11, 17, 8]  # tokens per conversation, its BOS included


def token(d: int, j: int) -> int:
    return 3 + d * 1000 + j  # token j of conversation d (j >= 1; token 0 is BOS)


def make_chat_store(directory, lengths, val_documents=()) -> TokenStore:
    """Conversation d: BOS, then tokens that say which conversation they are from; its answer is its second half."""
    directory.mkdir()
    writer = StoreWriter(directory, np.dtype(np.uint32), conversations=True)
    documents = [np.array([BOS] + [token(d, j) for j in range(1, n)]) for d, n in enumerate(lengths)]
    writer.append(documents, scored=[np.arange(n) >= n // 2 for n in lengths],
                  rows=[(0, d + 1) for d in range(len(lengths))])
    digest = "0" * 64
    writer.finish(np.array(val_documents, np.int64), {
        "tokenizer": {"kind": "sentencepiece", "files": {"tokenizer.model": digest}, "digest": digest,
                      "fingerprint": fingerprint("sentencepiece", digest, BOS, EOS), "vocab_size": 300_000,
                      "bos_id": BOS, "eos_id": EOS},
        "conversation_files": ["chat.jsonl"], "chat": {"template": "plain"}})
    return TokenStore(directory)


@pytest.fixture
def store(tmp_path) -> TokenStore:
    return make_chat_store(tmp_path / "chat", LENGTHS)


def conversations_in(tokens: np.ndarray) -> list[tuple[int, int, int]]:
    """(conversation, start, length) of each conversation in a packed row."""
    found = []
    for start in np.flatnonzero(tokens == BOS):
        d = (int(tokens[start + 1]) - 3) // 1000 if start + 1 < len(tokens) else None
        end = start + 1
        while end < len(tokens) and tokens[end] not in (BOS, EOS):
            end += 1
        found.append((d, int(start), end - int(start)))
    return found


def full_rows(loader: SequenceLoader, steps: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, list]]:
    """(tokens, labels, positions, boundaries) of every row of `steps` single-rank batches."""
    rows = []
    for _ in range(steps):
        batch = next(loader)
        for r in range(batch.tokens.shape[0]):
            rows.append((batch.tokens[r].numpy(), batch.labels[r].numpy(), batch.positions[r].numpy(),
                         batch.doc_boundaries[r].tolist()))
    return rows


def test_every_epoch_packs_each_conversation_whole_once_and_scores_only_its_answer(store):
    seq_len = 32
    loader = SequenceLoader(store, seq_len, batch_size=1, seed=3, reset_positions=True)
    epochs, current, padding = [], [], 0
    for tokens, labels, positions, boundaries in full_rows(loader, 12):
        row = conversations_in(tokens)
        assert all(length == LENGTHS[d] or start + length == seq_len for d, start, length in row)
        filled = sum(LENGTHS[d] for d, _, _ in row)
        if filled < seq_len + 1:  # next-fit: the next conversation did not fit; the rest is padding
            assert (tokens[filled:] == EOS).all() and (labels[filled - 1:] == IGNORE_INDEX).all()
            assert filled in boundaries
            padding += seq_len - filled
        for d, start, _ in row:
            n = LENGTHS[d]
            expected = [token(d, j) if j >= n // 2 else IGNORE_INDEX for j in range(1, n)]  # next tokens' labels
            got = labels[start:start + n - 1]
            assert got.tolist() == expected[:len(got)]
            assert positions[start:start + min(n, seq_len - start)].tolist() == list(range(min(n, seq_len - start)))
            assert start in boundaries
            if not current or d not in current:
                current.append(d)
            if len(current) == len(LENGTHS):
                epochs.append(current)
                current = []
    assert len(epochs) >= 2 and all(sorted(e) == list(range(len(LENGTHS))) for e in epochs)
    assert epochs[0] != epochs[1]
    assert loader.padding_tokens == padding


def test_no_conversation_runs_into_the_next_sequence(store):
    loader = SequenceLoader(store, 24, batch_size=2, seed=0, reset_positions=True)
    for tokens, labels, _, _ in full_rows(loader, 10):
        row = conversations_in(np.append(tokens, labels[-1] if labels[-1] != IGNORE_INDEX else EOS))
        assert all(length == LENGTHS[d] for d, _, length in row if d is not None)
        assert tokens[0] == BOS  # every sequence starts with a conversation


def test_train_on_prompt_scores_every_token_but_each_conversations_first_and_the_padding(store):
    loader = SequenceLoader(store, 32, batch_size=1, seed=3, reset_positions=True, train_on_prompt=True)
    for tokens, labels, _, _ in full_rows(loader, 4):
        for d, start, _ in conversations_in(tokens):
            assert labels[start:start + LENGTHS[d] - 1].tolist() == \
                [token(d, j) for j in range(1, LENGTHS[d])][:len(labels) - start]
        assert (labels[tokens == EOS] == IGNORE_INDEX).all()


def test_train_on_prompt_with_documents_alone_is_refused(tmp_path):
    plain = make_store(tmp_path / "plain", [5, 9, 12])
    with pytest.raises(ValueError, match="no --data source is an instruction store"):
        SequenceLoader(plain, 16, 1, train_on_prompt=True)


def test_a_conversation_longer_than_a_sequence_is_refused_truncated_or_split(tmp_path):
    store = make_chat_store(tmp_path / "long", [6, 40, 9])
    with pytest.raises(ValueError, match=r"1 conversations of .* are longer than a sequence of --seq-len 24 "
                                         r"\(\+ 1 label\), the longest 40 tokens: chat.jsonl:2 \(40 tokens\); "
                                         r"set --long-conversations"):
        SequenceLoader(store, 24, 1)
    # truncate: BOS, then the last 24 tokens (its answer, the second half, is kept whole)
    stream = SequenceLoader(store, 24, 1, long_conversations="truncate").streams[0]
    assert (stream.long.count, stream.long.truncated_tokens) == (1, 40 - 25)
    assert stream.long.describe(3) == "3 conversations packed whole, 1 of them longer than a sequence truncated, " \
                                      "15 prompt tokens cut"
    sequences = [stream.sequence(k) for k in range(stream.sequences_in_epoch(0))]
    truncated = [tokens for tokens, _, _ in sequences if tokens[1] == token(1, 16)]
    assert len(truncated) == 1 and truncated[0].tolist() == [BOS] + [token(1, j) for j in range(16, 40)]
    assert sum(scored.sum() for _, _, scored in sequences) == (6 - 3) + 20 + (9 - 4)  # every answer token once
    # an answer that truncation would cut: refused
    answer_early = make_chat_store(tmp_path / "early", [6, 40])
    scored = np.memmap(answer_early.directory / "scored.bin", np.uint8, "r+")
    scored[6 + 5] = 1  # conversation 1's token 5 is an answer's
    scored.flush()
    with pytest.raises(ValueError, match="their answers do not fit: set --long-conversations split"):
        SequenceLoader(TokenStore(answer_early.directory), 24, 1, long_conversations="truncate")
    # split: a sequence-long piece, then the rest at the start of the next sequence
    stream = SequenceLoader(store, 24, 1, long_conversations="split").streams[0]
    assert (stream.long.count, stream.long.pieces) == (1, 2)
    # issue 27, defect 19: the run's report counted the split conversation among those packed whole
    assert stream.long.describe(3) == "2 conversations packed whole, 1 longer than a sequence split into 2 pieces"
    sequences = [stream.sequence(k)[0] for k in range(stream.sequences_in_epoch(0))]
    first = next(k for k, tokens in enumerate(sequences) if tokens[1] == token(1, 1))
    assert sequences[first].tolist() == [BOS] + [token(1, j) for j in range(1, 25)]
    assert sequences[first + 1][:15].tolist() == [token(1, j) for j in range(25, 40)]


def test_a_resumed_loader_continues_with_the_next_sequences_on_any_layout(store):
    reference = SequenceLoader(store, 32, batch_size=2, dp_size=1, seed=7, reset_positions=True)
    rows = full_rows(reference, 6)
    first = SequenceLoader(store, 32, batch_size=2, seed=7, reset_positions=True)
    full_rows(first, 3)
    state = first.state_dict()
    for cp in (1, 2):
        shards = []
        for cp_rank in range(cp):
            resumed = SequenceLoader(store, 32, batch_size=2, seed=7, reset_positions=True, cp_rank=cp_rank,
                                     cp_size=cp)
            resumed.load_state_dict(state)
            assert resumed.padding_tokens == first.padding_tokens
            shards.append([next(resumed) for _ in range(3)])
        for step in range(3):
            batch = shards[0][step]
            for r in range(2):
                tokens, labels, positions, boundaries = rows[(3 + step) * 2 + r]
                assert batch.doc_boundaries[r].tolist() == boundaries
                for cp_rank in range(cp):
                    expected = burst.shard_for_rank(torch.from_numpy(np.stack([tokens, labels, positions])),
                                                    cp_rank, cp, dim=1)
                    got = shards[cp_rank][step]
                    assert torch.equal(torch.stack([got.tokens[r], got.labels[r], got.positions[r]]), expected)


def test_conversations_mix_with_documents_by_share(tmp_path, store):
    plain = make_store(tmp_path / "plain", [30, 50, 40, 60])
    loader = SequenceLoader([plain, store], 32, batch_size=1, shares=[0.75, 0.25], seed=1, reset_positions=True)
    alone = SequenceLoader(plain, 32, batch_size=1, seed=1, reset_positions=True)
    conversations = SequenceLoader(store, 32, batch_size=1, seed=1, reset_positions=True)
    conversations.streams[0] = ConversationStream(store, 32, 1, stream_id=1)  # the mixture's second stream
    schedule = MixtureSchedule([0.75, 0.25])
    for _ in range(8):
        batch, source = next(loader), schedule.next()
        expected = next(alone if source == 0 else conversations)  # each source's sequences, as if alone
        assert torch.equal(batch.tokens, expected.tokens) and torch.equal(batch.labels, expected.labels)
    assert loader.sequences_by_source == [6, 2]
    assert loader.padding_tokens == loader.streams[1].padding_before(2) > 0
