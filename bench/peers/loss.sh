# One device call: the project's chunked loss in chunks the plan sizes (stages/train/chunked_loss.py: wide where the
# plan has the card's room; stage-narrow-loss: the memory-first chunks whatever the plan, the loss before) and a layer
# of one output's backward as a broadcast product (stages/train/fused_lora.py), against Unsloth, on a MoE Liger has
# no kernels for (the stage's loss is its own there), and Llama's Liger kernels on the modules that compute Llama's maths
# (kernels.llama_modules; stage-stock-modules: without). The stage's full-row step profiled.
#   RUN=l1 SHAPE=qwen1.5-moe-a2.7b LAYERS=8 bash bench/peers/loss.sh     (carry .whl; about 5 minutes on an H100)
RUN=${RUN:-l1} SHAPE=${SHAPE:-qwen1.5-moe-a2.7b} LAYERS=${LAYERS:-8}
. bench/peers/_device.sh
DIR=/tmp/peers/$SHAPE-$LAYERS
PYTHONPATH=/tmp/site:$PWD python3 bench/peers/run.py make --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" >> "$OUT/log.txt" 2>&1
echo "made at $((SECONDS - start)) s"
PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -n0 -p no:cacheprovider tests/test_fused_lora.py -k "cuda or liger" 2>&1 | tail -2 | tee -a "$OUT/log.txt"
tool stage 120 stage --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full --profile full
tool stage-narrow-loss 90 stage --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full --loss narrow
tool stage-stock-modules 90 stage --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full --stock-modules
tool unsloth 200 unsloth --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full
# where time is left: on Qwen3-30B-A3B layers (Liger has its fused loss there, 128-row chunks), the project's loss in
# the speed plan's chunks against Liger's (stage-own-loss vs stage-liger-loss, the defaults)
if [ $((SECONDS - start)) -lt 360 ]; then
  D2=/tmp/peers/qwen3-30b-a3b-6
  PYTHONPATH=/tmp/site:$PWD python3 bench/peers/run.py make --shape qwen3-30b-a3b --layers 6 --dir "$D2" >> "$OUT/log.txt" 2>&1
  tool stage-liger-loss 80 stage --shape qwen3-30b-a3b --layers 6 --dir "$D2" --data full
  tool stage-own-loss 80 stage --shape qwen3-30b-a3b --layers 6 --dir "$D2" --data full --loss own
fi
finish
