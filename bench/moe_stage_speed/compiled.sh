# One device call: the train stage at its defaults (the experts' routed math compiled, training.fused_kernels) and
# with it eager, at two packed micro-batch budgets on full rows; the same with the 8-bit AdamW unpaged, one step
# profiled; then plain peft on the same rows; then the merge (ratios within this call only).
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
run stage-full 260 stage --data full --budgets 4096 16384 --variants compiled eager
run stage-unpaged 190 stage --data full --budgets 4096 16384 --set training.optim=adamw_8bit --profile 16384
run peft $((575 - (SECONDS - start))) peft --data full
python3 bench/moe_stage_speed/run.py merge "$OUT/compiled.json" "$OUT"/peft.json "$OUT"/stage-full.json "$OUT"/stage-unpaged.json
