"""The estimate's constants that cannot be derived from shapes, fitted to measurements this repo can repeat.

GPU (bf16 on CUDA, torch.cuda.max_memory_allocated and step times, one H200, issue 36): llama3.2-1b with a
4,096-token vocabulary, selective recomputation, 56,057 MiB at 131,072 tokens and 22,622 MiB at 32,768;
tiny without recomputation at 32,768 tokens, 8,099 MiB; steps of 11.8 s and 1.26 s with attention at
320 TFLOP/s. The two 1B points are linear in the tokens with a slope that is the selective layers' kept
bytes (fp32 block input + bf16 attention output) plus one recomputed block: what fixes BLOCK_BYTES_PER_VALUE
on CUDA; tiny's point then checks it (8,099 measured).

CPU (fp32, peak resident set size of each rank): `python benchmarks/plan_calibration.py` runs the grid (16
configurations, about 3 minutes on 2 idle cores), rewrites benchmarks/plan_calibration.json, fits these constants on
its even rows and reports the odd ones (`--report`: from the stored table, running nothing); tests/test_plan.py
checks that the constants here are that fit. What a block keeps per value on CPU comes from tiny at 8K and 16K
tokens (28.3 KB a token a block), the allocator's share is fixed at 10%; the time constants are fitted weighted by
1 / the measured time (relative error), with a machine's ranks sharing its cores (docs/plan.md has the table).
"""

from __future__ import annotations

# Bytes one token keeps per value of a block's `block_width` (models/footprint.py) when the block is not
# recomputed: the saved inputs of its matmuls, norms, rotary embedding and SwiGLU, in their dtypes.
BLOCK_BYTES_PER_VALUE = {"cuda": 4.66, "cpu": 2.126}
# Bytes per token per dim kept outside the blocks (embedding output, final norm, the loss's hidden rows).
OUTER_BYTES_PER_DIM = {"cuda": 10.0, "cpu": 0.0}
# Fraction of the dense matmul peak the model's matmuls reach (bf16 on CUDA; on CPU, of the measured rate).
MATMUL_EFFICIENCY = {"cuda": 0.5, "cpu": 0.559}
# CPU attention kernel rate against the measured matmul rate (PyTorch's flash kernel for CPU).
CPU_ATTENTION_FRACTION = 0.219
# What the process holds beyond its tensors: the CUDA context (not in max_memory_allocated), or a CPU rank's
# Python, torch and libraries (peak RSS before the first tensor, measured ~350 MiB).
PROCESS_BYTES = {"cuda": 600 * 2**20, "cpu": 433061888}
# The caching allocator's reserve beyond what is allocated (CUDA), or malloc's on CPU.
ALLOCATOR_OVERHEAD = {"cuda": 0.06, "cpu": 0.10}
# Seconds of fixed work per step outside the model (data, logging, Python): measured on each device.
STEP_OVERHEAD_S = {"cuda": 0.05, "cpu": 0.059}
