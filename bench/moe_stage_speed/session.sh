# One device call: the carried wheels (.whl, see bench/README.md), then each method in its own process (peft, the
# stage at its defaults, then the stage with fit: speed on a card of 0.6x peft's peak if time is left), then the merge.
set -u
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() {  # name, seconds, args...
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 bench/moe_stage_speed/run.py "$@" --name "$name" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at $((SECONDS - start)) s"; grep -E "^(peft|stage) " "$OUT/$name.log" | grep timed
}
run peft 170 peft
run stage 170 stage
if [ $((SECONDS - start)) -lt "${SPEED_BEFORE:-250}" ]; then
  run stage-speed 150 stage --set training.fit=speed --set preflight.gpu_memory_gib=44 --data longtail
fi
python3 bench/moe_stage_speed/run.py merge "$OUT/moe_stage_speed.json" "$OUT"/peft.json "$OUT"/stage.json "$OUT"/stage-speed.json
