# Ran at commit 36631b6, where the `bnb-syncs` variant (and stages/train/optimizer.py) existed; removed after it.
# One device call: where the steady step's host syncs come from (4 layers, under torch's sync debug mode), then the
# whole 30B at two packed budgets, bitsandbytes' own 8-bit optimizer step (a wait per parameter) against the
# product's (one wait per step) in one process, the 16,384-token step profiled after a first step.
source bench/moe_stage_speed/_device.sh
timeout 150 python3 bench/moe_stage_speed/run.py stage --shape qwen3-30b-a3b-4-layers --data full --budgets 16384 --steps 2 \
  --profile 16384 --stacks --name syncs-16384 --out "$OUT/syncs-16384.json" > "$OUT/syncs-16384.log" 2>&1
echo "syncs rc=$? at $((SECONDS - start)) s"
timeout $((560 - SECONDS + start)) python3 bench/moe_stage_speed/run.py stage --data full --budgets 4096 16384 \
  --variants stage bnb-syncs --profile 16384 --name stage-steady --out "$OUT/stage-steady.json" > "$OUT/stage-steady.log" 2>&1
echo "stage rc=$? at $((SECONDS - start)) s"
grep -E "^stage .*timed" "$OUT/stage-steady.log" | cut -c1-330
