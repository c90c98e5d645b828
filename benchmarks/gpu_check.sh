#!/usr/bin/env bash
# The GPU check of issue 34, for a CUDA machine (CI stays on the CPU):
#   1. the tests marked `gpu` (device placement, bfloat16 checks, sampling and updates on
#      CUDA; they skip with the reason on a machine without CUDA);
#   2. SmolLM2-135M-Instruct on the calculator (configs/smollm2-calculator.yaml: its cold
#      start, then GRPO), a few iterations on CUDA in float32 and in bfloat16;
#   3. the table: rollout tokens/s, seconds per update, peak memory (process and device),
#      and each run's pre-step checks, the recorded-vs-recomputed log-prob ("ratio") check
#      among them, whose tolerance follows the dtype (docs/devices.md).
# Usage: bash benchmarks/gpu_check.sh [ITERATIONS]   (default 3; outputs under runs/gpu-check/)
# Exit status: 0 when every test and check passed; 1 otherwise; 2 without a CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
ITER="${1:-3}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: torch sees no CUDA device (torch.cuda.is_available() is False): run this on a CUDA machine" >&2
    exit 2
fi
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
status=0
echo "== 1. tests marked gpu"
"$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests || status=1
echo "== 2. SmolLM2 on the calculator, $ITER iterations, float32 and bfloat16, on CUDA"
for dtype in float32 bfloat16; do
    "$PY" -m consequence train --config configs/smollm2-calculator.yaml --device cuda --dtype "$dtype" \
        --iterations "$ITER" --final-eval-episodes 0 --eval-every 0 --run-dir "runs/gpu-check/$dtype" || status=1
done
echo "== 3. the table"
"$PY" benchmarks/gpu_report.py runs/gpu-check/float32 runs/gpu-check/bfloat16 || status=1
exit $status
