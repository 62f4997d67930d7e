"""One-process attention (models.LocalAttention -> burst.local_attn): the same numbers as a dense
[seq, seq] mask handed to SDPA (the old path, rebuilt here only as the reference), with memory linear
in the sequence length, and no mask ever built on a one-process path."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import burst
from models import LocalAttention, ModelConfig, init_model
from tests.distributed import free_port


def dense_mask(boundaries: list[list[int]], seq_len: int, sees: list[list[int]] | None = None) -> torch.Tensor:
    """The reference: bool [batch, 1, seq, seq], True where query i may see key j (own document causally,
    and the whole of the document it sees)."""
    positions = torch.arange(seq_len)
    masks = []
    for row, offsets in enumerate(boundaries):
        doc = torch.bucketize(positions, torch.tensor(offsets[1:-1]), right=True)  # [seq] document of each token
        mask = (positions[:, None] >= positions[None, :]) & (doc[:, None] == doc[None, :])
        if sees is not None:
            mask |= torch.tensor(sees[row])[doc][:, None] == doc[None, :]
        masks.append(mask)
    return torch.stack(masks)[:, None]


def reference(q, k, v, boundaries=None, sees=None):
    """The old LocalAttention: SDPA with is_causal, or with the dense mask."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if boundaries is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(boundaries, q.shape[2], sees),
                                             enable_gqa=True)
    return out.transpose(1, 2)


CASES = {  # name: (seq_len, boundaries per row, sees per row)
    "causal": (37, None, None),
    "documents": (40, [[0, 7, 19, 40], [0, 40]], None),
    "odd length documents": (29, [[0, 1, 12, 29], [0, 28, 29]], None),
    "prefix sharing": (48, [[0, 12, 20, 31, 48], [0, 5, 9, 14, 48]], [[-1, 0, 0, 2], [-1, 0, 1, -1]]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_local_attention_matches_the_dense_mask(case, heads):
    """Output and q/k/v gradients equal the dense-mask path's within float32 rounding."""
    seq_len, boundaries, sees = CASES[case]
    torch.manual_seed(0)
    q_heads, kv_heads = heads
    q = torch.randn(2, seq_len, q_heads, 16, requires_grad=True)
    k, v = (torch.randn(2, seq_len, kv_heads, 16, requires_grad=True) for _ in range(2))
    dout = torch.randn(2, seq_len, q_heads, 16)
    docs = None if boundaries is None else [torch.tensor(b) for b in boundaries]
    doc_sees = None if sees is None else [torch.tensor(s) for s in sees]
    got = LocalAttention()(q, k, v, docs, doc_sees)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    want = reference(q, k, v, boundaries, sees)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, g, w in zip("qkv", grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=f"d{name}")


@pytest.mark.parametrize("prefix", [False, True], ids=["documents", "prefix-sharing"])
def test_a_model_gives_the_dense_masks_loss_logits_and_gradients(prefix, monkeypatch):
    """models.Transformer with doc_boundaries (and doc_sees): logits, loss and every parameter's gradient as with the
    dense mask (GQA model)."""
    config = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=128, n_heads=4, n_kv_heads=2)
    model = init_model(config, seed=3)
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    _, boundaries, sees = CASES["prefix sharing"]
    sees = sees if prefix else None
    docs = [torch.tensor(b) for b in boundaries]
    doc_sees = None if sees is None else [torch.tensor(s) for s in sees]

    def run():
        model.zero_grad()
        logits = model(tokens, None, docs, doc_sees)
        loss, _ = model.loss(tokens, tokens, None, docs, doc_sees)
        loss.backward()
        return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    logits, loss, grads = run()

    class DenseAttention(torch.nn.Module):
        def forward(self, q, k, v, doc_boundaries=None, doc_sees=None):
            return reference(q, k, v, [b.tolist() for b in doc_boundaries],
                             None if doc_sees is None else [s.tolist() for s in doc_sees])

    for layer in model.layers:
        layer.attention.core_attention = DenseAttention()
    want_logits, want_loss, want_grads = run()
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_local_attn_works_inside_torch_distributed_as_a_world_of_one():
    """No process group is read: local_attn gives the same result whether or not torch.distributed is
    initialised (a dp rank of a cp-1 run attends to its own sequence only)."""
    script = textwrap.dedent("""
        import os, torch, torch.distributed as dist, burst
        torch.manual_seed(0)
        q, k, v = torch.randn(3, 1, 24, 2, 8).unbind(0)
        docs = [torch.tensor([0, 9, 24])]
        alone = burst.local_attn(q, k, v, doc_boundaries=docs)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
        dist.init_process_group("gloo", rank=0, world_size=1)
        assert torch.equal(burst.local_attn(q, k, v, doc_boundaries=docs), alone)
        dist.destroy_process_group()
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PORT": str(free_port())})
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_bad_inputs_are_refused_with_what_to_fix():
    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        burst.local_attn(q, torch.randn(1, 8, 3, 8), torch.randn(1, 8, 3, 8))
    with pytest.raises(ValueError, match="rise strictly from 0 to the global sequence length 8"):
        burst.local_attn(q, q, q, doc_boundaries=[torch.tensor([0, 5, 7])])
    with pytest.raises(ValueError, match="pass doc_boundaries too"):
        burst.local_attn(q, q, q, doc_sees=[torch.tensor([-1])])
    with pytest.raises(ValueError, match="unknown attention kernel"):
        burst.local_attn(q, q, q, kernel="fastest")


class RefuseQuadratic(TorchDispatchMode):
    """Fails any op (forward or backward) whose output has seq x seq elements or more: a dense mask or score
    matrix over the sequence. Operators it sees from outside only (burst's attention operator) are checked by
    their outputs too; their kernels tile the work (the memory test below measures them)."""

    def __init__(self, seq_len: int):
        super().__init__()
        self.limit = seq_len * seq_len

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.limit:
                raise AssertionError(f"{func} made a tensor of shape {tuple(t.shape)}: quadratic in the sequence")
        return out


def triples(seq_len: int, document: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Documents of `document` tokens (the last one shorter) in threes, a prompt and two answers that see it."""
    offsets = list(range(0, seq_len, document)) + [seq_len]
    sees = [-1 if i % 3 == 0 else i - i % 3 for i in range(len(offsets) - 1)]
    return [torch.tensor(offsets)], [torch.tensor(sees)]


@pytest.mark.parametrize("masking", ["causal", "documents", "prefix-sharing"])
def test_no_one_process_path_makes_a_quadratic_tensor(masking):
    """A model's forward, loss and backward at one process, with documents and prefix sharing: no op makes a
    tensor of seq x seq elements (the old path built a [batch, 1, seq, seq] mask)."""
    seq_len = 1024
    config = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=64, n_layers=1)
    model = init_model(config)
    tokens = torch.randint(0, 64, (1, seq_len))
    docs, sees = triples(seq_len, 100)
    docs, sees = {"causal": (None, None), "documents": (docs, None), "prefix-sharing": (docs, sees)}[masking]
    with RefuseQuadratic(seq_len):
        loss, _ = model.loss(tokens, tokens, None, docs, sees)
        loss.backward()
    with pytest.raises(AssertionError, match="quadratic"), RefuseQuadratic(seq_len):  # the guard itself works
        reference(*torch.randn(3, 1, seq_len, 2, 8).unbind(0), [[0, seq_len]])


MEMORY_SCRIPT = """
import dataclasses, resource, sys, torch
from models import ModelConfig, init_model
from tests.test_one_process_attention import triples
seq_len = int(sys.argv[1])
torch.set_num_threads(1)
config = dataclasses.replace(ModelConfig.from_name("debug"), vocab_size=64, n_layers=1)
model = init_model(config)
tokens = torch.randint(0, 64, (1, seq_len))
docs, sees = triples(seq_len, 1024)
def peak(): return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]) * 1024
def now(): return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
with torch.no_grad():
    model.loss(tokens[:, :2048], tokens[:, :2048], None, *triples(2048, 1024))  # warm up the kernels' buffers
    # from what the process holds now, with the high-water mark reset: start-up's peak may be above this run's,
    # and Linux carries ru_maxrss across exec, so a child of a large pytest process would inherit its peak
    open("/proc/self/clear_refs", "w").write("5")
    before = now()
    loss, count = model.loss(tokens, tokens, None, docs, sees)
assert torch.isfinite(loss) and int(count) == seq_len
print(max(peak() - before, 0))
"""


def test_memory_is_linear_in_the_sequence_length_where_a_mask_could_not_fit():
    """Evaluating at 131,072 tokens with documents and prefix sharing: a dense bool mask alone would be 16 GiB (a
    float one 64 GiB); the peak grows by what the activations take, about 4x from 32,768 tokens, not 16x."""
    grown = {}
    for seq_len in (32_768, 131_072):
        result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(seq_len)], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        grown[seq_len] = int(result.stdout.split()[-1])
    assert grown[131_072] < 2**30, grown  # a [seq, seq] bool mask would be 16 GiB
    assert grown[131_072] < 6 * max(grown[32_768], 16 * 2**20), grown  # linear: 4x the tokens, not 16x the bytes
