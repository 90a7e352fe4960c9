#!/usr/bin/env bash
# One device call for issue 16 on one H200 (carry .whl: bitsandbytes, liger-kernel, pydantic + deps).
#   STEP_SAMPLES=400 bash bench/fsdp_session.sh      -> $OUT/fsdp_h200.json
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
python3 bench/fsdp_h200.py --out "$OUT/fsdp_h200.json" 2>&1 | tee "$OUT/fsdp_h200.log"
echo "fsdp: exit $? after $(( $(date +%s) - T0 )) s"
