# One device call: where OLMoE-1B-7B's step at the product's defaults (8 x 1,024 full rows, one packed micro-batch)
# waits on the activation offload. Each run profiles one steady step with the compute stream's idle time put down to
# its cause (run.py streams()). RUNS picks among: default, none (offload off), lag2 (two copies in flight, two
# tensors fetched ahead), chunk4 / chunk1 (copies cut into 4 / 1 MiB pieces).
source bench/moe_stage_speed/_device.sh
ARGS="stage --shape olmoe-1b-7b --data full --batch 8 --samples 8 --max-length 1024 --steps 4 --budgets 8192 --profile 8192"
declare -A V=([default]="" [none]="--set training.offload_activations=off" [lag2]="--offload-lag 2 --offload-prefetch 2"
              [chunk4]="--offload-chunk-mib 4" [chunk1]="--offload-chunk-mib 1" [chunk4lag2]="--offload-chunk-mib 4 --offload-lag 2 --offload-prefetch 2")
for v in ${RUNS:-default none lag2}; do run "off-$v" 140 $ARGS ${V[$v]}; done
for v in ${RUNS:-default none lag2}; do python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); r=d.get('result',{}); p=r.get('profile',{}); s=p.get('streams',{})
print(d['method'], {k: v.get('steady_samples_per_s') for k, v in r.get('runs',{}).items() if 'timed' in k}, p.get('wall_ms_per_step_profiled'),
      json.dumps({k: s.get(k) for k in ('compute_busy_ms', 'idle_ms_by_cause', 'side_copies')}), d.get('error','')[-300:])
[print(' ', g) for g in s.get('gaps_over_half_ms', [])[:12]]" "$OUT/off-$v.json"; done
