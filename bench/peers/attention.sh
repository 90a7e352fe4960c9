# One device call: the attention of equal-length samples (full rows, one long sample) through cuDNN's fused attention
# (stages/train/attention.py `_causal_rows`; stage-varlen: the same rows through the varlen kernel) and the memory-first plan's 8-bit AdamW unpaged, against Unsloth.
#   RUN=a1 SHAPE=qwen3-8b bash bench/peers/attention.sh     (carry .whl; about 5 minutes on an H100)
RUN=${RUN:-a1} SHAPE=${SHAPE:-qwen3-8b}
. bench/peers/_device.sh
python3 bench/peers/attention_long.py --out "$OUT/attention_long.json" 2>&1 | grep -v Warning | grep -E "^(varlen|sdpa|agree)" >> "$OUT/log.txt"
python3 bench/peers/attention_long.py --tokens 4096 --out "$OUT/attention_4k.json" 2>&1 | grep -E "^(varlen|sdpa|agree)" >> "$OUT/log.txt"
grep -E "^(varlen|sdpa|agree)" "$OUT/log.txt"
DIR=/tmp/peers/$SHAPE
PYTHONPATH=/tmp/site:$PWD python3 bench/peers/run.py make --shape "$SHAPE" --dir "$DIR" >> "$OUT/log.txt" 2>&1
echo "made at $((SECONDS - start)) s"
tool stage 110 stage --shape "$SHAPE" --dir "$DIR" --data full long --steps 4
tool stage-varlen 110 stage --shape "$SHAPE" --dir "$DIR" --data full long --steps 4 --varlen-only
tool unsloth 140 unsloth --shape "$SHAPE" --dir "$DIR" --data full long --steps 4
tool stage-fit-memory 60 stage --shape "$SHAPE" --dir "$DIR" --data full --steps 4 --set training.fit=memory
[ $((SECONDS - start)) -lt 520 ] && tool stage-fit-memory-paged 60 stage --shape "$SHAPE" --dir "$DIR" --data full --steps 4 --set training.fit=memory --set training.optim=paged_adamw_8bit
finish
