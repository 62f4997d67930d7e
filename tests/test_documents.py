"""burst.Documents: one value for the packed documents from the data loader to the kernel, its layout chosen once."""

import numpy as np
import pytest
import torch

import burst
from burst import layout as layout_module
from burst.documents import Documents
from data import SequenceLoader
from tests.test_data_loader import make_store


def test_the_operator_encoding_decodes_to_the_same_value():
    for sees, layout, world in ((None, "zigzag", 2), ([[-1, 0, 0], [-1, -1, 1]], "balanced", 2), (None, "balanced", 4)):
        documents = Documents.of([[0, 10, 13, 48], torch.tensor([0, 1, 30, 48])], 48, world, layout, sees)
        decoded = Documents.decode(documents.encoded)
        assert decoded == documents and hash(decoded) == hash(documents)
        assert decoded.layouts == documents.layouts and decoded.sees == documents.sees
        assert torch.equal(decoded.encoded, documents.encoded)
    assert Documents.of([[0, 48]], 48, 2) != Documents.of([[0, 24, 48]], 48, 2)


def test_a_negative_offset_is_named_with_how_to_mend_it():
    """It once read as a row's end in the operator's encoding, and the error blamed the batch size."""
    q = torch.randn(1, 8, 2, 4)
    for offsets in ([-1, 4, 8], [0, -3, 8]):
        with pytest.raises(ValueError, match=rf"offset {offsets[0] or offsets[1]} at index \d lies outside the "
                                             r"sequence; every offset is a token position 0\.\.8"):
            burst.local_attn(q, q, q, doc_boundaries=[torch.tensor(offsets)])
    with pytest.raises(ValueError, match="offset 4 at index 2 does not come after 5"):
        burst.local_attn(q, q, q, doc_boundaries=[torch.tensor([0, 5, 4, 8])])


def test_documents_made_for_another_call_are_refused():
    q = torch.randn(2, 16, 2, 4)
    documents = Documents.of([[0, 5, 32], [0, 32]], 32, 2, "balanced")
    with pytest.raises(ValueError, match="made for 2 rows of 32 tokens cut over 2 ranks by layout 'balanced', but "
                                         "the attention has 2 rows of 16 tokens over 1 ranks"):
        burst.burst_attn(q, q, q, documents=documents, layout="balanced")
def test_the_balanced_layout_is_chosen_once_per_sequence(tmp_path, monkeypatch):
    """The loader chooses each row's layout when it makes the batch's Documents; sharding, the ranks' agreement
    check and the attention's forward and backward use that choice and never choose again."""
    chosen = []
    choose = layout_module.balanced_layout
    monkeypatch.setattr(layout_module, "balanced_layout", lambda *a, **k: chosen.append(a[0]) or choose(*a, **k))
    store = make_store(tmp_path / "store", [5, 40, 3, 17, 64, 2, 9, 30, 11, 7, 50])
    rows, seq_len = 2, 32
    loader = SequenceLoader(store, seq_len=seq_len, batch_size=rows, seed=0, reset_positions=True,
                            cp_layout="balanced")
    batch = next(loader)
    assert len(chosen) == rows
    documents = batch.documents
    assert documents.layout == "balanced"
    assert documents.offsets == tuple(tuple(b.tolist()) for b in batch.doc_boundaries)
    q = torch.randn(rows, seq_len, 2, 8, requires_grad=True)
    out = burst.burst_attn(q, q, q, documents=documents, layout="balanced", check_ranks=True)
    out.sum().backward()
    local = burst.local_attn(q, q, q, documents=documents)
    assert len(chosen) == rows, chosen
    expected = burst.local_attn(q, q, q, doc_boundaries=batch.doc_boundaries)
    assert torch.equal(local, expected)
    assert np.isfinite(q.grad.numpy()).all()
