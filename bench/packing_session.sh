#!/usr/bin/env bash
# One device call for issue 13's packing measurement (carry .whl: bitsandbytes, liger-kernel, pydantic + deps).
#   MODE=qlora ROWS="baseline padded packed:varlen" bash bench/packing_session.sh
# Rows run one after the other, each in its own process (bench/packing_r7.py); STEP_SAMPLES=N for fewer samples.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
# shellcheck disable=SC2086
python3 bench/packing_r7.py --mode "${MODE:-qlora}" --rows ${ROWS:-baseline padded packed:varlen} \
  --out "$OUT/packing_r7_${MODE:-qlora}${TAG:-}.json" --row-timeout "${ROW_TIMEOUT:-240}" 2>&1 | tee "$OUT/packing_${MODE:-qlora}${TAG:-}.log"
echo "packing: exit $? after $(( $(date +%s) - T0 )) s"
