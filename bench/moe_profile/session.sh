# One device call: bench/moe_profile/run.py with the carried wheels (.carry, see bench/README.md), each variant in a
# fresh process (FRESH=1, the default: in one process a variant timed after others ran up to 25% slower), then
# the G rows of bench/gpu_figure/capped_grid.py (ROWS, empty for none). VARIANTS / PROFILE / STEPS / SECS override.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mpl .carry/mplwhl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/.carry/site:/tmp/mpl:$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
files=()
for v in ${VARIANTS:-peft bf16 nf4}; do
  timeout "${SECS:-150}" python3 bench/moe_profile/run.py --out "$OUT/variant-$v.json" --steps "${STEPS:-6}" --variants "$v" \
    --profile ${PROFILE:-} > "$OUT/variant-$v.log" 2>&1
  echo "$v rc=$?"; grep "^$v {" "$OUT/variant-$v.log" | head -1
  files+=("$OUT/variant-$v.json")
done
python3 bench/moe_profile/run.py merge "$OUT/moe_profile.json" "${files[@]}"
if [ -n "${ROWS:-}" ]; then
  python3 bench/gpu_figure/capped_grid.py pages --rows $ROWS --out "$OUT/pages.json" --parallel "${PARALLEL:-2}" \
    --max-seconds "${ROW_SECS:-300}" > "$OUT/pages.log" 2>&1
  echo "pages rc=$?"; tail -5 "$OUT/pages.log"
fi
