"""Data: tokenizer, `burst prepare` and its token store, the embedded default corpus, the
sequence-parallel loader, and passkey-retrieval samples for long-context evaluation."""

from data.corpus import default_store
from data.loader import Batch, SequenceLoader
from data.passkey import PasskeySample, passkey_sample
from data.prepare import PrepareSummary, prepare
from data.store import TokenStore
from data.tokenizer import Tokenizer
from data.tokenizer_files import load_tokenizer
from data.tokenizer_hf import HFTokenizer
from data.tokenizer_spm import SentencePieceTokenizer, train_tokenizer

__all__ = [
    "Batch",
    "HFTokenizer",
    "PasskeySample",
    "PrepareSummary",
    "SentencePieceTokenizer",
    "SequenceLoader",
    "TokenStore",
    "Tokenizer",
    "default_store",
    "load_tokenizer",
    "passkey_sample",
    "prepare",
    "train_tokenizer",
]
