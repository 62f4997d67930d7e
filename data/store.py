"""The token store: a directory holding a tokenized corpus, written once and memory-mapped to read.

    tokens.bin         every document's tokens, back to back (uint16 if the vocabulary fits, else uint32)
    offsets.bin        int64 [num_documents + 1]: document i is tokens[offsets[i]:offsets[i + 1]]
    val_documents.bin  int64, sorted: the documents of the validation split; the rest are training
    tokenizer files    the tokenizer the tokens came from, under their usual names: tokenizer.json and,
                       when it came with them, tokenizer_config.json and special_tokens_map.json; or a
                       SentencePiece tokenizer.model
    metadata.json      format version, dtype, counts, the tokenizer (kind, files and their SHA-256s,
                       fingerprint, vocabulary, BOS, EOS), split, the content digest (a SHA-256 of the
                       tokens, offsets, split and scored marks, taken as they were written: a run records
                       it and a resume compares it); written last, so a directory without it is not (yet)
                       a store

An instruction store (`burst prepare --chat`, format version 3, metadata "content": "conversations") holds
one conversation per document, its tokens as the chat template renders them (BOS and end-of-turn tokens
included), and beside them:

    scored.bin         uint8 [num_tokens]: 1 where a token is an answer's (an assistant turn and its
                       end-of-turn token), what training scores by default
    rows.bin           int64 [num_documents, 2]: the input file (an index into metadata's
                       "conversation_files") and row each conversation was read from, to name it

A preference store (`burst prepare --preference`, format version 4, metadata "content": "preferences") holds
one pair per document: its prompt's ids, then the chosen answer's, then the rejected answer's (each answer as
the chat template renders it after the prompt: the answer and its end-of-turn token), and beside them:

    pairs.bin          int64 [num_documents, 2]: the prompt's and the chosen answer's token counts (the rest of
                       the document is the rejected answer)
    rows.bin           as an instruction store's, the files named in metadata's "preference_files"

Stores of format version 1 (a SentencePiece tokenizer.model, before tokenizer.json was read) open as they are.
Plain stores are still written as version 2.

BOS/EOS are not stored in a plain store: the loader adds them when it packs documents into sequences.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from data.sources import row_place
from data.tokenizer import SENTENCEPIECE, TOKENIZER_FILES, Tokenizer, file_sha256, fingerprint
from data.tokenizer_files import files_beside, tokenizer_beside

FORMAT_VERSION = 2
CONVERSATIONS_VERSION = 3  # an instruction store: older burst refuses it rather than train on every token
PREFERENCES_VERSION = 4  # a preference store: older burst refuses it rather than train on the pairs as text
READABLE_VERSIONS = (1, 2, 3, 4)  # 1: before tokenizer.json, its tokenizer one SentencePiece file
TOKENS_FILE, OFFSETS_FILE, VAL_FILE = "tokens.bin", "offsets.bin", "val_documents.bin"
SCORED_FILE, ROWS_FILE, PAIRS_FILE = "scored.bin", "rows.bin", "pairs.bin"
CONVERSATIONS = "conversations"  # metadata "content" of an instruction store
PREFERENCES = "preferences"  # metadata "content" of a preference store
INPUT_FILES = {CONVERSATIONS: "conversation_files", PREFERENCES: "preference_files"}  # the files rows.bin names
METADATA_FILE = "metadata.json"
CONTENT_DIGEST = "content_sha256"  # metadata: what training reads, hashed as `burst prepare` wrote it
SPLITS = ("train", "val")
TOKENIZER_KEYS = {"kind": str, "files": dict, "digest": str, "fingerprint": str, "vocab_size": int, "bos_id": int,
                  "eos_id": int}


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id of the vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class StoreWriter:
    """Appends documents' tokens to a store directory, keeping only the current chunk in memory; a long document
    may come in pieces (`append(pieces, ends)`). With `conversations`, an instruction store: each conversation
    comes whole with its scored mask and the row it was read from. With `preferences`, a preference store: each
    pair comes as prompt + chosen + rejected ids with its (prompt, chosen) token counts and its row."""

    def __init__(self, directory: Path, dtype: np.dtype, conversations: bool = False,
                 preferences: bool = False) -> None:
        self.directory, self.dtype, self.conversations = directory, dtype, conversations
        self.preferences = preferences
        self.num_documents = self.num_tokens = self.num_scored_tokens = 0
        self.max_token_id = -1
        extra = (SCORED_FILE, ROWS_FILE) if conversations else (PAIRS_FILE, ROWS_FILE) if preferences else ()
        self._files = [open(directory / name, "wb") for name in (TOKENS_FILE, OFFSETS_FILE, *extra)]
        self._tokens, self._offsets = self._files[:2]
        # what training reads, hashed as it is written (where each row came from is not content)
        self._content = {name: hashlib.sha256() for name in (TOKENS_FILE, OFFSETS_FILE, VAL_FILE, SCORED_FILE,
                                                             PAIRS_FILE)}
        _write_array(self._offsets, np.zeros(1, np.int64), self._content)

    def append(self, documents: list[list[int]] | list[np.ndarray], ends: list[bool] | None = None,
               scored: list[np.ndarray] | None = None, rows: list[tuple[int, int]] | None = None,
               pairs: list[tuple[int, int]] | None = None) -> None:
        """Append each list of tokens as a whole document or, with `ends`, as a piece of one that continues the
        piece before it and ends its document only where ends[i]; a conversation with its `scored` mask (bool,
        one per token) and its row (input file index, row number); a pair with its (prompt, chosen) token counts
        and its row."""
        whole = self.conversations or self.preferences
        if (scored is not None) != self.conversations or (pairs is not None) != self.preferences \
                or (rows is not None) != whole or ends is not None and whole:
            raise ValueError("a store of conversations takes whole conversations with their masks and rows, one of "
                             "preferences whole pairs with their counts and rows; a store of documents takes none")
        if not documents:
            return
        if self.preferences:
            _write_array(self._files[2], np.asarray(pairs, np.int64).reshape(-1, 2), self._content)
            _write_array(self._files[3], np.asarray(rows, np.int64).reshape(-1, 2))
        if self.conversations:
            mask = np.concatenate(scored).astype(np.uint8)
            _write_array(self._files[2], mask, self._content)
            _write_array(self._files[3], np.asarray(rows, np.int64).reshape(-1, 2))
            self.num_scored_tokens += int(mask.sum())
        lengths = np.fromiter(map(len, documents), np.int64, len(documents))
        tokens = np.concatenate(documents).astype(self.dtype, copy=False)
        _write_array(self._tokens, tokens, self._content)
        ends_here = np.ones(len(documents), bool) if ends is None else np.asarray(ends, bool)
        _write_array(self._offsets, (self.num_tokens + np.cumsum(lengths))[ends_here],  # where each ended one stops
                     self._content)
        self.max_token_id = max(self.max_token_id, int(tokens.max(initial=0)))
        self.num_documents += int(ends_here.sum())
        self.num_tokens += int(lengths.sum())

    def finish(self, val_documents: np.ndarray, metadata: dict[str, Any]) -> None:
        """Close the arrays, write the split, then metadata.json: from here on it is a complete store. An instruction
        store's metadata names its "conversation_files" and "chat" template, a preference store's its
        "preference_files" and "chat" template."""
        self.close()
        with open(self.directory / VAL_FILE, "wb") as f:
            _write_array(f, np.asarray(val_documents, np.int64), self._content)
        conversations = {"content": CONVERSATIONS, "num_scored_tokens": self.num_scored_tokens} \
            if self.conversations else {"content": PREFERENCES} if self.preferences else {}
        digest = hashlib.sha256(b"".join(h.digest() for h in self._content.values())).hexdigest()
        version = CONVERSATIONS_VERSION if self.conversations else PREFERENCES_VERSION if self.preferences \
            else FORMAT_VERSION
        metadata = {"format_version": version,
                    "dtype": self.dtype.name, "num_documents": self.num_documents, "num_tokens": self.num_tokens,
                    "num_val_documents": len(val_documents), "max_token_id": self.max_token_id, **conversations,
                    CONTENT_DIGEST: digest, **metadata}
        (self.directory / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")

    def close(self) -> None:
        for file in self._files:
            file.close()


def _write_array(file: BinaryIO, array: np.ndarray, digests: dict[str, hashlib._Hash] | None = None) -> None:
    """Write an array's bytes through Python's file (numpy's tofile reports a full disk without its errno); with
    `digests`, hash them too, into the digest of the file's name when there is one."""
    data = np.ascontiguousarray(array).data
    if digests is not None and Path(file.name).name in digests:
        digests[Path(file.name).name].update(data)
    file.write(data)


def _map(path: Path, dtype: np.dtype, count: int, directory: Path) -> np.ndarray:
    """Memory-map `count` items of `dtype` from `path`, refusing a file whose size does not match."""
    expected = count * dtype.itemsize
    actual = path.stat().st_size if path.is_file() else None
    if actual != expected:
        found = "is missing" if actual is None else f"has {actual} bytes"
        raise ValueError(f"{directory} is not a complete token store: {path.name} {found}, metadata.json says "
                         f"{count} x {dtype.name} = {expected} bytes; prepare the store again with `burst prepare`")
    return np.memmap(path, dtype, mode="r", shape=(count,)) if count else np.empty(0, dtype)


def _damaged(directory: Path, what: str) -> ValueError:
    return ValueError(f"{directory} is a damaged token store: {what}; prepare it again with `burst prepare`")


def _read_metadata(path: Path) -> dict[str, Any]:
    """metadata.json, refused unless it is this format version and holds every key a store is read by."""
    try:
        metadata = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _damaged(path.parent, f"{METADATA_FILE} is not valid JSON ({err})") from None
    version = metadata.get("format_version") if isinstance(metadata, dict) else None
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{path.parent} is a token store of format version {version}, this burst reads "
                         f"versions {', '.join(map(str, READABLE_VERSIONS))}; prepare the store again with this "
                         f"version of `burst prepare`")
    counts = ("num_documents", "num_tokens", "num_val_documents")
    tokenizer = metadata.get("tokenizer")
    if version == 1 and isinstance(tokenizer, dict):
        tokenizer = metadata["tokenizer"] = _tokenizer_of_version_1(tokenizer)
    missing = [key for key in counts if not isinstance(metadata.get(key), int) or metadata[key] < 0]
    missing += [] if metadata.get("dtype") in ("uint16", "uint32") else ["dtype"]
    missing += [f"tokenizer.{key}" for key in TOKENIZER_KEYS
                if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get(key), TOKENIZER_KEYS[key])]
    if not missing and not isinstance(tokenizer.get("bos_first", True), bool):
        missing.append("tokenizer.bos_first (true or false)")
    if not missing and (not tokenizer["files"] or not set(tokenizer["files"]) <= set(TOKENIZER_FILES)):
        missing.append(f"tokenizer.files (names among {', '.join(TOKENIZER_FILES)})")
    if not missing and tokenizer["fingerprint"] != fingerprint(tokenizer["kind"], tokenizer["digest"],
                                                               tokenizer["bos_id"], tokenizer["eos_id"]):
        missing.append("tokenizer.fingerprint (it does not match the tokenizer's digest, BOS and EOS)")
    if version in (CONVERSATIONS_VERSION, PREFERENCES_VERSION):
        content = CONVERSATIONS if version == CONVERSATIONS_VERSION else PREFERENCES
        files = metadata.get(INPUT_FILES[content])
        if metadata.get("content") != content:
            missing.append(f"content ({content!r}: version {version} is a store of {content})")
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            missing.append(INPUT_FILES[content])
        if not isinstance(metadata.get("chat"), dict):
            missing.append("chat")
    if missing:
        raise _damaged(path.parent, f"{METADATA_FILE} lacks valid {', '.join(missing)}")
    return metadata


def _tokenizer_of_version_1(tokenizer: dict[str, Any]) -> dict[str, Any]:
    """A version-1 store's tokenizer metadata ({file, sha256, vocab_size, bos_id, eos_id} of a SentencePiece
    model) in today's form; values of the wrong type are kept, for the check that follows to name."""
    file, sha256 = tokenizer.get("file"), tokenizer.get("sha256")
    bos, eos = tokenizer.get("bos_id"), tokenizer.get("eos_id")
    return {"kind": SENTENCEPIECE, "files": {file: sha256} if isinstance(file, str) else None, "digest": sha256,
            "fingerprint": fingerprint(SENTENCEPIECE, sha256, bos, eos), "vocab_size": tokenizer.get("vocab_size"),
            "bos_id": bos, "eos_id": eos}


def _check_contents(store: TokenStore) -> None:
    """Refuse offsets, a split or token ids that do not fit the metadata, reading the small arrays only
    (token ids through the maximum `burst prepare` recorded, scanned only in a store without one)."""
    offsets, meta, tokenizer = store._offsets, store.metadata, store.metadata["tokenizer"]
    if offsets[0] != 0 or offsets[-1] != meta["num_tokens"] or np.any(np.diff(offsets) < 0):
        raise _damaged(store.directory, f"{OFFSETS_FILE} does not rise from 0 to num_tokens {meta['num_tokens']}")
    val = store._val
    if len(val) and (val[0] < 0 or val[-1] >= meta["num_documents"] or np.any(np.diff(val) <= 0)):
        raise _damaged(store.directory, f"{VAL_FILE} holds document ids that are not sorted, unique and below "
                                        f"num_documents {meta['num_documents']}")
    files_key = INPUT_FILES.get(meta.get("content"))
    if files_key and len(store._rows) and not (
            0 <= store._rows[:, 0].min() and store._rows[:, 0].max() < len(meta[files_key])):
        raise _damaged(store.directory, f"{ROWS_FILE} names input files that {METADATA_FILE}'s {files_key} does "
                                        f"not list")
    if store.is_preferences and len(store._pairs) and (
            store._pairs.min() < 1 or np.any(store._pairs.sum(1) >= np.diff(offsets))):
        raise _damaged(store.directory, f"{PAIRS_FILE} holds token counts that do not fit its pairs")
    max_id = store.largest_id
    if max_id >= tokenizer["vocab_size"]:
        raise _damaged(store.directory, f"it holds token id {max_id} but {METADATA_FILE} gives a vocabulary of "
                                        f"{tokenizer['vocab_size']} tokens")


class TokenStore:
    """A prepared corpus, memory-mapped: `document(i)` reads no more than document i.

    `split("train" | "val")` is a view with the same API over that split's documents.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        meta_path = self.directory / METADATA_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(
                f"{self.directory} is not a complete token store: {METADATA_FILE} is missing (a `burst prepare` "
                f"that did not finish leaves none); create it with `burst prepare INPUT... --out {self.directory}`")
        self.metadata: dict[str, Any] = _read_metadata(meta_path)
        self._tokens = _map(self.directory / TOKENS_FILE, np.dtype(self.metadata["dtype"]),
                            self.metadata["num_tokens"], self.directory)
        self._offsets = _map(self.directory / OFFSETS_FILE, np.dtype(np.int64), self.metadata["num_documents"] + 1,
                             self.directory)
        self._val = _map(self.directory / VAL_FILE, np.dtype(np.int64), self.metadata["num_val_documents"],
                         self.directory)
        if self.is_conversations:  # what training scores, and where each conversation came from
            self._scored = _map(self.directory / SCORED_FILE, np.dtype(np.uint8), self.metadata["num_tokens"],
                                self.directory)
            self._rows = _map(self.directory / ROWS_FILE, np.dtype(np.int64), 2 * self.metadata["num_documents"],
                              self.directory).reshape(-1, 2)
        if self.is_preferences:  # each pair's prompt and chosen token counts, and where it came from
            self._pairs = _map(self.directory / PAIRS_FILE, np.dtype(np.int64), 2 * self.metadata["num_documents"],
                               self.directory).reshape(-1, 2)
            self._rows = _map(self.directory / ROWS_FILE, np.dtype(np.int64), 2 * self.metadata["num_documents"],
                              self.directory).reshape(-1, 2)
        self._largest_id: int | None = None  # of the whole store (its views share it)
        _check_contents(self)
        self._documents: np.ndarray | None = None  # global document ids of a split view; None: all of them
        self.split_name = "all"

    @property
    def is_conversations(self) -> bool:
        """Whether this is an instruction store: a conversation per document, with its answers marked."""
        return self.metadata.get("content") == CONVERSATIONS

    @property
    def is_preferences(self) -> bool:
        """Whether this is a preference store: a (prompt, chosen, rejected) pair per document."""
        return self.metadata.get("content") == PREFERENCES

    @property
    def pair_lengths(self) -> np.ndarray:
        """int64 [num_documents, 3] of a preference store: each pair's prompt, chosen and rejected token counts."""
        if not self.is_preferences:
            raise ValueError(f"{self.directory} is not a preference store (`burst prepare --preference`)")
        pairs = np.asarray(self._pairs if self._documents is None else self._pairs[self._documents])
        lengths = np.diff(self._offsets) if self._documents is None else np.diff(self._offsets)[self._documents]
        return np.column_stack([pairs, lengths - pairs.sum(1)])

    def pair_lengths_of(self, i: int) -> tuple[int, int, int]:
        """Pair i's prompt, chosen and rejected token counts (a preference store)."""
        index = self._index(i)
        prompt, chosen = (int(n) for n in self._pairs[index])
        return prompt, chosen, int(self._offsets[index + 1] - self._offsets[index]) - prompt - chosen

    @property
    def num_documents(self) -> int:
        return self.metadata["num_documents"] if self._documents is None else len(self._documents)

    @property
    def document_lengths(self) -> np.ndarray:
        """int64 [num_documents]: tokens per document (BOS/EOS not counted)."""
        lengths = np.diff(self._offsets)
        return lengths if self._documents is None else lengths[self._documents]

    @property
    def num_tokens(self) -> int:
        return self.metadata["num_tokens"] if self._documents is None else int(self.document_lengths.sum())

    def _index(self, i: int) -> int:
        """The store's own index of document i of this view."""
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} out of range: the {self.split_name} split has {self.num_documents}")
        return i if self._documents is None else int(self._documents[i])

    def document(self, i: int) -> np.ndarray:
        """The tokens of document i of this store or split, as a read-only view of the memory map."""
        index = self._index(i)
        return self._tokens[self._offsets[index]:self._offsets[index + 1]]

    def scored(self, i: int) -> np.ndarray:
        """uint8 [len(document(i))] of an instruction store: 1 where conversation i's token is an answer's."""
        if not self.is_conversations:
            raise ValueError(f"{self.directory} is a store of documents: every token is scored, none is marked")
        index = self._index(i)
        return self._scored[self._offsets[index]:self._offsets[index + 1]]

    def place(self, i: int) -> str:
        """Where conversation i was read from: the input file and its line (JSON Lines) or row (Parquet)."""
        file, row = self._rows[self._index(i)]
        return row_place(self.metadata[INPUT_FILES[self.metadata["content"]]][int(file)], int(row))

    def split(self, name: str) -> TokenStore:
        """A view over the "train" or "val" documents, chosen by `burst prepare --val-fraction`."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; a token store has the splits {SPLITS}")
        if self._documents is not None:
            raise ValueError(f"this is already the {self.split_name!r} split; call split() on the whole TokenStore")
        in_val = np.zeros(self.metadata["num_documents"], bool)
        in_val[self._val] = True
        view = object.__new__(TokenStore)
        view.__dict__.update(self.__dict__)
        view._documents, view.split_name = np.flatnonzero(in_val if name == "val" else ~in_val), name
        return view

    def at_least(self, min_tokens: int) -> TokenStore:
        """A view over this split's documents of at least `min_tokens` tokens (BOS/EOS not counted)."""
        if self._documents is None:
            raise ValueError("at_least() filters a split: call it on store.split('train') or store.split('val')")
        view = object.__new__(TokenStore)
        view.__dict__.update(self.__dict__)
        view._documents = self._documents[self.document_lengths >= min_tokens]
        view.split_name = f"{self.split_name}, documents of >= {min_tokens:,} tokens"
        return view

    @property
    def tokenizer_files(self) -> dict[str, Path]:
        """The tokenizer's files in the store, by name (tokenizer.json and companions, or tokenizer.model)."""
        return {name: self.directory / name for name in self.metadata["tokenizer"]["files"]}

    @property
    def content_digest(self) -> str | None:
        """The SHA-256 of what training reads from the whole store (tokens, offsets, split, scored marks, pairs), as
        `burst prepare` recorded it; None for a store prepared before it did."""
        digest = self.metadata.get(CONTENT_DIGEST)
        return digest if isinstance(digest, str) else None

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.metadata["tokenizer"]["fingerprint"]

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the store was prepared with, loaded from its files and checked to be that one."""
        tokenizer = tokenizer_beside(self.directory, prefer=self.metadata["tokenizer"]["kind"])
        if tokenizer is None or tokenizer.fingerprint != self.tokenizer_fingerprint:
            raise _damaged(self.directory, f"its tokenizer files {', '.join(self.tokenizer_files)} are "
                                           f"{'missing' if tokenizer is None else 'not those it was prepared with'}")
        return tokenizer

    def check_tokenizer(self, directory: Path, model: Path) -> None:
        """Refuse to feed this store to the model at `model` when the tokenizer kept in `directory` (beside the
        model, or in its run) is not the one the store was prepared with, compared by fingerprint: what decides
        the ids (tokenizer.json's model and pre-processing, or the .model file), BOS and EOS. No tokenizer there:
        nothing to compare. Files byte for byte those the store was prepared with are that tokenizer: it is not
        loaded (about 3 CPU s, in the launcher and every rank, for Gemma-3's)."""
        if self._keeps_its_tokenizer(Path(directory)):
            return
        tokenizer = tokenizer_beside(Path(directory), prefer=self.metadata["tokenizer"]["kind"])
        if tokenizer is not None and tokenizer.fingerprint != self.tokenizer_fingerprint:
            raise ValueError(f"the token store {self.directory} was prepared with another tokenizer than the model "
                             f"{model} was trained with ({', '.join(map(str, tokenizer.files.values()))}); prepare "
                             f"the data with the model's tokenizer: `burst prepare INPUT... --tokenizer {directory} "
                             f"--out STORE`")

    def _keeps_its_tokenizer(self, directory: Path) -> bool:
        """Whether the tokenizer in `directory` is read from exactly the files this store's was, by name and
        SHA-256 (a store prepared before burst recorded them: not known, False)."""
        recorded, found = self.metadata["tokenizer"], files_beside(directory, prefer=self.metadata["tokenizer"]["kind"])
        if not isinstance(recorded.get("files"), dict) or found is None or found[0] != recorded["kind"]:
            return False
        files = found[1]
        return files.keys() == recorded["files"].keys() and \
            all(file_sha256(path) == recorded["files"][name] for name, path in files.items())

    def copy_tokenizer(self, directory: Path) -> None:
        """Put the store's tokenizer files into `directory` (a run), each checked against its SHA-256 and written
        under a temporary name, then renamed. A file already there is kept when it is the same and refused when
        it is not: a run's tokenizer is never replaced."""
        for name, sha256 in self.metadata["tokenizer"]["files"].items():
            source, target = self.directory / name, Path(directory) / name
            if not source.is_file() or file_sha256(source) != sha256:
                raise _damaged(self.directory, f"its tokenizer file {name} is missing or not the one it was "
                                               f"prepared with")
            if target.is_file():
                if file_sha256(target) != sha256:
                    raise ValueError(f"{target} is another tokenizer than the one {self.directory} was prepared with; "
                                     f"a run keeps the tokenizer of its data: use the run's data, or a new --out")
                continue
            temporary = target.with_name(f"{name}.tmp-{uuid.uuid4().hex[:8]}")
            try:
                temporary.write_bytes(source.read_bytes())
                os.replace(temporary, target)
            finally:
                temporary.unlink(missing_ok=True)

    @property
    def vocab_size(self) -> int:
        return self.metadata["tokenizer"]["vocab_size"]

    @property
    def largest_id(self) -> int:
        """The largest token id the store holds: of its documents (as `burst prepare` recorded it, or scanned in
        a store without the record), its BOS and its EOS."""
        if self._largest_id is None:
            recorded = self.metadata.get("max_token_id")
            documents = recorded if isinstance(recorded, int) else int(self._tokens.max(initial=0))
            self._largest_id = max(documents, self.bos_id, self.eos_id)
        return self._largest_id

    def check_fits(self, vocab_size: int, model: Path | str, fix: str) -> None:
        """Refuse a model without an embedding for every id this store holds. A tokenizer with more tokens than
        the model has embeddings is fine while the data uses none of them: LLaMA-3.2's tokenizer.json as some
        repositories ship it has 128,257 tokens (<|image|> last) for the text model's 128,256 embeddings."""
        if self.largest_id >= vocab_size:
            raise ValueError(f"the token store {self.directory} holds token id {self.largest_id:,} (its tokenizer "
                             f"has {self.vocab_size:,} tokens) but the model {model} has a vocabulary of "
                             f"{vocab_size:,} embeddings (ids up to {vocab_size - 1:,}); {fix}")

    @property
    def bos_id(self) -> int:
        return self.metadata["tokenizer"]["bos_id"]

    @property
    def eos_id(self) -> int:
        return self.metadata["tokenizer"]["eos_id"]

    @property
    def bos_first(self) -> bool:
        """Whether a document is framed BOS + document + EOS (else document + EOS), as its tokenizer frames a text
        (data/tokenizer.py); stores from before the record put BOS first, as they were trained."""
        return self.metadata["tokenizer"].get("bos_first", True)

    @property
    def document_prefix(self) -> list[int]:
        """What the loader puts before each document: [BOS], or nothing (`bos_first`); after each, EOS."""
        return [self.bos_id] if self.bos_first else []

    @property
    def packed_tokens(self) -> int:
        """The tokens of one pass over the documents as packed, each framed ([BOS] + document + EOS)."""
        return int(self.document_lengths.sum()) + (len(self.document_prefix) + 1) * self.num_documents

    def __len__(self) -> int:
        return self.num_documents

    def __repr__(self) -> str:
        return (f"TokenStore({str(self.directory)!r}, split={self.split_name!r}, "
                f"documents={self.num_documents}, tokens={self.num_tokens})")
