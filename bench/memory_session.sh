#!/usr/bin/env bash
# One device call for issue 12's GPU measurements (carry .whl: bitsandbytes, liger-kernel, pydantic + deps).
#   LEAK="qwen2.5-1.5b:lora mistral-7b:qlora" PTT="qwen2.5-1.5b:qlora" GRID="0 1 2 3" GRID_SECONDS=330 bash bench/memory_session.sh
# Leak check first (each case in a fresh process: 3 build/train/free cycles per mode; DIAGNOSE=1 records
# the first cycle's allocations), then the probe-then-train check (PTT cases), then the default-settings grid.
# (Not GROUPS: bash keeps the user's group ids in that name.)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
if [ -n "${LEAK:-}${PTT:-}" ]; then
  # shellcheck disable=SC2086
  timeout "${LEAK_SECONDS:-300}" python3 bench/leak_check.py --out "$OUT/leak_check.json" ${DIAGNOSE:+--diagnose} \
    --cases ${LEAK:-} --probe-then-train ${PTT:-} > "$OUT/leak.log" 2>&1
  echo "leak check: exit $? after $(( $(date +%s) - T0 )) s"; grep -E '^\{"(shape|check)' "$OUT/leak.log" | cut -c1-500
fi
if [ -n "${GRID:-}" ]; then
  # shellcheck disable=SC2086
  python3 bench/memory_grid.py --groups $GRID --out "$OUT/memory_grid.json" --max-seconds "${GRID_SECONDS:-300}" > "$OUT/grid.log" 2>&1
  echo "grid: exit $? after $(( $(date +%s) - T0 )) s"; grep -E '^\{"model|time limit|exited' "$OUT/grid.log" | cut -c1-200
fi
