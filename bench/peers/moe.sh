# One device call: Unsloth, the train stage at its defaults and plain peft (target_parameters on the expert stacks) on
# one mixture of experts in QLoRA, attention and every routed expert adapted.
#   RUN=m1 SHAPE=qwen3-30b-a3b LAYERS=12 bash bench/peers/moe.sh     (carry .whl)
RUN=${RUN:-m1} SHAPE=${SHAPE:-qwen3-30b-a3b} LAYERS=${LAYERS:-12}
. bench/peers/_device.sh
DIR=/tmp/peers/$SHAPE-$LAYERS
PYTHONPATH=/tmp/site:$PWD python3 bench/peers/run.py make --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" >> "$OUT/log.txt" 2>&1
echo "made at $((SECONDS - start)) s"; df -h /tmp | tail -1
tool unsloth 150 unsloth --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full longtail
tool stage 140 stage --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full longtail
tool peft 100 peft --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full longtail
finish
