"""Cross-entropy over a large vocabulary without materialising the [tokens, vocab] logits.

At 131,072 tokens and a 128K vocabulary the float32 logits alone are ~63 GiB. Forward computes
logits `chunk_size` rows at a time and keeps only each row's logsumexp; backward recomputes each
chunk's logits to form softmax - onehot and the gradients of hidden and weight. Memory beyond
the inputs is O(chunk_size x vocab) plus the [vocab, dim] weight gradient.

The matmuls run in bf16 (or fp16) when hidden and weight both are, as under FSDP mixed precision
on CUDA; the log-sum-exp, softmax and weight gradient are always float32. Otherwise (float32
weights, also under CPU autocast) everything is float32.
"""

from __future__ import annotations

import torch


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """bf16/fp16 when hidden and weight share that dtype, else float32."""
    half = hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16)
    return hidden.dtype if half else torch.float32


def _chunk_logits(hidden_chunk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[chunk, dim] x [vocab, dim] (weight in the matmul dtype) -> float32 logits [chunk, vocab]."""
    return (hidden_chunk.to(weight.dtype) @ weight.t()).float()


def _logsumexp_and_target(hidden: torch.Tensor, weight_mm: torch.Tensor, safe_labels: torch.Tensor,
                          chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logsumexp of its logits and its label's logit, float32 [N] each, `chunk_size` rows at a time
    (weight in the matmul dtype); a row's cross-entropy is their difference."""
    logsumexp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [N]
    target = torch.empty_like(logsumexp)  # [N]
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        logits = _chunk_logits(hidden[rows], weight_mm)  # [chunk, vocab] float32
        logsumexp[rows] = torch.logsumexp(logits, dim=-1)
        target[rows] = logits.gather(1, safe_labels[rows, None]).squeeze(1)
    return logsumexp, target


class ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Autocast would run the matmuls in bf16 over float32 weights; the dtypes given decide here.
        with torch.autocast(hidden.device.type, enabled=False):
            weight_mm = weight.to(_matmul_dtype(hidden, weight))
            valid = labels != ignore_index  # [N]
            safe_labels = torch.where(valid, labels, 0)
            logsumexp, target = _logsumexp_and_target(hidden, weight_mm, safe_labels, chunk_size)  # [N] each
            loss_sum = ((logsumexp - target) * valid).sum()
        ctx.save_for_backward(hidden, weight, safe_labels, valid, logsumexp)
        ctx.chunk_size = chunk_size
        count = valid.sum()
        ctx.mark_non_differentiable(count)
        return loss_sum, count

    @staticmethod
    def backward(ctx, grad_loss_sum: torch.Tensor, _grad_count: torch.Tensor):
        return _backward(ctx, grad_loss_sum)


def _backward(ctx, grad_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
    """The gradients of hidden and weight for the rows' cross-entropies weighted by `grad_rows` (a scalar: the
    same for every row, as for their sum; or float32 [N], one per row)."""
    hidden, weight, safe_labels, valid, logsumexp = ctx.saved_tensors
    with torch.autocast(hidden.device.type, enabled=False):
        weight_mm = weight.to(_matmul_dtype(hidden, weight))
        grad_hidden = torch.empty_like(hidden)  # [N, dim]
        # A frozen head (LoRA: the embedding matrix of a tied model) gets no gradient: no [vocab, dim] buffer.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            hidden_mm = hidden[rows].to(weight_mm.dtype)
            # d(loss_sum)/d(logits) = softmax - onehot(label) on scored rows, 0 on ignored ones.
            grad_logits = _chunk_logits(hidden_mm, weight_mm)  # [chunk, vocab] float32
            grad_logits.sub_(logsumexp[rows, None]).exp_()
            grad_logits.scatter_add_(1, safe_labels[rows, None],
                                     torch.full_like(logsumexp[rows, None], -1.0))
            grad_logits.mul_((valid[rows] * (grad_rows if grad_rows.dim() == 0 else grad_rows[rows]))[:, None])
            grad_logits_mm = grad_logits.to(weight_mm.dtype)
            grad_hidden[rows] = grad_logits_mm @ weight_mm
            if grad_weight is None:
                continue
            if grad_logits_mm.dtype == torch.float32:
                grad_weight.addmm_(grad_logits_mm.t(), hidden_mm)  # in place: no [vocab, dim] temporary
            else:  # addmm_ cannot mix dtypes: a bf16 product per chunk, summed in float32
                grad_weight += grad_logits_mm.t() @ hidden_mm
    return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


class ChunkedTokenLosses(torch.autograd.Function):
    """Each row's cross-entropy, float32 [N] (0 where ignored), differentiable row by row."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                ignore_index: int) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            weight_mm = weight.to(_matmul_dtype(hidden, weight))
            valid = labels != ignore_index  # [N]
            safe_labels = torch.where(valid, labels, 0)
            logsumexp, target = _logsumexp_and_target(hidden, weight_mm, safe_labels, chunk_size)  # [N] each
        ctx.save_for_backward(hidden, weight, safe_labels, valid, logsumexp)
        ctx.chunk_size = chunk_size
        return (logsumexp - target) * valid

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        return _backward(ctx, grad_rows.float())


def chunked_token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024,
                         ignore_index: int = -100) -> torch.Tensor:
    """Each row's cross-entropy of logits = hidden @ weight.T, as chunked_cross_entropy computes their sum, with a
    gradient for any function of them (a preference objective's): hidden [N, dim], weight [vocab, dim], labels
    [N] -> float32 [N], 0 where ignored."""
    return ChunkedTokenLosses.apply(hidden, weight, labels, chunk_size, ignore_index)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024,
                          ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of logits = hidden @ weight.T, computed chunk by chunk (float32 softmax).

    hidden [N, dim], weight [vocab, dim], labels [N] int64 (ignore_index = not scored).
    Returns (loss_sum float32 scalar, count int64 scalar of scored rows); loss_sum / count is
    F.cross_entropy's mean.
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"chunked_cross_entropy expects hidden [N, dim], weight [vocab, dim], labels [N]; "
                         f"got {tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return ChunkedCrossEntropy.apply(hidden, weight, labels, chunk_size, ignore_index)


@torch.no_grad()
def token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024,
                 ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of each row, as chunked_cross_entropy computes it (evaluation's loss by position):
    hidden [N, dim], weight [vocab, dim], labels [N] -> float32 [N], 0 where ignored."""
    with torch.autocast(hidden.device.type, enabled=False):
        valid = labels != ignore_index
        logsumexp, target = _logsumexp_and_target(hidden, weight.float(), torch.where(valid, labels, 0), chunk_size)
    return (logsumexp - target) * valid
