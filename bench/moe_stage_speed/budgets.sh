# One device call: plain peft, then the train stage at its defaults over a range of packed micro-batch budgets
# (training.max_tokens_per_batch), each method in its own process; then the merge (ratios within this call only).
set -u
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() {  # name, seconds, args...
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 bench/moe_stage_speed/run.py "$@" --name "$name" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at $((SECONDS - start)) s"; grep -E "^(peft|stage) " "$OUT/$name.log" | grep timed | cut -c1-400
}
run peft 170 peft
run stage-full 230 stage --data full --budgets 4096 8192 16384 32768
if [ $((SECONDS - start)) -lt 450 ]; then
  run stage-longtail 130 stage --data longtail --budgets 16384
fi
python3 bench/moe_stage_speed/run.py merge "$OUT/budgets.json" "$OUT"/peft.json "$OUT"/stage-full.json "$OUT"/stage-longtail.json
