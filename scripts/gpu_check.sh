#!/usr/bin/env bash
# The GPU check and benchmark in one command (a thin wrapper; see docs/benchmarks-gpu.md):
#   1. pytest tests/test_cuda.py: every CUDA kernel against the math kernel on the ring's sliced inputs,
#      GQA, documents and prefix sharing, and burst_attn on one GPU;
#   2. scripts/gpu_benchmark.py: kernels, burst_attn and llama3.2-1b training, one summary table.
#
#   scripts/gpu_check.sh [RUN_DIR]        # RUN_DIR default: runs/gpu-check-DATE
#   SMOKE=1 scripts/gpu_check.sh /tmp/x   # the same steps on the CPU at tiny sizes
#
# Needs pytest, which burst itself does not install: pip install -e ".[dev]" (or pip install pytest).
# Exits non-zero when any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! python -c "import pytest" 2>/dev/null; then
    echo "error: scripts/gpu_check.sh runs tests/test_cuda.py with pytest, which is not installed here: pip install -e \".[dev]\" (or pip install pytest)" >&2
    exit 2
fi

RUN_DIR=${1:-runs/gpu-check-$(date +%Y%m%d-%H%M%S)}
if [ -e "$RUN_DIR" ]; then
    echo "error: $RUN_DIR exists; give a new run directory" >&2
    exit 2
fi
mkdir -p "$RUN_DIR"
status=0

echo "== 1/2 pytest tests/test_cuda.py"
python -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$RUN_DIR/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 2/2 scripts/gpu_benchmark.py"
python scripts/gpu_benchmark.py --out "$RUN_DIR/benchmark" ${SMOKE:+--smoke} || status=1

echo "tests/test_cuda.py: $(tail -n 1 "$RUN_DIR/pytest.log")"
[ "$status" -eq 0 ] && echo "gpu_check: all parts ran" || echo "gpu_check: a part FAILED (see above)"
exit "$status"
