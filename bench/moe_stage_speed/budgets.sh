# One device call: plain peft, then the train stage at its defaults over a range of packed micro-batch budgets
# (training.max_tokens_per_batch), each method in its own process; then the merge (ratios within this call only).
source bench/moe_stage_speed/_device.sh
run peft 170 peft
run stage-full 230 stage --data full --budgets 4096 8192 16384 32768
if [ $((SECONDS - start)) -lt 450 ]; then
  run stage-longtail 130 stage --data longtail --budgets 16384
fi
python3 bench/moe_stage_speed/run.py merge "$OUT/budgets.json" "$OUT"/peft.json "$OUT"/stage-full.json "$OUT"/stage-longtail.json
