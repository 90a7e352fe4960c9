#!/usr/bin/env bash
# One device call for issue 22's goals (bench/packing_goals.py); carry .whl (bitsandbytes, liger-kernel, pydantic + deps,
# datasets + dill + multiprocess, trl 1.16.0) and .gpu (a clean worktree of the commit).
#   MODE=qlora ROWS="stage baseline trl" bash bench/goals_session.sh
set -uo pipefail
WHL=${WHL:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, transformers, peft, bitsandbytes, liger_kernel, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'bnb', bitsandbytes.__version__, 'trl', trl.__version__, torch.cuda.get_device_name())"
T0=$(date +%s)
for mode in ${MODES:-qlora}; do
  # shellcheck disable=SC2086
  python3 bench/packing_goals.py --mode "$mode" --rows ${ROWS:-stage baseline trl} --out "$OUT/goals_${mode}${TAG:-}.json" \
    --row-timeout "${ROW_TIMEOUT:-240}" 2>&1 | tee -a "$OUT/goals${TAG:-}.log"
done
echo "goals: $(( $(date +%s) - T0 )) s"
