"""Is peak reserved what a run needs? The probe under a cap just above and just below the peak allocated.

    python3 bench/gpu_figure/cap_check.py --out $OUT/cap_check.json

With `expandable_segments:True` the caching allocator can unmap the free pages inside its
segment and map them again where a request needs them, so reserved - allocated (up to 21% on
the grid's rows, uncapped) should be reclaimable when a cap is reached. For grid rows with the
largest such overhead: the probe (two optimizer steps on the worst micro-batch, as preflight
runs it) with the process capped at 1.03 x and 0.97 x the uncapped run's peak allocated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "gpu_figure"))

# (shape, quant, seq, micro-batch, uncapped peak allocated GiB, uncapped peak reserved GiB) from memory_grid_raw_run*.jsonl
ROWS = [
    ("smollm2-360m", "bf16", 16384, 1, 1.464, 1.838),
    ("qwen2.5-1.5b", "bf16", 4096, 4, 4.766, 5.340),
    ("mistral-7b", "nf4", 16384, 1, 7.383, 8.451),
]
FACTORS = (1.03, 0.97)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    from memory_grid import run_config
    from random_checkpoints import make_checkpoint

    from stages import memory, preflight
    from stages.train import model as lora_model

    out = []
    for shape, quant, seq, mb, alloc, reserved in ROWS:
        model_dir = make_checkpoint(shape, Path("/tmp/bench-models"))
        cfg = run_config(model_dir, quant, 64, ["q_proj", "v_proj", "o_proj"], seq, mb)
        model = lora_model.build_model(cfg)
        for f in FACTORS:
            t0 = time.perf_counter()
            p = preflight.probe(cfg, seq, alloc * f, Path("/tmp/cap-probe"), model=model)
            row = {"shape": shape, "quant": quant, "seq": seq, "micro_batch": mb, "uncapped_alloc_gib": alloc,
                   "uncapped_reserved_gib": reserved, "cap_gib": round(alloc * f, 3), "cap_over_alloc": f, "ok": p.ok,
                   "peak_reserved_gib": p.peak_reserved_gib, "peak_alloc_gib": p.peak_alloc_gib, "error": p.error,
                   "seconds": round(time.perf_counter() - t0, 1)}
            print(json.dumps(row), flush=True)
            out.append(row)
            a.out.write_text(json.dumps(out, indent=1))
        del model
        memory.free_gpu()


if __name__ == "__main__":
    main()
