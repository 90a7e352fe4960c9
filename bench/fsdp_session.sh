#!/usr/bin/env bash
# One device call for issue 16 on one H200 (carry .whl: bitsandbytes, liger-kernel, pydantic + deps).
#   STEP_SAMPLES=400 bash bench/fsdp_session.sh      -> $OUT/fsdp_h200.json
#   TAG=_run2 ROWS="single-lora fsdp-lora fsdp:8192" STEP_SAMPLES=400 bash bench/fsdp_session.sh   (out-of-sample check)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
# shellcheck disable=SC2086
python3 bench/fsdp_h200.py --out "$OUT/fsdp_h200${TAG:-}.json" ${ROWS:+--rows $ROWS} 2>&1 | tee "$OUT/fsdp_h200${TAG:-}.log"
echo "fsdp: exit $? after $(( $(date +%s) - T0 )) s"
