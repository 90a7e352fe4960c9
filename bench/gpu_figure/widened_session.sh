# One device call for the widened default packed budget (stages/train/widen.py): the speed at the defaults against
# plain peft (bench/moe_stage_speed/defaults.sh), then the capped grid on two rows whose step holds 16 samples (M11:
# Qwen3-30B-A3B's layers, 12 of 48; M12: the whole model), where the card widens the 4,096-token default to 16,384:
# the figure must hold at the width the card chose (complete at it, run out at 0.95x), in the time the call has left.
export OLD_DEFAULT=0
source bench/moe_stage_speed/defaults.sh
left=$((570 - SECONDS))
echo "capped grid with ${left} s left"
python3 bench/gpu_figure/capped_grid.py pages --rows ${ROWS:-M11 M12} --parallel 2 --max-seconds "$left" --work /tmp/cg \
  --out "$OUT/pages_widened.json" > "$OUT/capped.log" 2>&1
echo "capped rc=$? at $SECONDS s"
grep -E "^(M[0-9]+) " /tmp/cg/*.log 2>/dev/null | cut -c1-400 | tail -6
cp /tmp/cg/*.log "$OUT/" 2>/dev/null
