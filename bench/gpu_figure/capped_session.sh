#!/usr/bin/env bash
# One device call (issue 21): the OOM-recovery bench beside the capped grid.
#   MODE=need ROWS="F1 F2 ..." SECS=390 bash bench/gpu_figure/capped_session.sh      (WHL: the carried wheels, default .whl)
#   MODE=spread ROWS="F18 F10" EXTRA="--from bench/gpu_figure/results/bracket_run3.json --repeats 3" bash bench/gpu_figure/capped_session.sh
set -uo pipefail
WHL=${WHL:-.whl/base}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "import torch, transformers, peft, bitsandbytes, liger_kernel, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'bnb', bitsandbytes.__version__, torch.cuda.get_device_name())"
mkdir -p /tmp/capped-grid
if [ "${OOM:-1}" = 1 ]; then
  python3 bench/oom_recovery/oom_recovery.py --out "$OUT/oom_recovery.json" > /tmp/capped-grid/oom_recovery.log 2>&1 &
fi
python3 bench/gpu_figure/capped_grid.py "${MODE:-need}" --rows ${ROWS:-all} --out "$OUT/${MODE:-need}.json" --parallel "${PARALLEL:-6}" --max-seconds "${SECS:-390}" ${EXTRA:-}
wait
tar -czf "$OUT/logs.tar.gz" -C /tmp/capped-grid --exclude models --exclude rows --exclude 'data-*' . 2>/dev/null
# what was live when a capped run ran out (torch.cuda.memory_summary in each OOM post-mortem): a few KB per row
(cd /tmp/capped-grid && find rows -name 'oom-postmortem-*.json' | tar -czf "$OUT/postmortems.tar.gz" -T -) 2>/dev/null
ls -la "$OUT"
