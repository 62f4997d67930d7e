"""The tokenizer of a Hugging Face export: files `AutoTokenizer.from_pretrained(DIR)` loads, encoding like training.

transformers reads a SentencePiece `tokenizer.model` only with protobuf installed, and then adds no
BOS unless told, so an export carries, beside the .model itself, what the `tokenizers` library reads
directly: `tokenizer.json`, the same BPE written as vocabulary and merges (the conversion transformers'
LlamaConverter does, here without transformers or protobuf), with BOS prepended to every sequence as
`burst train` does. `tokenizer_config.json` names the class (LlamaTokenizer) and the special tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import sentencepiece as spm

SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def load_sentencepiece(path: Path) -> spm.SentencePieceProcessor:
    """The SentencePiece model at `path`, with a ValueError naming the file when it is not one."""
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as err:  # SentencePiece's parse error names the proto, not the fix
        raise ValueError(f"{path} is not a SentencePiece .model file ({err}); put the tokenizer.model the model "
                         f"was trained with beside its weights, or delete it") from None


def _merges(sp: spm.SentencePieceProcessor, vocab: dict[str, int]) -> list[list[str]]:
    """BPE merges that rebuild every normal piece, ranked as SentencePiece applies them: by the merged piece's id
    (a SentencePiece BPE scores piece i as -i, and merges the best-scored pair first)."""
    merges = []
    for piece, piece_id in vocab.items():
        if not sp.is_unknown(piece_id) and not sp.is_control(piece_id) and not sp.is_byte(piece_id):
            splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
            merges += [(piece_id, vocab[left], vocab[right], left, right) for left, right in splits]
    return [[left, right] for *_, left, right in sorted(merges)]


def _added_token(piece: str, piece_id: int) -> dict:
    return {"id": piece_id, "content": piece, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def tokenizer_json(sp: spm.SentencePieceProcessor) -> dict:
    """`tokenizer.json` of the `tokenizers` library for the SentencePiece BPE `sp`: BOS + sp.encode(text)."""
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    specials = [i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    bos = sp.id_to_piece(sp.bos_id())
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added_token(sp.id_to_piece(i), i) for i in specials],
        # SentencePiece's own normalisation here (identity rule): a leading space, spaces shown as "▁".
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPM_SPACE},
            {"type": "Replace", "pattern": {"String": " "}, "content": SPM_SPACE}]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [sp.bos_id()], "tokens": [bos]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": sp.id_to_piece(sp.unk_id()),
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab, "merges": _merges(sp, vocab)},
    }


def is_bpe(sp: spm.SentencePieceProcessor) -> bool:
    """Whether `sp` is a BPE model (whole-number piece scores: -rank), which tokenizer.json can express as merges;
    a Unigram model's scores are log-probabilities."""
    return all(float(sp.get_score(i)).is_integer() for i in range(sp.get_piece_size()))


def write_hf_tokenizer(tokenizer_model: Path, directory: Path, model_max_length: int) -> None:
    """Write the tokenizer files of a Hugging Face model directory for the SentencePiece model `tokenizer_model`
    (tokenizer.json only for a BPE model: every tokenizer `burst prepare` trains, and LLaMA-2's)."""
    sp = load_sentencepiece(tokenizer_model)
    special = {"bos_token": sp.id_to_piece(sp.bos_id()), "eos_token": sp.id_to_piece(sp.eos_id()),
               "unk_token": sp.id_to_piece(sp.unk_id())}
    shutil.copyfile(tokenizer_model, directory / "tokenizer.model")
    if is_bpe(sp):
        (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json(sp), ensure_ascii=False) + "\n")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
              "legacy": True, "add_prefix_space": None, "clean_up_tokenization_spaces": False,
              "model_max_length": model_max_length, **special}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
