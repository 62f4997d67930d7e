"""Kernel-only seconds per rank: the floor under any ring implementation that uses PyTorch's CPU kernels.

Times, on one process and one thread, exactly the local kernel calls (forward + backward) that
each rank makes in a causal zigzag ring of `--world` ranks, with no communication or merging:

    burst   one call per visible zigzag chunk pair (`burst.plan.block_segments`), heads-first memory
    peer    zhuzilin's ring-flash-attention calls: one causal call over the local shard, then per
            other step q x first-half kv (step <= rank) or second-half q x kv, sequence-major memory

Thread CPU time, minimum over --reps, so a shared machine's noise mostly drops out. The ratio of
the two floors is what the side-by-side benchmark (../shared/bench) can reach at best.

    OMP_NUM_THREADS=1 python benchmarks/kernel_floor.py --seq 16384 --world 2
"""

from __future__ import annotations

import argparse
import time

import torch

from burst.kernels import TorchCPUKernel
from burst.layout import zigzag_layout
from burst.operator import heads_first
from burst.plan import block_segments

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def timed(fn, *args, **kwargs):
    start = time.thread_time()
    result = fn(*args, **kwargs)
    return result, time.thread_time() - start


def burst_calls(rank: int, world: int, shard: int, q, k, v, dout, scale: float) -> float:
    """Seconds of this rank's kernel calls in burst; q, k, v, dout [1, shard, heads, dim] heads-first."""
    kernel, seconds, layout = TorchCPUKernel(), 0.0, zigzag_layout(shard * world, world)
    for owner in range(world):
        for seg in block_segments(layout, rank, owner, causal=True):
            args = (q[:, seg.q_rows], k[:, seg.kv_rows], v[:, seg.kv_rows])
            (out, lse), forward_s = timed(kernel.forward, *args, seg.causal, scale)
            _, backward_s = timed(kernel.backward, dout[:, seg.q_rows], *args, out, lse, seg.causal, scale)
            seconds += forward_s + backward_s
    return seconds


def peer_calls(rank: int, world: int, shard: int, q, k, v, dout, scale: float) -> float:
    """Seconds of this rank's kernel calls in the peer; q, k, v, dout [1, heads, shard, dim] views of
    sequence-major memory, the layout its flash-attn interface hands to the CPU ops."""
    half = shard // 2
    calls = [(q, k, v, dout, True)]
    for step in range(1, world):
        calls.append((q, k[:, :, :half], v[:, :, :half], dout, False) if step <= rank
                     else (q[:, :, half:], k, v, dout[:, :, half:], False))
    seconds = 0.0
    for cq, ck, cv, cdout, causal in calls:
        (out, lse), forward_s = timed(FORWARD, cq, ck, cv, 0.0, causal, scale=scale)
        _, backward_s = timed(BACKWARD, cdout, cq, ck, cv, out, lse, 0.0, causal, scale=scale)
        seconds += forward_s + backward_s
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=16384, help="global sequence length")
    parser.add_argument("--world", type=int, default=2, help="ranks in the ring")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.seq % (2 * args.world):
        parser.error(f"--seq {args.seq} must be a multiple of 2 x --world = {2 * args.world}")
    shard, scale = args.seq // args.world, args.dim ** -0.5
    torch.manual_seed(0)
    sequence_major = [torch.randn(1, shard, args.heads, args.dim, dtype=torch.bfloat16) for _ in range(4)]
    burst_inputs = [heads_first(t) for t in sequence_major]  # [1, shard, h, d] seen, [1, h, shard, d] stored
    peer_inputs = [t.transpose(1, 2) for t in sequence_major]  # [1, h, shard, d] views
    for rank in range(args.world):
        ours = min(burst_calls(rank, args.world, shard, *burst_inputs, scale) for _ in range(args.reps))
        theirs = min(peer_calls(rank, args.world, shard, *peer_inputs, scale) for _ in range(args.reps))
        print(f"rank {rank}: burst {ours:.3f} s, peer {theirs:.3f} s, ratio {ours / theirs:.3f}")


if __name__ == "__main__":
    main()
