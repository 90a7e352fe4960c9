# One device call: the project's own chunked loss (stages/train/chunked_loss.py, the default since for families Liger
# has no fused loss for) timed on OLMoE-1B-7B (bench/moe_stage_speed/loss.sh), then the capped grid on the rows whose
# loss it now computes: M1 (OLMoE NF4 packed), M2 (OLMoE bf16 padded), G1 (Granite-3.3-2B NF4 packed; Liger refuses
# Granite's fused loss): each completes capped at its new figure and runs out at 0.95x it?
set -u
begin=$SECONDS
PROFILES=default bash bench/moe_stage_speed/loss.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
left=$((${LIMIT:-550} - (SECONDS - begin) - 20))
echo "capped grid with $left s"
PYTHONPATH=/tmp/site:$PWD python3 bench/gpu_figure/capped_grid.py pages --rows ${ROWS:-M1 M2 G1} --parallel 3 --max-seconds "$left" \
  --work /tmp/cg --out "$OUT/pages_chunked_loss.json" > "$OUT/capped.log" 2>&1
echo "capped rc=$? at $((SECONDS - begin)) s"; grep -E "^(M[0-9]+|G[0-9]) " /tmp/cg/*.log 2>/dev/null | cut -c1-300 | tail -8
tail -3 "$OUT/capped.log"
cp /tmp/cg/*.log "$OUT/" 2>/dev/null
(cd "$OUT" && tar czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz .)   # one file back: the call returns few
