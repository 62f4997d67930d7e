#!/usr/bin/env bash
# One prepared check of the CUDA path on one GPU, a few minutes in all, ending in one summary:
#   1. pytest tests/test_cuda.py: every CUDA kernel against the math kernel on the ring's sliced inputs,
#      GQA and documents, and burst_attn on one GPU;
#   2. burst_attn against SDPA at 32K tokens (forward + backward time and TFLOPS of both);
#   3. a `tiny` training run at 32,768 tokens with --doc-mask (tokens/s and peak memory of its last step).
#
#   scripts/gpu_check.sh [RUN_DIR]          # RUN_DIR default: runs/gpu-check-DATE
#   SEQ_LEN=1024 DEVICE=cpu scripts/gpu_check.sh /tmp/x   # the same steps as a small CPU smoke run
#
# Exits non-zero when any part failed; the summary says which.
set -uo pipefail
cd "$(dirname "$0")/.."

RUN_DIR=${1:-runs/gpu-check-$(date +%Y%m%d-%H%M%S)}
SEQ_LEN=${SEQ_LEN:-32768}
DEVICE=${DEVICE:-cuda}
TRAIN_STEPS=${TRAIN_STEPS:-4}
if [ -e "$RUN_DIR" ]; then
    echo "error: $RUN_DIR exists; give a new run directory" >&2
    exit 2
fi
mkdir -p "$RUN_DIR"
status=0

python - <<'PY' | tee "$RUN_DIR/environment.txt"
import torch
from burst.kernels import installed_flash_attn_version
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {gpu}, flash-attn {installed_flash_attn_version()}")
PY

echo "== 1/3 pytest tests/test_cuda.py"
python -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$RUN_DIR/pytest.log"
pytest_status=${PIPESTATUS[0]}
[ "$pytest_status" -eq 0 ] || status=1

echo "== 2/3 burst_attn against SDPA at $SEQ_LEN tokens"
attention_args=(--device "$DEVICE" --seq-len "$SEQ_LEN")
[ "$DEVICE" = cpu ] && attention_args+=(--heads 4 --kv-heads 2 --head-dim 64 --iters 1)
python scripts/gpu_attention_check.py "${attention_args[@]}" | tee "$RUN_DIR/attention.json" || status=1

echo "== 3/3 tiny training at $SEQ_LEN tokens with --doc-mask"
burst train --model tiny --seq-len "$SEQ_LEN" --batch-size 1 --doc-mask --precision bf16 --steps "$TRAIN_STEPS" \
    --log-every 1 --out "$RUN_DIR/train" > "$RUN_DIR/train.log" 2>&1 || status=1

echo "== summary ($RUN_DIR)"
cat "$RUN_DIR/environment.txt"
echo "tests/test_cuda.py: $(tail -n 1 "$RUN_DIR/pytest.log")"
python - "$RUN_DIR" <<'PY'
import json
import sys
from pathlib import Path

run = Path(sys.argv[1])
try:
    a = json.loads((run / "attention.json").read_text())
    print(f"attention at {a['seq_len']} tokens ({a['heads']} heads, {a['kv_heads']} kv, dim {a['head_dim']}, causal, "
          f"bf16): burst_attn [{a['burst_kernel']}] {a['burst_attn']['fwd_bwd_ms']} ms fwd+bwd, "
          f"{a['burst_attn']['tflops']} TFLOPS; SDPA {a['sdpa']['fwd_bwd_ms']} ms, {a['sdpa']['tflops']} TFLOPS; "
          f"ratio {a['time_ratio_burst_over_sdpa']}; max |diff| {a['max_abs_difference']}")
except (OSError, ValueError, KeyError) as err:
    print(f"attention: no result ({err})")
try:
    last = json.loads((run / "train" / "metrics.jsonl").read_text().splitlines()[-1])
    print(f"tiny training, --doc-mask, step {last['step']}: {last['tokens_per_s']:,.0f} tokens/s, "
          f"step {last['step_time_s']:.2f} s, peak memory {last['peak_mem_mib']:,.0f} MiB, loss {last['loss']:.3f}")
except (OSError, ValueError, IndexError, KeyError) as err:
    print(f"training: no result ({err}); see {run / 'train.log'}")
PY
[ "$status" -eq 0 ] && echo "gpu_check: all parts ran" || echo "gpu_check: a part FAILED (see above)"
exit "$status"
