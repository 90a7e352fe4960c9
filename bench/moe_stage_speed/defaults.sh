# One device call: plain peft, then the train stage at its defaults (and at 16,384-token packed micro-batches on
# full rows), each in its own process, the same samples; then the merge (ratios within this call only): the whole
# runs and their steady state (the steps after the first; the stage's run also ends with a checkpoint save).
set -u
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() {  # name, seconds, args...
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 bench/moe_stage_speed/run.py "$@" --name "$name" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at $((SECONDS - start)) s"; grep -E "^(peft|stage) " "$OUT/$name.log" | grep timed | cut -c1-300
}
run peft 220 peft --data longtail full
run stage 300 stage --data longtail full --budgets 4096
if [ $((SECONDS - start)) -lt 420 ]; then
  run stage-16k 150 stage --data full --budgets 16384
fi
python3 bench/moe_stage_speed/run.py merge "$OUT/defaults.json" "$OUT"/peft.json "$OUT"/stage.json "$OUT"/stage-16k.json
