"""burst_attn against PyTorch's SDPA on one device: forward + backward time, TFLOPS, and agreement.

    python scripts/gpu_attention_check.py                      # 32K tokens on the GPU (gpu_check.sh)
    python scripts/gpu_attention_check.py --device cpu --seq-len 512 --heads 4 --kv-heads 2 --head-dim 64

burst_attn runs as a world of one with the kernel `select_kernel` picks ("auto"), so it times the
library's own path: the zigzag plan's kernel calls, the float32 merge and the backward loop.
SDPA runs causal over K/V repeated to the query heads (outside the timing), restricted to its fused
backends (never the math one, which would build the [seq, seq] scores). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import burst
from burst.kernels import select_kernel

FUSED_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def causal_attention_flops(batch: int, seq_len: int, heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention (FlashAttention's count: backward = 2.5 x forward)."""
    forward = 4 * batch * seq_len * seq_len * heads * head_dim / 2
    return 3.5 * forward


def timed(run, device: torch.device, iters: int) -> float:
    """Mean seconds of run() over `iters` calls, after one warm-up call."""
    run()
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no GPU is visible; use --device cpu for a small smoke run")

    g = torch.Generator(device=device).manual_seed(0)
    shape = lambda heads: (1, args.seq_len, heads, args.head_dim)  # noqa: E731
    q, k, v, dout = (torch.randn(shape(h), device=device, generator=g, dtype=torch.bfloat16)
                     for h in (args.heads, args.kv_heads, args.kv_heads, args.heads))
    kernel = type(select_kernel(device, q.dtype, "auto", head_dim=args.head_dim)).__name__
    groups = args.heads // args.kv_heads
    # SDPA's layout [b, h, s, d], K/V heads repeated so every fused backend takes them.
    sdpa_q, sdpa_k, sdpa_v = (t.transpose(1, 2).repeat_interleave(r, dim=1).contiguous().requires_grad_()
                              for t, r in ((q, 1), (k, groups), (v, groups)))
    burst_q, burst_k, burst_v = (t.clone().requires_grad_() for t in (q, k, v))

    def run_burst():
        burst.burst_attn(burst_q, burst_k, burst_v, causal=True).backward(dout)

    def run_sdpa():
        with sdpa_kernel(FUSED_SDPA):
            F.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_v, is_causal=True).backward(dout.transpose(1, 2))

    results = {}
    for name, run, leaves in (("burst_attn", run_burst, (burst_q, burst_k, burst_v)),
                              ("sdpa", run_sdpa, (sdpa_q, sdpa_k, sdpa_v))):
        seconds = timed(run, device, args.iters)
        for t in leaves:
            t.grad = None
        results[name] = {"fwd_bwd_ms": round(seconds * 1e3, 2),
                         "tflops": round(causal_attention_flops(1, args.seq_len, args.heads, args.head_dim)
                                         / seconds / 1e12, 3)}

    # Agreement on one fresh call each: bf16 results of two fused kernels.
    out = burst.burst_attn(burst_q, burst_k, burst_v, causal=True)
    out.backward(dout)
    with sdpa_kernel(FUSED_SDPA):
        ref = F.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_v, is_causal=True)
    ref.backward(dout.transpose(1, 2))
    ref_dk = sdpa_k.grad.unflatten(1, (args.kv_heads, groups)).sum(2).transpose(1, 2)  # back to [b, s, kv_h, d]
    differences = {"out": (out - ref.transpose(1, 2)).abs().max().item(),
                   "dq": (burst_q.grad - sdpa_q.grad.transpose(1, 2)).abs().max().item(),
                   "dk": (burst_k.grad.float() - ref_dk.float()).abs().max().item()}
    print(json.dumps({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "seq_len": args.seq_len, "heads": args.heads, "kv_heads": args.kv_heads,
                      "head_dim": args.head_dim, "burst_kernel": kernel, **results,
                      "time_ratio_burst_over_sdpa": round(results["burst_attn"]["fwd_bwd_ms"]
                                                          / results["sdpa"]["fwd_bwd_ms"], 3),
                      "max_abs_difference": {n: round(d, 4) for n, d in differences.items()}}))


if __name__ == "__main__":
    main()
