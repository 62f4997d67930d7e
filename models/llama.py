"""A decoder-only transformer of the LLaMA line: RMSNorm, rotary embeddings, grouped-query attention, a gated MLP.

One model serves every family burst reads (LLaMA, Qwen2/2.5, Qwen3, Mistral, Gemma 3); what differs between them
is configuration (models/config.py), never a copy of a block: q/k/v biases (Qwen2), per-head q/k norms before
RoPE (Qwen3, Gemma 3), an explicit head_dim, a sliding window per layer (Mistral v0.1, Qwen2's
use_sliding_window, Gemma 3's local layers) with its own RoPE base (Gemma 3's local layers), norms after
attention and MLP as well as before ("sandwich", Gemma 3), RMSNorm scaled by (1 + w) (Gemma), embeddings
scaled by sqrt(dim) (Gemma), a GELU-tanh gate instead of SiLU (Gemma), and attention scaled by
query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 (Gemma).

Rotary embeddings use the "rotate half" layout of Hugging Face's LlamaForCausalLM (the first
and second halves of each head form the rotated pairs), so converted checkpoints need only a
renaming, no q/k permutation. RoPE is computed from explicit global positions on every call,
so a rank holding a zigzag shard of a long sequence rotates each token by its true position. The
scalings whose frequencies depend on the sequence length (dynamic NTK, longrope) take it as
`rope_length`, which the caller computes over the whole sequence (models/rope.py says why).

Build on the meta device, then materialise and initialise:

    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cuda")
    model.init_weights(seed=0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from burst.decode import KVCache, LayerCache
from models import rope
from models.attention import LocalAttention
from models.config import ModelConfig
from models.init import initial_rows
from models.loss import chunked_cross_entropy
from models.preference import answer_logps


def rope_frequencies(config: ModelConfig, length: int | None = None,
                     device: torch.device | str | None = None, local: bool = False) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies [head_dim // 2] float32 and the factor cos/sin are scaled by, for `config`'s
    rope_theta and rope_scaling at sequences of `length` positions (see models/rope.py); local=True: those of the
    sliding-window layers when they have their own base (rope_local_theta, unscaled, as Gemma 3's)."""
    if local:
        return rope.rope_frequencies(config.rope_local_theta, config.head_dim, None, None, device)
    return rope.rope_frequencies(config.rope_theta, config.head_dim, config.rope_scaling, length, device)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                   scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [seq] or [batch, seq] int64 -> cos, sin [..., seq, 1, head_dim // 2] float32, times `scale`
    (yarn's and longrope's attention factor)."""
    angles = positions[..., None].float() * inv_freq  # [..., seq, head_dim // 2]
    if scale == 1.0:
        return angles.cos()[..., None, :], angles.sin()[..., None, :]
    return (angles.cos() * scale)[..., None, :], (angles.sin() * scale)[..., None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] pairwise (i, i + head_dim/2), in float32 (cos and sin are: a bf16 x
    is promoted exactly), rounded back to x's dtype."""
    if (x.requires_grad and torch.is_grad_enabled()) or x.itemsize > 4:
        # a gradient is cast back once for both halves' uses; float64 is rotated in float32 as well
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)
    x1, x2 = x.chunk(2, dim=-1)
    # Without a gradient (generation, evaluation) each half is written where it goes, in x's dtype, by the last
    # op: the same values, in two fewer passes over the tensor (no cat, no cast).
    rotated = torch.empty_like(x)
    first, second = rotated.chunk(2, dim=-1)
    torch.sub(x1 * cos, x2 * sin, out=first)
    torch.add(x2 * cos, x1 * sin, out=second)
    return rotated


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 whatever the input dtype.

    LLaMA's multiplies by `weight` after casting back to the input dtype; Gemma's (plus_one) by 1 + weight in
    float32, then casts (a weight of 0 is the identity), each as its family's Hugging Face code rounds."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.type_as(x)


def norm(config: ModelConfig, dim: int | None = None) -> RMSNorm:
    """The family's RMSNorm over `dim` features (default the hidden size)."""
    return RMSNorm(config.dim if dim is None else dim, config.norm_eps, config.norm_plus_one)


class Attention(nn.Module):
    """Projections, q/k norms and rotary embeddings around the swappable `core_attention`.

    window: this layer's sliding window W (a query at position i sees keys i - W < j <= i), or None: causal.
    """

    def __init__(self, config: ModelConfig, window: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.window = window
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=config.qkv_bias)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=config.out_bias)
        # per-head norms over head_dim, before RoPE (Qwen3, Gemma 3)
        self.q_norm = norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = norm(config, self.head_dim) if config.qk_norm else None
        # The kernels scale scores by head_dim ** -0.5; Gemma's query_pre_attn_scalar ** -0.5 is that times this.
        scalar = config.query_pre_attn_scalar
        self.query_scale = None if scalar in (None, self.head_dim) else math.sqrt(self.head_dim / scalar)
        self.core_attention = LocalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_boundaries: Sequence[torch.Tensor] | None,
                doc_sees: Sequence[torch.Tensor] | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.query_scale is not None:
            q = q * self.query_scale
        # doc_sees, window and cache only when given: a core attention without them keeps its four-argument call
        extra = {name: value for name, value in (("doc_sees", doc_sees), ("window", self.window), ("cache", cache))
                 if value is not None}
        out = self.core_attention(q, k, v, doc_boundaries, **extra)  # [batch, seq, n_heads, head_dim]
        return self.wo(out.reshape(batch, seq_len, -1))


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class FeedForward(nn.Module):
    """A gated MLP: w2(act(w1 x) * w3 x), act SiLU (SwiGLU) or GELU-tanh (Gemma's GeGLU)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.act = ACTIVATIONS[config.activation]
        self.w1 = nn.Linear(config.dim, config.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + feed_forward(norm(x)); with sandwich norms
    (Gemma 3) each branch's output is normed too before it joins the residual."""

    def __init__(self, config: ModelConfig, window: int | None = None):
        super().__init__()
        self.attention_norm = norm(config)
        self.attention = Attention(config, window)
        self.ffn_norm = norm(config)
        self.feed_forward = FeedForward(config)
        self.attention_out_norm = norm(config) if config.sandwich_norms else None
        self.ffn_out_norm = norm(config) if config.sandwich_norms else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_boundaries: Sequence[torch.Tensor] | None = None,
                doc_sees: Sequence[torch.Tensor] | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        h = self.attention(self.attention_norm(x), cos, sin, doc_boundaries, doc_sees, cache)
        x = x + (h if self.attention_out_norm is None else self.attention_out_norm(h))
        h = self.feed_forward(self.ffn_norm(x))
        return x + (h if self.ffn_out_norm is None else self.ffn_out_norm(h))


class TokenEmbedding(nn.Embedding):
    """nn.Embedding that skips its default initialiser on the meta device: a meta tensor holds no values, and
    normal_ on one loads PyTorch's meta decompositions, ~1.5 s of every process's start-up (init_weights sets
    the real values)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Transformer(nn.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab]; `loss` for training without full logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = TokenEmbedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, config.window(i)) for i in range(config.n_layers))
        self.norm = norm(config)
        # With tied embeddings there is no output module: the embedding matrix projects back.
        self.output = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        """The [vocab, dim] matrix that turns hidden states into logits."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise in place from `seed` (on materialised meta tensors too); the rule and the drawing,
        which gives the same weights whatever the sharding, are in models/init.py."""
        for name, param in self.named_parameters():
            param.copy_(initial_rows(self.config, name, tuple(param.shape), seed, range(param.shape[0])))

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                      doc_boundaries: Sequence[torch.Tensor] | None = None,
                      doc_sees: Sequence[torch.Tensor] | None = None, *,
                      rope_length: int | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """tokens [batch, seq] -> final-normed hidden states [batch, seq, dim].

        positions: global position ids [seq] or [batch, seq] (default 0..seq-1).
        doc_boundaries: the batch's `burst.Documents` (as the data loader makes them, doc_sees included), one
        1-D tensor of document offsets per batch row, or None.
        doc_sees: with doc_boundaries, per batch row an int64 tensor [n_docs]: the earlier document each
        document's queries also see whole (prefix sharing), or -1; None: none.
        rope_length: the sequence length a length-dependent RoPE scaling (dynamic, longrope) is computed for,
        transformers' max(position_ids) + 1; default that of `positions`, which under sequence parallelism is
        only this rank's shard: pass the whole sequence's (`Batch.rope_length`).
        cache: when generating, the keys and values kept so far, with the slots this pass writes reserved
        (burst/decode.py); the attention modules keep and read them.
        """
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        scaling = self.config.rope_scaling
        if rope_length is None and scaling is not None and scaling.depends_on_length:
            rope_length = int(positions.max()) + 1
        rotation = rotary_cos_sin(positions, *rope_frequencies(self.config, rope_length, tokens.device))
        local_rotation = rotation  # the sliding-window layers', when they have their own RoPE base (Gemma 3)
        if self.config.rope_local_theta is not None:
            local_rotation = rotary_cos_sin(positions, *rope_frequencies(self.config, device=tokens.device, local=True))
        h = self.tok_embeddings(tokens)  # [batch, seq, dim]
        if self.config.scale_embeddings:  # Gemma: by sqrt(dim), rounded to the weights' dtype as transformers does
            h = h * torch.tensor(self.config.dim ** 0.5, dtype=h.dtype)
        for index, layer in enumerate(self.layers):
            cos, sin = rotation if layer.attention.window is None else local_rotation
            h = layer(h, cos, sin, doc_boundaries, doc_sees, None if cache is None else cache.layer(index))
        return self.norm(h)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                doc_boundaries: Sequence[torch.Tensor] | None = None,
                doc_sees: Sequence[torch.Tensor] | None = None, *,
                rope_length: int | None = None) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab]."""
        return F.linear(self.hidden_states(tokens, positions, doc_boundaries, doc_sees, rope_length=rope_length),
                        self.output_weight)

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None,
             doc_boundaries: Sequence[torch.Tensor] | None = None, doc_sees: Sequence[torch.Tensor] | None = None,
             chunk_size: int = 1024, *, rope_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy over labels [batch, seq] (-100 = ignored) and the count of scored tokens.

        Returns (loss_sum float32 scalar, num_tokens int64 scalar); the caller divides, after
        reducing both across ranks. Logits are formed chunk_size rows at a time, never in full.
        """
        hidden = self.hidden_states(tokens, positions, doc_boundaries, doc_sees, rope_length=rope_length)
        return chunked_cross_entropy(hidden.flatten(0, 1), self.output_weight, labels.flatten(), chunk_size)


    def answer_logps(self, tokens: torch.Tensor, labels: torch.Tensor, answers: torch.Tensor, num_answers: int,
                     positions: torch.Tensor | None = None, doc_boundaries: Sequence[torch.Tensor] | None = None,
                     doc_sees: Sequence[torch.Tensor] | None = None, chunk_size: int = 1024, *,
                     rope_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each answer's summed label log-probability and token count over this shard (models/preference.py):
        answers [batch, seq] beside labels, -1 where a label is no answer's; the rest as hidden_states takes it.
        Returns (logps float32 [num_answers], counts float32 [num_answers]); the caller sums both across ranks."""
        hidden = self.hidden_states(tokens, positions, doc_boundaries, doc_sees, rope_length=rope_length)
        return answer_logps(hidden, self.output_weight, labels, answers, num_answers, chunk_size)


def init_model(config: ModelConfig, seed: int = 0, device: torch.device | str = "cpu") -> Transformer:
    """A full model on `device` with `init_weights()` drawn from `seed`: built on meta, then materialised."""
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
