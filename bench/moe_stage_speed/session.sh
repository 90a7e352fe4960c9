# One device call: the carried wheels (.whl, see bench/README.md), then each method in its own process (peft, the
# stage at its defaults, then the stage with fit: speed on a card of 0.6x peft's peak if time is left), then the merge.
source bench/moe_stage_speed/_device.sh
run peft 170 peft
run stage 170 stage
if [ $((SECONDS - start)) -lt "${SPEED_BEFORE:-250}" ]; then
  run stage-speed 150 stage --set training.fit=speed --set preflight.gpu_memory_gib=44 --data longtail
fi
python3 bench/moe_stage_speed/run.py merge "$OUT/moe_stage_speed.json" "$OUT"/peft.json "$OUT"/stage.json "$OUT"/stage-speed.json
