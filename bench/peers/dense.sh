# One device call: Unsloth, the train stage at its defaults (profiled, with the stacks of its host syncs),
# peft + Liger and plain peft on one dense shape in QLoRA; then, time allowing, the stage at the old default fit: memory.
#   RUN=d2 SHAPE=qwen3-8b bash bench/peers/dense.sh     (carry .whl; about 9 minutes on an H100)
#   (d1, Llama-3.1-8B, ran with VARIANTS="--variants fused-off": the stage's rows again with peft's LoRA forward)
RUN=${RUN:-d1} SHAPE=${SHAPE:-llama-3.1-8b} VARIANTS=${VARIANTS:-}
. bench/peers/_device.sh
DIR=/tmp/peers/$SHAPE
PYTHONPATH=/tmp/site:$PWD python3 bench/peers/run.py make --shape "$SHAPE" --dir "$DIR" >> "$OUT/log.txt" 2>&1
echo "made at $((SECONDS - start)) s"
tool unsloth 170 unsloth --shape "$SHAPE" --dir "$DIR" --data full longtail long
tool stage 170 stage --shape "$SHAPE" --dir "$DIR" --data full longtail long --profile full --syncs $VARIANTS
tool peft-liger 75 peft-liger --shape "$SHAPE" --dir "$DIR" --data full longtail
tool peft 75 peft --shape "$SHAPE" --dir "$DIR" --data full longtail
[ $((SECONDS - start)) -lt 480 ] && tool stage-fit-memory 90 stage --shape "$SHAPE" --dir "$DIR" --data full longtail --set training.fit=memory --profile full --syncs
finish
