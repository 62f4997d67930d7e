"""A data mixture: several token stores, each giving a share of the training tokens.

    --data code=stores/code:0.3 --data books=stores/books:0.3:min_doc=65536 --data short=stores/web:0.4

Each `--data` names one source: `[NAME=]STORE[:SHARE][:min_doc=TOKENS]`. NAME defaults to the store's
directory name; SHARE (a fraction of the tokens) may be left out only for a single source; `min_doc`
keeps only the store's documents of at least that many tokens (ProLong trains its long sources on long
documents only). The shares must sum to one.

Every sequence comes from one source. `MixtureSchedule` picks the source of each global sequence, the
one furthest behind its share so far (largest deficit, ties to the first listed), so after n sequences
each source has given within one sequence of share x n: the realised token shares converge to the targets
at rate 1/n, with no randomness, identically on every rank and after a resume.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path

from data.store import TokenStore

SHARE_TOLERANCE = 1e-6  # shares written as decimals (0.3 + 0.3 + 0.4) sum to one only up to rounding
_NAME = re.compile(r"[A-Za-z_][\w.-]*")
_OPTION = re.compile(r"[A-Za-z_][\w-]*=.*")  # KEY=VALUE after the store
OPTIONS = ("min_doc",)


@dataclass(frozen=True)
class SourceSpec:
    """One `--data` source: a token store, its name, its share of the tokens and its minimum document length."""

    name: str
    path: str
    share: float = 1.0
    min_doc: int = 0  # documents shorter than this many tokens (BOS/EOS not counted) are left out

    def __str__(self) -> str:
        """The canonical `--data` text, as config.toml records it (parse_source reads it back)."""
        return f"{self.name}={self.path}:{self.share!r}" + (f":min_doc={self.min_doc}" if self.min_doc else "")


def parse_source(text: str, *, single: bool = False) -> SourceSpec:
    """A SourceSpec from `[NAME=]STORE[:SHARE][:min_doc=TOKENS]`; `single`: the only --data (share 1 implied).

    Options are read from the right, so a store path may itself hold ':' or '='.
    """
    name, rest = None, text
    head, sep, tail = text.partition("=")
    if sep and _NAME.fullmatch(head) and not head.startswith("min_doc"):
        name, rest = head, tail
    share, min_doc = None, 0
    parts = rest.split(":")
    while len(parts) > 1:
        option = parts[-1]
        if option.startswith("min_doc="):
            value = option.removeprefix("min_doc=")
            if not value.isdigit():
                raise ValueError(f"--data {text!r}: min_doc={value!r} must be a whole number of tokens, e.g. "
                                 f"min_doc=65536")
            min_doc = int(value)
        elif _is_number(option) and share is None:
            share = float(option)
        elif _OPTION.fullmatch(option) and not Path(":".join(parts)).exists():  # a path may hold KEY=VALUE
            key = option.partition("=")[0]
            close = difflib.get_close_matches(key, OPTIONS, n=1)
            guess = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"--data {text!r}: unknown option {key}{guess}; write "
                             f"[NAME=]STORE[:SHARE][:min_doc=TOKENS]")
        else:
            break
        parts.pop()
    path = ":".join(parts)
    if not path:
        raise ValueError(f"--data {text!r} names no store; write [NAME=]STORE[:SHARE][:min_doc=TOKENS], "
                         f"e.g. books=stores/books:0.3")
    if share is None:
        if not single:
            raise ValueError(f"--data {text!r} gives no share; with several sources each needs one, e.g. "
                             f"{name or 'NAME'}={path}:0.3 (the shares sum to 1)")
        share = 1.0
    if not (math.isfinite(share) and 0 < share <= 1):
        raise ValueError(f"--data {text!r}: share {share} must be in (0, 1], the fraction of tokens from this source")
    return SourceSpec(name or default_name(path), path, share, min_doc)


def default_name(path: str) -> str:
    """A source's name when --data gives none: its store directory's name, made a valid NAME."""
    name = re.sub(r"[^\w.-]", "_", Path(path).name) or "data"
    return name if _NAME.fullmatch(name) else f"data_{name}"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_mixture(texts: list[str]) -> list[SourceSpec]:
    """Every `--data` source, checked together: distinct names, distinct stores, shares summing to one."""
    if not texts:
        raise ValueError("--data was given with no source")
    specs = [parse_source(text, single=len(texts) == 1) for text in texts]
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"--data sources must have distinct names, {repeated} is given twice; name them, e.g. "
                         f"--data code=STORE:0.5 --data books=STORE:0.5")
    paths = [str(Path(spec.path).resolve()) for spec in specs]
    if len(set(paths)) != len(paths) and not _distinct_filters(specs):
        raise ValueError("--data names the same store twice with the same min_doc; give each store once, or "
                         "different min_doc filters")
    total = sum(spec.share for spec in specs)
    if abs(total - 1) > SHARE_TOLERANCE:
        raise ValueError(f"--data shares sum to {total:g}, not 1 ("
                         + " + ".join(f"{spec.name} {spec.share:g}" for spec in specs)
                         + "); they are fractions of the training tokens: make them add up to 1")
    return specs


def _distinct_filters(specs: list[SourceSpec]) -> bool:
    keys = [(str(Path(spec.path).resolve()), spec.min_doc) for spec in specs]
    return len(set(keys)) == len(keys)


class MixtureSchedule:
    """Which source each global sequence comes from: the one furthest below its share (largest deficit).

    `counts[s]` is how many sequences source s has given; `next()` picks the source of the next one.
    The state is the counts: every rank computes the same picks, and a resumed run continues them.
    """

    def __init__(self, shares: list[float]) -> None:
        self.shares = list(shares)
        self.counts = [0] * len(shares)

    def next(self) -> int:
        drawn = sum(self.counts) + 1
        deficits = [share * drawn - count for share, count in zip(self.shares, self.counts, strict=True)]
        source = max(range(len(deficits)), key=lambda s: (deficits[s], -s))
        self.counts[source] += 1
        return source


def resolved_sources(specs: list[SourceSpec]) -> list[SourceSpec]:
    """The sources with absolute store paths, so a run resumed from another directory finds its data."""
    return [SourceSpec(spec.name, str(Path(spec.path).resolve()), spec.share, spec.min_doc) for spec in specs]


@dataclass
class Source:
    """An opened source: its spec and the training documents it draws from (min_doc applied)."""

    spec: SourceSpec
    store: TokenStore  # a view of the store's train split
    val: TokenStore  # its validation split, min_doc applied too (possibly empty)


def open_sources(specs: list[SourceSpec]) -> list[Source]:
    """Open every source's store and keep its training documents of at least min_doc tokens; refuse a store
    that cannot be read, a filter that leaves nothing, and sources prepared with different tokenizers."""
    sources = []
    for spec in specs:
        try:
            store = TokenStore(spec.path)
        except (OSError, ValueError) as err:
            raise ValueError(f"--data {spec.name}: {err}") from None
        train, val = store.split("train"), store.split("val")
        if spec.min_doc:
            val = val.at_least(spec.min_doc)
            longest = int(train.document_lengths.max(initial=0))
            train = train.at_least(spec.min_doc)
            if train.num_documents == 0:
                raise ValueError(f"--data {spec.name}: no training document of {spec.path} has min_doc="
                                 f"{spec.min_doc:,} tokens (the longest has {longest:,}); lower min_doc, or use a "
                                 f"store of longer documents")
        sources.append(Source(spec, train, val))
    first = sources[0]
    for other in sources[1:]:
        if other.store.tokenizer_fingerprint != first.store.tokenizer_fingerprint:
            raise ValueError(f"--data {other.spec.name} ({other.spec.path}) was prepared with another tokenizer than "
                             f"--data {first.spec.name} ({first.spec.path}); every source of a mixture must speak the "
                             f"same vocabulary: prepare them all with the same --tokenizer")
    instructions = [source for source in sources if source.store.is_conversations]
    for other in instructions[1:]:
        first_chat, chat = instructions[0].store.metadata["chat"], other.store.metadata["chat"]
        if chat.get("sha256") != first_chat.get("sha256"):
            raise ValueError(f"--data {other.spec.name} ({other.spec.path}) was rendered with another chat template "
                             f"({chat.get('template')}) than --data {instructions[0].spec.name} "
                             f"({instructions[0].spec.path}, {first_chat.get('template')}): a model learns one "
                             f"conversation format, and its export carries one template: prepare them all with the "
                             f"same chat template")
    return sources


def tokenizer_source(sources: list[Source]) -> Source:
    """The source whose tokenizer files a run keeps (and its exports carry): every source's ids are the same
    (open_sources checks), but only an instruction store's files hold the chat template it was rendered with."""
    return next((source for source in sources if source.store.is_conversations), sources[0])
