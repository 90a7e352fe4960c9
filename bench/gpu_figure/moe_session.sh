# One device call (issue 34's GPU rows): the capped grid on the whole Qwen3-30B-A3B (M9, sparse checkpoint) and the
# dense Granite rows (G1, G2), beside the OOM recovery with every expert stack adapted on NF4 (Granite-MoE shapes).
# ROWS="M10 N3 N4" RECOVERY=0: GPT-OSS-20B and Gemma-2 on their own attention (flex_attention), no recovery run.
# ROWS="D1 D2 D3 D4" PARALLEL=2 RECOVERY=0 NAME=deepseek_pages MAX_SECONDS=400: DeepSeek-V2-Lite whole (issue 52).
set -u
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/base/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; df -h /tmp | tail -1
[ "${RECOVERY:-1}" = 1 ] && python3 bench/oom_recovery/oom_recovery.py --shape granitemoe-3b --targets all-linear --qlora --out "$OUT/oom_recovery_moe_nf4.json" \
  > "$OUT/oom_recovery.log" 2>&1 &
python3 bench/gpu_figure/capped_grid.py pages --rows ${ROWS:-M9 G1 G2} --parallel ${PARALLEL:-3} --max-seconds "${MAX_SECONDS:-470}" --work /tmp/cg \
  --out "$OUT/${NAME:-moe_pages_m9_g}.json" > "$OUT/capped.log" 2>&1
echo "capped rc=$? at $((SECONDS - start)) s"
wait
echo "all done at $((SECONDS - start)) s"
tail -5 "$OUT/oom_recovery.log"; grep -E "^(M[0-9]+|G[0-9]|N[0-9]) " /tmp/cg/*.log 2>/dev/null | cut -c1-300 | tail -12
cp /tmp/cg/*.log "$OUT/" 2>/dev/null; ls /tmp/cg
