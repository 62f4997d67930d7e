"""The tokenizer files a model directory carries, and what a Hugging Face export adds for `AutoTokenizer`.

A run keeps its data's tokenizer: tokenizer.json with tokenizer_config.json, special_tokens_map.json and
chat_template.jinja when they came with it, or a SentencePiece tokenizer.model (data/tokenizer.py; models/ does
not import data/, so the names are repeated here). A native export copies them. A Hugging Face export makes
`AutoTokenizer.from_pretrained(DIR)` encode as training did:

- with a tokenizer.json: copied unchanged, for training framed documents as its post-processor frames a text
  (BOS first for LLaMA-3's, none for SmolLM2's: data/tokenizer.py), and a tokenizer_config.json naming BOS and
  EOS written when there is none;
- with only a SentencePiece tokenizer.model: converted into a tokenizer.json with the `tokenizers` library's
  models (a BPE from its pieces and the merges that rebuild them, as transformers' LlamaConverter does;
  a Unigram from its pieces and scores), SentencePiece's identity normalisation as Prepend/Replace, checked
  on probe texts against SentencePiece itself: a model the conversion cannot express is refused, not
  exported with a tokenizer that encodes otherwise. For a BPE its tokenizer_config.json sets
  split_special_tokens, so that a text holding "<s>" is plain characters to `AutoTokenizer`, as to
  SentencePiece; for a Unigram such a literal string stays the special token, as in transformers' own
  conversion (the one difference left).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import sentencepiece as spm
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from models.config import ModelConfig

HF_FILE, CONFIG_FILE, SPECIAL_TOKENS_FILE, SPM_FILE = ("tokenizer.json", "tokenizer_config.json",
                                                      "special_tokens_map.json", "tokenizer.model")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # a chat template kept beside tokenizer.json
TOKENIZER_FILES = (HF_FILE, CONFIG_FILE, SPECIAL_TOKENS_FILE, CHAT_TEMPLATE_FILE, SPM_FILE)
SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"
# Texts a converted tokenizer must encode exactly as SentencePiece does: code, runs of spaces, tabs and newlines,
# leading and trailing spaces, digits, accents, CJK, emoji (byte fallback).
PROBES = ("def f(x):\n    return x  *  2\t# tabs\there\n\n\n", "  leading and trailing  ", "1234567 3.14159",
          "naïve café, Ünïcödé", "数据 データ 데이터", "emoji 🙂🚀 end", "a", " ", "\n",
          "states_<s>[0] (?P<unk>x) </s>")  # the last: literal specials (BPE only, see below)


def tokenizer_beside(directory: Path) -> Path | None:
    """`directory` when it keeps a tokenizer (tokenizer.json or tokenizer.model), else None."""
    return directory if any((directory / name).is_file() for name in (HF_FILE, SPM_FILE)) else None


def load_sentencepiece(path: Path) -> spm.SentencePieceProcessor:
    """The SentencePiece model at `path`, with a ValueError naming the file when it is not one."""
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as err:  # SentencePiece's parse error names the proto, not the fix
        raise ValueError(f"{path} is not a SentencePiece .model file ({err}); put the tokenizer the model was "
                         f"trained with beside its weights (its tokenizer.json, or a SentencePiece "
                         f"tokenizer.model), or delete it") from None


def load_tokenizer_json(path: Path) -> Tokenizer:
    """The tokenizer.json at `path`, with a ValueError naming the file when the `tokenizers` library cannot read it."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises plain Exception
        raise ValueError(f"{path} is not a tokenizer.json the `tokenizers` library can read ({err}); put the "
                         f"tokenizer the model was trained with beside its weights, or delete it") from None


def check_tokenizer(directory: Path) -> None:
    """Refuse a damaged tokenizer kept in `directory` before anything is written: the one a Hugging Face export
    would use (tokenizer.json, else tokenizer.model)."""
    if (directory / HF_FILE).is_file():
        load_tokenizer_json(directory / HF_FILE)
    elif (directory / SPM_FILE).is_file():
        load_sentencepiece(directory / SPM_FILE)


def copy_tokenizer_files(directory: Path, dst: Path) -> None:
    """Copy every tokenizer file kept in `directory` into `dst`, unchanged."""
    for name in TOKENIZER_FILES:
        if (directory / name).is_file():
            shutil.copyfile(directory / name, dst / name)


def write_hf_tokenizer(directory: Path, dst: Path, config: ModelConfig) -> None:
    """The tokenizer files of a Hugging Face export into `dst`, from the tokenizer kept in `directory` (see above)."""
    copy_tokenizer_files(directory, dst)
    if (directory / HF_FILE).is_file():
        tokenizer = load_tokenizer_json(directory / HF_FILE)
        if not (directory / CONFIG_FILE).is_file() and config.bos_token_id is not None \
                and isinstance(config.eos_token_id, int):
            _write_configs(dst, {"bos_token": tokenizer.id_to_token(config.bos_token_id),
                                 "eos_token": tokenizer.id_to_token(config.eos_token_id)}, config.max_seq_len)
        return
    sp = load_sentencepiece(directory / SPM_FILE)
    tokenizer = tokenizer_from_sentencepiece(sp, directory / SPM_FILE)
    tokenizer.save(str(dst / HF_FILE))
    _write_configs(dst, {"bos_token": sp.id_to_piece(sp.bos_id()), "eos_token": sp.id_to_piece(sp.eos_id()),
                         "unk_token": sp.id_to_piece(sp.unk_id())}, config.max_seq_len,
                   split_special_tokens=tokenizer.encode_special_tokens)


def _add_bos(tokenizer: Tokenizer, bos: str, bos_id: int) -> None:
    """Put BOS in front of every encoded text with special tokens, as burst's loader does for a SentencePiece
    model's documents, after what the tokenizer's post-processor already does (say, byte-level offset trimming)."""
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                             special_tokens=[(bos, bos_id)])
    tokenizer.post_processor = template if tokenizer.post_processor is None else \
        processors.Sequence([tokenizer.post_processor, template])


def _write_configs(dst: Path, specials: dict[str, str], model_max_length: int,
                   split_special_tokens: bool = False) -> None:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": model_max_length, **specials,
              **({"split_special_tokens": True} if split_special_tokens else {})}
    (dst / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (dst / SPECIAL_TOKENS_FILE).write_text(json.dumps(specials, indent=2) + "\n")


def _merges(sp: spm.SentencePieceProcessor, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges that rebuild every normal piece, ranked as SentencePiece applies them: by the merged piece's id
    (a SentencePiece BPE scores piece i as -i, and merges the best-scored pair first)."""
    merges = []
    for piece, piece_id in vocab.items():
        if not sp.is_unknown(piece_id) and not sp.is_control(piece_id) and not sp.is_byte(piece_id):
            splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
            merges += [(piece_id, vocab[left], vocab[right], left, right) for left, right in splits]
    return [(left, right) for *_, left, right in sorted(merges)]


def is_bpe(sp: spm.SentencePieceProcessor) -> bool:
    """Whether `sp` is a BPE model (whole-number piece scores: -rank); a Unigram model's are log-probabilities."""
    return all(float(sp.get_score(i)).is_integer() for i in range(sp.get_piece_size()))


def tokenizer_from_sentencepiece(sp: spm.SentencePieceProcessor, path: Path) -> Tokenizer:
    """A `tokenizers` Tokenizer encoding as the SentencePiece model `sp` (BPE or Unigram), BOS first, checked on
    PROBES; a ValueError naming `path` when they differ."""
    size = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(size)]
    has_bytes = any(sp.is_byte(i) for i in range(size))
    if is_bpe(sp):
        vocab = {piece: i for i, piece in enumerate(pieces)}
        model = models.BPE(vocab=vocab, merges=_merges(sp, vocab), unk_token=sp.id_to_piece(sp.unk_id()),
                           fuse_unk=True, byte_fallback=has_bytes)
    else:
        model = models.Unigram([(piece, sp.get_score(i)) for i, piece in enumerate(pieces)], sp.unk_id(), has_bytes)
    tokenizer = Tokenizer(model)
    tokenizer.add_special_tokens([AddedToken(pieces[i], special=True, normalized=False) for i in range(size)
                                  if sp.is_control(i) or sp.is_unknown(i)])
    # SentencePiece's identity normalisation: a leading space added, every space shown as "▁".
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE), normalizers.Replace(" ", SPM_SPACE)])
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    _add_bos(tokenizer, pieces[sp.bos_id()], sp.bos_id())
    # A BPE never merges into a control piece, so with specials not matched in text ("split_special_tokens", which
    # tokenizer_config.json passes to AutoTokenizer) "<s>" is plain characters, as to SentencePiece. A Unigram
    # lattice would take the piece "<s>" itself: there the literal string stays the special token.
    tokenizer.encode_special_tokens = is_bpe(sp)
    for text in PROBES if is_bpe(sp) else PROBES[:-1]:
        if tokenizer.encode(text, add_special_tokens=False).ids != sp.encode(text):
            raise ValueError(f"the SentencePiece model {path} cannot be written as a tokenizer.json that encodes "
                             f"alike (they differ on {text!r}; its normalisation is probably not the identity), so "
                             f"`AutoTokenizer` could not load this export as it was trained; export with --to burst, "
                             f"or train on a store prepared with a tokenizer.json")
    return tokenizer
