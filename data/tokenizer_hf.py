"""The Hugging Face backend of the tokenizer interface: a `tokenizer.json` read by the `tokenizers` library.

Any model's: byte-level BPE (LLaMA-3), SentencePiece-converted (LLaMA-2, Mistral), WordPiece, Unigram.
The ids are exactly those of `tokenizers.Tokenizer.encode(text, add_special_tokens=False)`, which are
those `AutoTokenizer` gives after its specials: a literal "<|end_of_text|>" in a text is that token, in
both, unless tokenizer_config.json sets split_special_tokens (then it is plain text, in both). Truncation
and padding configured in the file are switched off: a store keeps whole documents.

BOS and EOS come from the tokenizer's own files, first found wins: `tokenizer_config.json`'s bos_token
and eos_token, then `special_tokens_map.json`'s, then what the post-processor puts before and after
a text; a tokenizer that names no BOS at all (Qwen's) has EOS for it. Documents are framed as the
post-processor frames a text (what `AutoTokenizer(text)` gives): BOS first when it puts BOS there, no BOS
otherwise (data/tokenizer.py), so Qwen's documents are document + EOS. The vocabulary is every id the tokenizer
can give, its added tokens included (LLaMA-3: 128,256).

A chat template is read where transformers reads it: `chat_template.jinja` beside tokenizer.json, else
tokenizer_config.json's `chat_template` (a string, or named templates of which "default" is used).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizerModel

from data.tokenizer import CHAT_TEMPLATE_FILE, HF_COMPANIONS, HF_FILE, HUGGINGFACE, Tokenizer, files_of

# The parts of a tokenizer.json that decide encode()'s ids without specials (with tokenizer_config.json's
# split_special_tokens); the post-processor, decoder, truncation and padding do not, so an export that adds
# BOS to the post-processor is the same tokenizer.
ENCODING_PARTS = ("added_tokens", "normalizer", "pre_tokenizer", "model")
SPECIALS_PROBE = "burst"  # any text: what the post-processor adds around it are the specials
# The named special tokens transformers gives a chat template (its special_tokens_map), as strings.
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class HFTokenizer(Tokenizer):
    """`tokenizer.json` and, beside it, tokenizer_config.json and special_tokens_map.json when present."""

    kind = HUGGINGFACE

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            self._tok = HFTokenizerModel.from_file(str(path))
        except Exception as err:  # OSError, json's errors, and the tokenizers library's plain Exception
            raise ValueError(f"{path} is not a Hugging Face tokenizer.json the `tokenizers` library can read "
                             f"({err}); pass a model's tokenizer.json, or the directory holding it") from None
        self._tok.no_truncation()
        self._tok.no_padding()
        self.path = path
        self.files = files_of(HUGGINGFACE, path)
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        configs = {name: _read_json(self.files[name]) for name in HF_COMPANIONS if name in self.files}
        self._check_added_tokens(configs.get(HF_COMPANIONS[0], {}))
        split_special_tokens = configs.get(HF_COMPANIONS[0], {}).get("split_special_tokens") is True
        self._tok.encode_special_tokens = split_special_tokens
        encoding = {part: raw.get(part) for part in ENCODING_PARTS}
        self.digest = hashlib.sha256(json.dumps({**encoding, "split_special_tokens": split_special_tokens},
                                                sort_keys=True, ensure_ascii=False).encode()).hexdigest()
        self.eos_id = self._special("eos", configs)
        # A tokenizer that names no BOS (Qwen's: bos_token null) frames documents as document + EOS: its bos_id is
        # EOS, never put first (bos_first is False), the separator Qwen packs its documents with.
        self.bos_id = self._special("bos", configs, none=self.eos_id)
        self.bos_first = self._added_around_text()[0] == [self.bos_id]
        self.special_tokens = {}
        for config in reversed(configs.values()):  # tokenizer_config.json's win
            self.special_tokens.update({name: content for name in NAMED_SPECIALS
                                        if isinstance(content := _content(config.get(name)), str)})
        self.chat_template, self.chat_template_file = self._chat_template(configs.get(HF_COMPANIONS[0], {}))

    def _special(self, role: str, configs: dict[str, dict[str, Any]], none: int | None = None) -> int:
        """The id of the BOS or EOS token, named by the first file that names one; `none` if given where none
        does."""
        for name, config in configs.items():
            content = _content(config.get(f"{role}_token"))
            if isinstance(content, str):
                token_id = self._tok.token_to_id(content)
                if token_id is None:
                    raise ValueError(f"{self.files[name]} names {role}_token {content!r}, which "
                                     f"{self.files[HF_FILE]} does not hold; the files are of different tokenizers")
                return token_id
        added = self._added_around_text()[0 if role == "bos" else 1]
        if len(added) == 1:
            return added[0]
        if none is not None:
            return none
        raise ValueError(f"the tokenizer {self.files[HF_FILE]} names no {role.upper()} token (no {role}_token in "
                         f"{' or '.join(HF_COMPANIONS)}, and its post-processor adds none): documents are packed "
                         f"between BOS and EOS; put a tokenizer_config.json beside it naming them, e.g. "
                         f'{{"bos_token": "<s>", "eos_token": "</s>"}}')

    def _added_around_text(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a text (LLaMA-3: [128000], []; SmolLM2: [], [])."""
        with_specials = self._tok.encode(SPECIALS_PROBE).ids
        plain = self._tok.encode(SPECIALS_PROBE, add_special_tokens=False).ids
        start = next((i for i in range(len(with_specials) - len(plain) + 1)
                      if with_specials[i:i + len(plain)] == plain), None)
        return ([], []) if start is None else (with_specials[:start], with_specials[start + len(plain):])

    def _check_added_tokens(self, config: dict[str, Any]) -> None:
        """Refuse a tokenizer_config.json whose added tokens are not tokenizer.json's: AutoTokenizer would add them,
        and encode otherwise than the `tokenizers` library does."""
        for token_id, token in (config.get("added_tokens_decoder") or {}).items():
            content = token.get("content") if isinstance(token, dict) else None
            if not str(token_id).isdigit() or self._tok.token_to_id(content or "") != int(token_id):
                raise ValueError(f"{self.files[HF_COMPANIONS[0]]} adds token {content!r} as id {token_id}, which "
                                 f"{self.files[HF_FILE]} does not hold under that id; the files are of different "
                                 f"tokenizers: use the ones a model was published with")

    def _chat_template(self, config: dict[str, Any]) -> tuple[str | None, str | None]:
        """The chat template and the file it is read from, where transformers finds it; (None, None) if none."""
        if CHAT_TEMPLATE_FILE in self.files:
            try:
                return self.files[CHAT_TEMPLATE_FILE].read_text(encoding="utf-8"), CHAT_TEMPLATE_FILE
            except (OSError, UnicodeDecodeError) as err:
                raise ValueError(f"{self.files[CHAT_TEMPLATE_FILE]} cannot be read as UTF-8 text ({err}); restore it "
                                 f"from the model it came with") from None
        template, where = config.get("chat_template"), self.files.get(HF_COMPANIONS[0])
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if not isinstance(named.get("default"), str):
                raise ValueError(f"{where} holds named chat templates {sorted(map(str, named))} but no 'default' one "
                                 f"(the one transformers renders conversations with); name one of them 'default'")
            template = named["default"]
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{where}'s chat_template is {type(template).__name__}, not a string or a list of named "
                             f"templates; restore the file from the model it came with")
        return template, (HF_COMPANIONS[0] if template is not None else None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_as_text(self, text: str) -> list[int]:
        """The `tokenizers` library's split_special_tokens for this one call (transformers' too)."""
        reads_specials = self._tok.encode_special_tokens
        self._tok.encode_special_tokens = True
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = reads_specials

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """encode() of each text with each token's character span in it, [start, end) (tokens of one character's
        bytes share its span), on the `tokenizers` library's thread pool."""
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [(encoding.ids, encoding.offsets) for encoding in encodings]

    def encode_batch(self, texts: list[str], num_threads: int | None = None) -> list[list[int]]:
        """On the `tokenizers` library's thread pool: every core, or RAYON_NUM_THREADS (num_threads is not used:
        the pool is made once per process)."""
        return [encoding.ids for encoding in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _content(token: Any) -> Any:
    """A special token's string as a config names it: the string itself, or an AddedToken's {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); restore it from the model it came with") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds {type(value).__name__}, not a JSON object; restore it from the model it "
                         f"came with")
    return value
