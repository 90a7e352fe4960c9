# One device call: Unsloth, the train stage at its defaults and plain peft (target_parameters on the expert stacks) on
# one mixture of experts in QLoRA, attention and every routed expert adapted.
#   RUN=m1 SHAPE=qwen3-30b-a3b LAYERS=12 bash bench/peers/moe.sh     (carry .whl)
#   RUN=m2 SHAPE=qwen1.5-moe-a2.7b LAYERS=8 bash bench/peers/moe.sh  (the stage also profiled on full rows: where its step goes)
RUN=${RUN:-m1} SHAPE=${SHAPE:-qwen3-30b-a3b} LAYERS=${LAYERS:-12}
. bench/peers/_device.sh
DIR=/tmp/peers/$SHAPE-$LAYERS
PYTHONPATH=/tmp/site:$PWD python3 bench/peers/run.py make --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" >> "$OUT/log.txt" 2>&1
echo "made at $((SECONDS - start)) s"; df -h /tmp | tail -1
tool unsloth 250 unsloth --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full longtail
tool stage 150 stage --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full longtail --profile full
tool peft 90 peft --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full longtail
finish
