"""Long documents encoded in bounded pieces that give the token ids of the whole document.

`burst prepare` reads a document in parts (a text file block by block) and never encodes more than
PIECE_CHARS characters at once, so its memory stays flat for a one-line 40 MB file. Where a piece ends
matters: a token must not straddle the cut, and a tokenizer that adds a space at the start of a text
(SentencePiece's dummy prefix, LLaMA-2's) must not add one at every piece. So:

- a cut is placed where the tokenizer itself puts a token boundary: tried first before runs of whitespace,
  then anywhere, going back from PIECE_CHARS, and accepted when encode(left) is a prefix of
  encode(left + right) on the CONTEXT_CHARS characters either side (tokens are far shorter);
- each piece after the first is encoded after the CONTEXT_CHARS characters before it, whose tokens are then
  dropped; the encoding is checked to start with exactly those tokens.

The ids are then those of the whole document (tests/test_data_prepare.py compares them for SentencePiece
and a byte-level BPE). Only when no boundary is found among the places tried (CHECKS before whitespace, CHECKS
anywhere), or the check fails, is a piece encoded on its own (a "hard cut"): the ids near that cut may differ
from the whole's, and a tokenizer with a dummy prefix adds a space there. `hard_cuts` counts them; prepare
reports any.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

PIECE_CHARS = 2**18  # at most this many characters of a document per encode call (plus CONTEXT_CHARS); a
# batch of CHUNK_CHARS (prepare.py) then holds 16 pieces of a long document, one per thread
CONTEXT_CHARS = 64  # text around a cut that decides it, and before a piece that encodes it
CHECKS = 64  # cut points tried before whitespace, then as many anywhere
WHITESPACE = " \n\t\r"


@dataclass
class Piece:
    """A piece of a document to encode after `context` (the text just before it, empty for a first piece), whose
    ids are `context_ids`: the encoding of `text` starts with them, and they are dropped."""

    body: str
    context: str = ""
    context_ids: list[int] = field(default_factory=list)
    ends_document: bool = True

    @property
    def text(self) -> str:
        return self.context + self.body


class DocumentCutter:
    """Turns a stream of document parts into pieces of at most `piece_chars` characters (plus their context).

    feed(part, ends_document) returns the pieces that are complete; a document's last part flushes it.
    """

    def __init__(self, encode: Callable[[str], list[int]], piece_chars: int | None = None) -> None:
        self.encode, self.piece_chars = encode, piece_chars or PIECE_CHARS
        if self.piece_chars < 4 * CONTEXT_CHARS:
            raise ValueError(f"piece_chars {self.piece_chars} must be at least {4 * CONTEXT_CHARS}")
        self.hard_cuts = 0
        self._buffer = ""  # the current document's text not yet handed out
        self._context, self._context_ids = "", []  # what the next piece of the current document is encoded after

    def feed(self, text: str, ends_document: bool) -> list[Piece]:
        self._buffer += text
        pieces = []
        while len(self._buffer) > self.piece_chars:
            cut, context_ids = self._cut_point()
            pieces.append(Piece(self._buffer[:cut], self._context, self._context_ids, ends_document=False))
            if context_ids is None:  # a hard cut: the next piece is encoded on its own
                self._context, self._context_ids = "", []
                self.hard_cuts += 1
            else:
                self._context, self._context_ids = self._buffer[cut - CONTEXT_CHARS:cut], context_ids
            self._buffer = self._buffer[cut:]
        if ends_document:
            pieces.append(Piece(self._buffer, self._context, self._context_ids) if self._buffer else Piece(""))
            self._buffer, self._context, self._context_ids = "", "", []
        return pieces

    def piece_ids(self, pieces: list[Piece], encoded: list[list[int]]) -> Iterator[list[int]]:
        """The ids of each piece, from the encodings of their texts (the context's dropped). A piece whose encoding
        does not start with its context's ids is encoded again on its own, and counted as a hard cut."""
        for piece, ids in zip(pieces, encoded, strict=True):
            skip = len(piece.context_ids)
            if ids[:skip] == piece.context_ids:
                yield ids[skip:]
            else:
                self.hard_cuts += 1
                yield self.encode(piece.body)

    def _cut_point(self) -> tuple[int, list[int] | None]:
        """Where to end the next piece, and the ids of the CONTEXT_CHARS before that cut (None: a hard cut)."""
        lowest = self.piece_chars // 2
        for candidates in (_whitespace_starts(self._buffer, self.piece_chars, lowest),
                           range(self.piece_chars, self.piece_chars - CHECKS, -1)):
            for checked, cut in enumerate(candidates):
                if checked == CHECKS:
                    break
                left = self._buffer[cut - CONTEXT_CHARS:cut]
                left_ids = self.encode(left)
                if self.encode(left + self._buffer[cut:cut + CONTEXT_CHARS])[:len(left_ids)] == left_ids:
                    return cut, left_ids
        return self.piece_chars, None


def _whitespace_starts(text: str, end: int, lowest: int) -> Iterator[int]:
    """Positions i in (lowest, end], from the end back, where text[i] is whitespace and text[i - 1] is not."""
    i = end + 1
    while True:
        i = max(text.rfind(char, lowest, i) for char in WHITESPACE)
        if i <= lowest:
            return
        if not text[i - 1].isspace():
            yield i
