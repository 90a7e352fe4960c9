# One device call: where the memory-first plan (fit: memory) spends the time Unsloth does not, at Unsloth's memory.
# Llama-3.1-8B QLoRA, full rows: fit: memory profiled (and the host's waits on the GPU by stack); fit: memory without
# each of its parts in turn (the embedding offload, the 8-bit paged optimizer, the activation offload); fit: auto on
# a 12 GB card (speed with every layer checkpointed). Then Unsloth on full rows and the 32k row, and the stage's 32k row.
#   RUN=p1 bash bench/peers/memory_plan.sh     (carry .whl; about 9 minutes on an H100)
RUN=${RUN:-p1} SHAPE=${SHAPE:-llama-3.1-8b} CAP=${CAP:-12}
. bench/peers/_device.sh
DIR=/tmp/peers/$SHAPE
PYTHONPATH=/tmp/site:$PWD python3 bench/peers/run.py make --shape "$SHAPE" --dir "$DIR" >> "$OUT/log.txt" 2>&1
echo "made at $((SECONDS - start)) s"
M="--set training.fit=memory"
tool stage-fit-memory 100 stage --shape "$SHAPE" --dir "$DIR" --data full $M --profile full --syncs
tool stage-memory-emb-on 55 stage --shape "$SHAPE" --dir "$DIR" --data full $M --set training.offload_embeddings=off
tool stage-memory-fused-adamw 55 stage --shape "$SHAPE" --dir "$DIR" --data full $M --set training.optim=adamw_torch_fused
tool stage-memory-no-offload 55 stage --shape "$SHAPE" --dir "$DIR" --data full $M --set training.offload_activations=off
tool stage-capped 70 stage --shape "$SHAPE" --dir "$DIR" --data full longtail --set preflight.gpu_memory_gib=$CAP
tool unsloth 110 unsloth --shape "$SHAPE" --dir "$DIR" --data full long
tool stage 80 stage --shape "$SHAPE" --dir "$DIR" --data long
finish
