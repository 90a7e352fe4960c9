#!/usr/bin/env bash
# One device call (issue 21, the need's spread): is the activation offload's record_stream the source?
#   OLD=../.gpu-old WHL=../.whl bash bench/gpu_figure/offload_session.sh   (OLD: a checkout with the record_stream offload)
# 1. the same step 6x, side stream delayed on every other one: allocator traces, page figures, gradients, both offloads
# 2. the fixed-release offload: the spread rows at the caps the record_stream offload split on, sharing the GPU (11 at once)
# 3. the record_stream offload alone on the GPU (one at a time): does F18 still split at 0.7546 without neighbours?
set -uo pipefail
WHL=${WHL:-.whl/base}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t0=$SECONDS
python3 bench/gpu_figure/offload_determinism.py --out "$OUT/offload_determinism.json" > "$OUT/offload_determinism.log" 2>&1
echo "determinism: $((SECONDS - t0)) s"; tail -3 "$OUT/offload_determinism.log"
python3 bench/gpu_figure/capped_grid.py spread --rows F18 --caps 0.7291 0.7418 0.7546 100 --repeats 3 --parallel 11 --work /tmp/cg-new \
  --out "$OUT/spread_fixed_f18.json" --max-seconds 150 2>&1 | tail -6
echo "fixed f18: $((SECONDS - t0)) s"
python3 bench/gpu_figure/capped_grid.py spread --rows H8 --caps 1.6859 1.7154 1.745 --repeats 3 --parallel 9 --work /tmp/cg-new \
  --out "$OUT/spread_fixed_h8.json" --max-seconds 150 2>&1 | tail -6
echo "fixed h8: $((SECONDS - t0)) s"
if [ -n "${OLD:-}" ]; then
  # OLD is a checkout from before bench/ was grouped by question: its grid is bench/capped_grid.py
  (cd "$OLD" && PYTHONPATH=/tmp/site:$PWD python3 bench/capped_grid.py spread --rows F18 --caps 0.7546 100 --repeats 3 --parallel 1 \
    --work /tmp/cg-old --out "$OUT/spread_record_stream_f18_alone.json" --max-seconds "${OLD_SECS:-170}" 2>&1 | tail -6)
  echo "old alone: $((SECONDS - t0)) s"
fi
# a call returns at most 8 files: the .json files hold every row of their .jsonl, and the logs go in one archive
rm -f "$OUT"/*.jsonl
mv "$OUT/offload_determinism.log" /tmp/cg-new/ 2>/dev/null
tar -czf "$OUT/logs.tar.gz" --exclude models --exclude rows --exclude 'data-*' -C /tmp cg-new $([ -d /tmp/cg-old ] && echo cg-old)
ls -la "$OUT"
