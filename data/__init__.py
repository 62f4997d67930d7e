"""Data: tokenizer, `burst prepare` and its token store, the embedded default corpus, the
sequence-parallel loader, and passkey-retrieval samples for long-context evaluation."""

from data.corpus import default_store
from data.prepare import PrepareSummary, prepare
from data.store import TokenStore
from data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "PrepareSummary",
    "TokenStore",
    "Tokenizer",
    "default_store",
    "prepare",
    "train_tokenizer",
]
