# One device call: where OLMoE-1B-7B's step at the product's defaults (8 x 1,024 full rows, one packed micro-batch)
# waits on the activation offload. Each run profiles one steady step with the compute stream's idle time put down to
# its cause (run.py streams()). RUNS picks among: default, none (offload off), plain (the stock loss, which keeps
# the tokens x vocab logits). The offload's lag2 / chunk4 / chunk1 variants in results/offload/ ran at commit b0c1e83.
source bench/moe_stage_speed/_device.sh
ARGS="stage --shape olmoe-1b-7b --data full --batch 8 --samples 8 --max-length 1024 --steps 4 --budgets 8192 --profile 8192"
declare -A V=([default]="" [none]="--set training.offload_activations=off" [plain]="--set training.cross_entropy=plain")
for v in ${RUNS:-default none plain}; do run "off-$v" 140 $ARGS ${V[$v]}; done
for v in ${RUNS:-default none plain}; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); r=d.get('result',{}); p=r.get('profile',{}); s=p.get('streams',{})
print(d['method'], {k: v.get('steady_samples_per_s') for k, v in r.get('runs',{}).items() if 'timed' in k}, p.get('wall_ms_per_step_profiled'),
      json.dumps({k: s.get(k) for k in ('compute_busy_ms', 'idle_ms_by_cause', 'side_copies')}), d.get('error','')[-300:])
[print(' ', g) for g in s.get('gaps_over_half_ms', [])[:12]]" "$OUT/off-$v.json"; done
