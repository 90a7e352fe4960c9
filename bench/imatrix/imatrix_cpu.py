"""Plain vs importance-matrix GGUFs of a trained model, and what the imatrix costs the export (issue 24; CPU).

    python bench/imatrix/imatrix_cpu.py --config configs/default.yaml --merged artifacts/runs/<id>/merge/model \
        --out bench/imatrix/results/tiny_llama_default.json

Runs the export stage twice on the same merged model: `export.imatrix: off` (plain quantization) and `auto` (the
importance matrix from the run's training samples, both files per type measured, the better kept). Reports, per
type, the mean KL to the merged model and the top-1 agreement on the held-out texts of both files (same type,
same tensor types, so the same size to within the block scales), and the export's wall time both ways.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--merged", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/imatrix-bench"))
    a = ap.parse_args()
    import shutil

    import torch

    from stages import export
    from stages.config import load_config

    torch.set_num_threads(1)
    shutil.rmtree(a.work, ignore_errors=True)
    runs = {}
    for mode in ("off", "auto"):
        cfg = load_config(a.config, [f"export.imatrix={mode}"])
        t0 = time.perf_counter()
        ex = export.run(cfg, a.merged, a.work / mode)
        runs[mode] = {"seconds": round(time.perf_counter() - t0, 2), "steps": ex.seconds, "imatrix": ex.imatrix,
                      "fidelity": [vars(f) for f in ex.fidelity], "files": [{"quant": f.quant, "size_mib": f.size_mib, "imatrix": f.imatrix}
                                                                             for f in ex.files]}
    choices = runs["auto"]["imatrix"]["choices"]
    table = {q: {"plain_mean_kl": c["plain"]["mean_kl"], "imatrix_mean_kl": c["imatrix"]["mean_kl"],
                 "kl_ratio": round(c["imatrix"]["mean_kl"] / c["plain"]["mean_kl"], 3) if c["plain"]["mean_kl"] else None,
                 "plain_top1": c["plain"]["top1_agreement"], "imatrix_top1": c["imatrix"]["top1_agreement"],
                 "plain_size_mib": c["plain"]["size_mib"], "imatrix_size_mib": c["imatrix"]["size_mib"], "kept": c["kept"]}
             for q, c in choices.items()}
    result = {"merged": str(a.merged), "config": str(a.config), "table": table,
              "export_seconds": {"off": runs["off"]["seconds"], "auto": runs["auto"]["seconds"],
                                 "ratio": round(runs["auto"]["seconds"] / runs["off"]["seconds"], 3)},
              "imatrix": {k: v for k, v in runs["auto"]["imatrix"].items() if k != "choices"}, "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({"table": table, "export_seconds": result["export_seconds"]}, indent=1))


if __name__ == "__main__":
    main()
