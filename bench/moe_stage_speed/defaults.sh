# One device call: plain peft, then the train stage at its defaults (and at 16,384-token packed micro-batches on
# full rows), each in its own process, the same samples; then the merge (ratios within this call only): the whole
# runs and their steady state (the steps after the first; the stage's run also ends with a checkpoint save).
source bench/moe_stage_speed/_device.sh
run peft 220 peft --data longtail full
run stage 300 stage --data longtail full --budgets 4096
if [ $((SECONDS - start)) -lt 420 ]; then
  run stage-16k 150 stage --data full --budgets 16384
fi
python3 bench/moe_stage_speed/run.py merge "$OUT/defaults.json" "$OUT"/peft.json "$OUT"/stage.json "$OUT"/stage-16k.json
