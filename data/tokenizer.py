"""The tokenizer interface of burst: what `prepare`, the loader's specials, passkey samples and `eval` use.

Two backends implement it: a SentencePiece `.model` (data/tokenizer_spm.py: ours, LLaMA-2's) and a
Hugging Face `tokenizer.json` read by the `tokenizers` library (data/tokenizer_hf.py: LLaMA-3's byte-level
BPE, SentencePiece-converted ones, any other). data/tokenizer_files.py finds either on disk and loads it.

encode() adds no specials: the loader frames each document itself, as the tokenizer frames a text
(`bos_first`): BOS + document + EOS when the tokenizer puts BOS before a text (LLaMA-3's tokenizer.json, and
always a SentencePiece model: burst's own convention), document + EOS when it puts none (SmolLM2's, whose
bos_token is ChatML's <|im_start|>), so that a model sees its documents as `AutoTokenizer(text)` gives them.
BOS and EOS come from the tokenizer's own files. A tokenizer's `files` are what a token store, a run and an
export keep of it, under their usual names; its `fingerprint` is what burst compares to tell whether data and a model
share a tokenizer: the backend's digest of what decides the ids, and the BOS and EOS ids.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from runtime.digest import file_sha256

SENTENCEPIECE, HUGGINGFACE = "sentencepiece", "huggingface"  # the kinds, as a store's metadata names them
SPM_FILE = "tokenizer.model"  # a SentencePiece model (LLaMA-3's tokenizer.model is tiktoken's format instead)
HF_FILE = "tokenizer.json"
HF_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json")  # kept beside tokenizer.json when present
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # a chat template beside tokenizer.json (transformers 5 saves them so)
TOKENIZER_FILES = (HF_FILE, *HF_COMPANIONS, CHAT_TEMPLATE_FILE, SPM_FILE)  # every name a tokenizer's file has in a
# store, run, export


def files_of(kind: str, main_file: Path) -> dict[str, Path]:
    """The files a tokenizer of `kind` whose main file is `main_file` reads, by name: a tokenizer.json and the
    companions and chat template beside it, or a SentencePiece model alone."""
    if kind != HUGGINGFACE:
        return {SPM_FILE: main_file}
    beside = (main_file.parent / name for name in (*HF_COMPANIONS, CHAT_TEMPLATE_FILE))
    return {HF_FILE: main_file, **{path.name: path for path in beside if path.is_file()}}


def fingerprint(kind: str, digest: str, bos_id: int, eos_id: int) -> str:
    """What identifies a tokenizer for training: its kind, the digest of what decides its ids, BOS and EOS."""
    return hashlib.sha256(f"{kind}\n{digest}\nbos {bos_id}\neos {eos_id}\n".encode()).hexdigest()


class Tokenizer(ABC):
    """A loaded tokenizer. Subclasses set every attribute in __init__ and implement the three methods."""

    kind: ClassVar[str]
    path: Path  # the file it was loaded from: a tokenizer.json or a .model (what `--tokenizer` takes)
    files: dict[str, Path]  # name in a store / run / export -> the file it is read from
    digest: str  # the backend's digest of what decides the ids (see `fingerprint`)
    vocab_size: int  # every id is below it: the added tokens of a tokenizer.json included
    bos_id: int
    eos_id: int
    bos_first: bool = True  # a document is framed BOS + document + EOS; False: document + EOS (see above)
    # The tokenizer's own chat template (data/chat.py renders conversations with it) and the file it came from;
    # None: it has none (a SentencePiece model never has), and conversations take burst's plain template.
    chat_template: str | None = None
    chat_template_file: str | None = None
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: the strings a chat template is given (transformers'
    #                                 special_tokens_map); a SentencePiece model's are none

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The ids of `text`, no BOS or EOS added."""

    @abstractmethod
    def encode_batch(self, texts: list[str], num_threads: int | None = None) -> list[list[int]]:
        """encode() of each text, in order, in parallel on native threads (all cores by default)."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`."""

    def encode_as_text(self, text: str) -> list[int]:
        """encode(), with the text of a special token ("<|end_of_text|>") encoded as the characters it is, never as
        that token: what burst's plain chat template encodes a conversation's own text with. SentencePiece never
        reads special tokens in a text, so for it this is encode()."""
        return self.encode(text)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.kind, self.digest, self.bos_id, self.eos_id)

    def metadata(self) -> dict[str, Any]:
        """What a token store records of its tokenizer (metadata.json's "tokenizer")."""
        return {"kind": self.kind, "files": {name: file_sha256(path) for name, path in self.files.items()},
                "digest": self.digest, "fingerprint": self.fingerprint, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id, "bos_first": self.bos_first}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({', '.join(map(str, self.files.values()))}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id})")
