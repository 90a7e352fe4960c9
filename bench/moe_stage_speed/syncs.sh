# One device call: where the step's host syncs come from. The stage's profiled step on Qwen3-30B-A3B shapes cut to
# 4 layers, under torch.cuda.set_sync_debug_mode("warn"), at two packed budgets, each in its own process.
set -u
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for budget in ${BUDGETS:-16384 4096}; do
  timeout 200 python3 bench/moe_stage_speed/run.py stage --shape qwen3-30b-a3b-4-layers --data full --budgets "$budget" \
    --steps 1 --profile "$budget" --stacks --name "syncs-$budget" --out "$OUT/syncs-$budget.json" > "$OUT/syncs-$budget.log" 2>&1
  echo "syncs-$budget rc=$? at $((SECONDS - start)) s"
done
