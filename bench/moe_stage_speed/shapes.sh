# One device call: plain peft and the train stage on other MoE shapes than the 30B (SHAPES, default OLMoE-1B-7B and
# GPT-OSS-20B), each method in its own process, the same samples, both data sets, at the product's own defaults
# (ARGS: micro-batch 8, gradient accumulation 1, data.max_length 1024: a step of 8 samples, one packed micro-batch of
# at most 8,192 tokens, nothing to widen); a merge per shape, ratios within this call only. METHODS narrows the methods (a
# second call finishing a shape); a run that would pass the call's LIMIT (585 s) is cut to what is left.
source bench/moe_stage_speed/_device.sh
left() { local s=$((${LIMIT:-585} - (SECONDS - start))); [ "$s" -lt "$1" ] && echo "$s" || echo "$1"; }
for shape in ${SHAPES:-olmoe-1b-7b gpt-oss-20b}; do
  for method in ${METHODS:-peft stage}; do
    secs=$(left 300)
    [ "$secs" -gt 60 ] && run "$method-$shape" "$secs" "$method" --shape "$shape" --data longtail full ${ARGS:---batch 8 --samples 8 --max-length 1024 --steps 4}
  done
  python3 bench/moe_stage_speed/run.py merge "$OUT/$shape.json" "$OUT/peft-$shape.json" "$OUT/stage-$shape.json"
done
