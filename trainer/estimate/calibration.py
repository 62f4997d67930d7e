"""The estimate's constants that cannot be derived from shapes, fitted to measurements this repo can repeat.

GPU (bf16 on CUDA, torch.cuda.max_memory_allocated and step times, one H200, issue 36): llama3.2-1b with a
4,096-token vocabulary, selective recomputation, 56,057 MiB at 131,072 tokens and 22,622 MiB at 32,768;
tiny without recomputation at 32,768 tokens, 8,099 MiB; steps of 11.8 s and 1.26 s with attention at
320 TFLOP/s. The two 1B points are linear in the tokens with a slope that is the selective layers' kept
bytes (fp32 block input + bf16 attention output) plus one recomputed block: what fixes BLOCK_BYTES_PER_VALUE
on CUDA; tiny's point then checks it (8,099 measured). The terms only the CPU grid can separate (a block's
gradients in flight, memory-bound work, the softmax per score, ring hand-offs) are folded into these on CUDA.

CPU (fp32, peak resident set size of the largest rank): `python benchmarks/plan_calibration.py` runs the grid
(34 configurations: debug and tiny, 1K-128K tokens, cp 1-4, dp 1-2, every recomputation mode, packed documents and
preference pairs with the prompt shared; about 12 minutes on 2 idle cores), rewrites benchmarks/plan_calibration.json,
fits these constants on its even rows (each row, and the slope between rows that differ only in length) and reports
the odd ones (`--report`: from the stored table, running nothing); tests/test_plan.py checks that the constants here
are that fit. The allocator's share is fixed at 10% and what lies outside the blocks at 0 (not separable on these
presets); the matmul and attention-product rates are the measured matmul rate (not fitted); docs/plan.md has the
table. bf16 on CPU ("cpu-bf16"): its own 16-row grid on this CPU's native bf16 (AMX), fitted the same way, with
gloo's hand-off taken from fp32.
"""

from __future__ import annotations


def key(device: str, precision: str) -> str:
    """The entry of the tables below that a run takes: its device's, and on CPU in bf16 the bf16 grid's own (autocast
    on CPU changes what is kept and how fast each part runs)."""
    return "cpu-bf16" if device == "cpu" and precision == "bf16" else device


# Bytes one token keeps per value of a block's `block_width` (models/footprint.py) when the block is not
# recomputed: the saved inputs of its matmuls, norms, rotary embedding and SwiGLU, in their dtypes.
BLOCK_BYTES_PER_VALUE = {"cuda": 4.66, "cpu": 4.161, "cpu-bf16": 3.12}
# Bytes one token holds per value of `block_width` in the block backward is in, beyond its saved tensors: the
# gradients in flight through it (CPU; on CUDA folded into BLOCK_BYTES_PER_VALUE by the two-point fit).
BACKWARD_BYTES_PER_VALUE = {"cuda": 0.0, "cpu": 0.316, "cpu-bf16": 1.44}
# Bytes one token holds per value of `block_width` beyond that when the whole block is recomputed (full): on CPU the
# fit finds the recomputed block holding more than its saved tensors and their gradients; no CUDA measurement.
FULL_RECOMPUTE_BYTES_PER_VALUE = {"cuda": 0.0, "cpu": 6.393, "cpu-bf16": 4.151}
# Values of the compute dtype per dim each layer keeps beyond its input under selective recomputation: attention's
# output on CUDA; on CPU the fit finds about seven (the output and more that the CPU path's recomputation keeps).
SELECTIVE_VALUES_PER_DIM = {"cuda": 1.0, "cpu": 7.257, "cpu-bf16": 3.854}
# Bytes per token per dim kept outside the blocks (embedding output, final norm, the loss's hidden rows).
OUTER_BYTES_PER_DIM = {"cuda": 10.0, "cpu": 0.0, "cpu-bf16": 0.0}
# Fraction of the dense matmul peak the model's matmuls reach (bf16 on CUDA; on CPU, of the measured rate).
MATMUL_EFFICIENCY = {"cuda": 0.5, "cpu": 1.0, "cpu-bf16": 1.0}
# Attention's products (QK^T and PV) against the attention rate: on CUDA the measured kernel rate, on CPU the
# measured matmul rate (PyTorch's flash kernel for CPU).
ATTENTION_FRACTION = {"cuda": 1.0, "cpu": 1.0, "cpu-bf16": 1.0}
# Seconds per value of a block's width per token per pass of its memory-bound work (norms, rotary, SwiGLU, adds),
# on one rank with the machine to itself. On CUDA it is folded into MATMUL_EFFICIENCY (two step times fix both).
ELEMENTWISE_S_PER_VALUE = {"cuda": 0.0, "cpu": 2.03e-09, "cpu-bf16": 8.94e-10}
# Seconds per attention score (query, key, head) per pass for the softmax's exp, max and sum, beside the FLOPs of
# QK^T and PV (on CPU it is most of attention at head dims 16-64); on CUDA inside the measured attention rate.
ATTENTION_SCORE_S = {"cuda": 0.0, "cpu": 2.73e-10, "cpu-bf16": 5.95e-10}
# Seconds of one ring step's hand-off (gloo's send/receive pair on CPU, where the ranks share the cores).
RING_STEP_S = {"cuda": 0.0, "cpu": 0.00767, "cpu-bf16": 0.00767}
# What the process holds beyond its tensors: the CUDA context (not in max_memory_allocated), or a CPU rank's
# Python, torch and libraries (peak RSS before the first tensor, measured ~350 MiB).
PROCESS_BYTES = {"cuda": 600 * 2**20, "cpu": 387973120, "cpu-bf16": 407896064}
# The caching allocator's reserve beyond what is allocated (CUDA), or malloc's on CPU.
ALLOCATOR_OVERHEAD = {"cuda": 0.06, "cpu": 0.10, "cpu-bf16": 0.10}
# Seconds of fixed work per step outside the model (data, logging, Python): measured on each device.
STEP_OVERHEAD_S = {"cuda": 0.05, "cpu": 0.029, "cpu-bf16": 0.0717}
