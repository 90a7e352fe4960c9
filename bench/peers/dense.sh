# One device call: Unsloth, the train stage at its defaults (and, on the same model, with peft's own LoRA forward),
# peft + Liger and plain peft on one dense shape in QLoRA; then, time allowing, the stage at the old default fit: memory.
#   RUN=d1 SHAPE=llama-3.1-8b bash bench/peers/dense.sh     (carry .whl; about 9 minutes on an H100)
RUN=${RUN:-d1} SHAPE=${SHAPE:-llama-3.1-8b}
. bench/peers/_device.sh
DIR=/tmp/peers/$SHAPE
PYTHONPATH=/tmp/site:$PWD python3 bench/peers/run.py make --shape "$SHAPE" --dir "$DIR" >> "$OUT/log.txt" 2>&1
echo "made at $((SECONDS - start)) s"
tool unsloth 170 unsloth --shape "$SHAPE" --dir "$DIR" --data full longtail long
tool stage 190 stage --shape "$SHAPE" --dir "$DIR" --data full longtail long --profile full --variants fused-off
tool peft-liger 75 peft-liger --shape "$SHAPE" --dir "$DIR" --data full longtail
tool peft 75 peft --shape "$SHAPE" --dir "$DIR" --data full longtail
[ $((SECONDS - start)) -lt 490 ] && tool stage-fit-memory 80 stage --shape "$SHAPE" --dir "$DIR" --data full longtail --set training.fit=memory
finish
