"""Passkey-retrieval samples: exact length, the answer where the sample says, deterministic."""

import pytest

from data import Tokenizer, passkey_sample, train_tokenizer
from data.passkey import FILLER, INTRO, NEEDLE, QUESTION


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    texts = [INTRO, FILLER * 3, NEEDLE.format(passkey=12345), QUESTION] * 20
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "tokenizer.model", vocab_size=320)


@pytest.mark.parametrize("length", [200, 1000, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_sample_has_the_exact_length_and_the_answer_at_its_end(tokenizer, length, depth):
    sample = passkey_sample(tokenizer, length, depth, seed=7)
    assert len(sample.tokens) == length and sample.tokens[0] == tokenizer.bos_id
    assert sample.tokens[sample.answer_start:sample.answer_end] == sample.answer_ids
    assert sample.answer_end == length and tokenizer.decode(sample.answer_ids).strip() == sample.passkey
    prompt = tokenizer.decode(sample.tokens[1:sample.answer_start])
    assert prompt.startswith(INTRO) and prompt.endswith(QUESTION)
    assert f"The pass key is {sample.passkey}. Remember it." in prompt


def test_needle_moves_with_depth_and_samples_are_deterministic(tokenizer):
    needle = tokenizer.encode(NEEDLE.format(passkey=passkey_sample(tokenizer, 2000, 0.0, seed=3).passkey))

    def needle_at(depth: float) -> int:
        tokens = passkey_sample(tokenizer, 2000, depth, seed=3).tokens
        return next(i for i in range(len(tokens)) if tokens[i:i + len(needle)] == needle)

    places = [needle_at(d) for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
    after_intro = 1 + len(tokenizer.encode(INTRO))
    assert places[0] == after_intro and places == sorted(places)
    answer = passkey_sample(tokenizer, 2000, 1.0, seed=3).answer_ids
    assert places[-1] == 2000 - len(needle) - len(tokenizer.encode(QUESTION)) - len(answer)
    assert passkey_sample(tokenizer, 2000, 0.5, seed=3) == passkey_sample(tokenizer, 2000, 0.5, seed=3)
    assert len({passkey_sample(tokenizer, 500, 0.5, seed=s).passkey for s in range(10)}) > 5
    assert len(passkey_sample(tokenizer, 500, 0.5, seed=1, digits=8).passkey) == 8


def test_bad_depth_or_too_short_length_is_refused(tokenizer):
    with pytest.raises(ValueError, match="depth 1.5 must be in"):
        passkey_sample(tokenizer, 1000, 1.5)
    with pytest.raises(ValueError, match="needs at least .* tokens"):
        passkey_sample(tokenizer, 10, 0.5)
