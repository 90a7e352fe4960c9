# One device call: the project's own chunked loss (stages/train/chunked_loss.py) on OLMoE-1B-7B, a family Liger 0.8.5
# has no fused loss for, at the product's defaults (8 x 1,024 per step, one packed micro-batch): plain peft, the train
# stage at its defaults (now chunked-torch), the train stage with the stock loss (training.cross_entropy: plain, the
# default before), both data sets, each in its own process; then one profiled steady step of each stage loss on full
# rows (the compute stream's idle time by cause). Ratios within this call only.
source bench/moe_stage_speed/_device.sh
A="--shape olmoe-1b-7b --batch 8 --samples 8 --max-length 1024 --steps 4"
run peft-olmoe-1b-7b 150 peft $A --data longtail full
run stage-olmoe-1b-7b 150 stage $A --data longtail full
run stage-plain-olmoe-1b-7b 150 stage $A --data longtail full --set training.cross_entropy=plain
python3 bench/moe_stage_speed/run.py merge "$OUT/olmoe-1b-7b.json" "$OUT/peft-olmoe-1b-7b.json" "$OUT/stage-olmoe-1b-7b.json" \
  "$OUT/stage-plain-olmoe-1b-7b.json"
RUNS="${PROFILES:-default plain}" LIMIT=$((${LIMIT:-585} - (SECONDS - start))) bash bench/moe_stage_speed/offload.sh
