# One device call: plain peft and the train stage at its defaults on other MoE shapes than the 30B (SHAPES, default
# OLMoE-1B-7B and GPT-OSS-20B), each method in its own process, the same samples (steps of 16 samples, micro-batch 2,
# max_length 2048, both data sets); a merge per shape, ratios within this call only. METHODS narrows the methods (a
# second call finishing a shape); a run that would pass the call's 590 s is cut to what is left.
source bench/moe_stage_speed/_device.sh
left() { local s=$((585 - (SECONDS - start))); [ "$s" -lt "$1" ] && echo "$s" || echo "$1"; }
for shape in ${SHAPES:-olmoe-1b-7b gpt-oss-20b}; do
  for method in ${METHODS:-peft stage}; do
    secs=$(left 300)
    [ "$secs" -gt 60 ] && run "$method-$shape" "$secs" "$method" --shape "$shape" --data longtail full
  done
  python3 bench/moe_stage_speed/run.py merge "$OUT/$shape.json" "$OUT/peft-$shape.json" "$OUT/stage-$shape.json"
done
