# One device call: on a MoE Liger has kernels for (its fused loss chunks 128 rows at Qwen3-30B-A3B's 2,048 x 151,936
# head), the project's chunked loss in the speed plan's wide chunks (stage-own-loss) against Liger's (stage, the
# defaults), beside Unsloth, full rows.
#   RUN=l2 SHAPE=qwen3-30b-a3b LAYERS=12 bash bench/peers/loss_liger.sh     (carry .whl; about 6 minutes on an H100)
RUN=${RUN:-l2} SHAPE=${SHAPE:-qwen3-30b-a3b} LAYERS=${LAYERS:-12}
. bench/peers/_device.sh
DIR=/tmp/peers/$SHAPE-$LAYERS
PYTHONPATH=/tmp/site:$PWD python3 bench/peers/run.py make --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" >> "$OUT/log.txt" 2>&1
echo "made at $((SECONDS - start)) s"
tool stage 120 stage --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full
tool stage-own-loss 120 stage --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full --loss own
tool unsloth 200 unsloth --shape "$SHAPE" --layers "$LAYERS" --dir "$DIR" --data full
finish
