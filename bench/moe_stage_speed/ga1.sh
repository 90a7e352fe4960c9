# One device call: a step of one micro-batch (the literal 2 x 2048 tokens per optimizer step, gradient
# accumulation 1), plain peft against the train stage at its defaults (nothing to widen: the step's samples fill one
# micro-batch), full rows, 6 steps each, each method in its own process; the merge's ratios are within this call.
source bench/moe_stage_speed/_device.sh
run peft-ga1 200 peft --data full --samples 2 --steps 6
run stage-ga1 240 stage --data full --samples 2 --steps 6
python3 bench/moe_stage_speed/run.py merge "$OUT/ga1.json" "$OUT"/peft-ga1.json "$OUT"/stage-ga1.json
