# One device call: Unsloth, the train stage at its defaults, peft + Liger and plain peft on one dense shape in QLoRA.
#   RUN=d1 SHAPE=llama-3.1-8b bash bench/peers/dense.sh     (carry .whl; about 8 minutes on an H100)
RUN=${RUN:-d1} SHAPE=${SHAPE:-llama-3.1-8b}
. bench/peers/_device.sh
DIR=/tmp/peers/$SHAPE
PYTHONPATH=/tmp/site:$PWD python3 bench/peers/run.py make --shape "$SHAPE" --dir "$DIR" >> "$OUT/log.txt" 2>&1
echo "made at $((SECONDS - start)) s"; df -h /tmp | tail -1
tool unsloth 200 unsloth --shape "$SHAPE" --dir "$DIR" --data full longtail long
tool stage 200 stage --shape "$SHAPE" --dir "$DIR" --data full longtail long --profile full
tool peft-liger 120 peft-liger --shape "$SHAPE" --dir "$DIR" --data full longtail
tool peft 120 peft --shape "$SHAPE" --dir "$DIR" --data full longtail
finish
