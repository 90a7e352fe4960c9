# One device call: plain peft, then the train stage at its defaults (the packed budget this card widens the config's
# 2 x 2048 to, stages/train/widen.py) and at the config's own 4,096-token budget on full rows, each in its own process,
# the same samples; then the merge (ratios within this call only): the whole runs and their steady state (the steps
# after the first; the stage's run also ends with a checkpoint save).
source bench/moe_stage_speed/_device.sh
run peft 220 peft --data longtail full
run stage 300 stage --data longtail full
if [ "${OLD_DEFAULT:-1}" = 1 ] && [ $((SECONDS - start)) -lt 420 ]; then
  run stage-4096 150 stage --data full --budgets 4096
fi
python3 bench/moe_stage_speed/run.py merge "$OUT/defaults.json" "$OUT"/peft.json "$OUT"/stage.json "$OUT"/stage-4096.json
