# Sourced by this folder's device-call scripts: the carried wheels (.whl, see bench/README.md), the environment, the
# card's name, and run NAME SECONDS ARGS... (one method in its own process, its timed rows printed).
set -u
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/base/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() {  # name, seconds, args...
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 bench/moe_stage_speed/run.py "$@" --name "$name" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at $((SECONDS - start)) s"; grep -E "^(peft|stage) " "$OUT/$name.log" | grep timed | cut -c1-400
}
