"""Every release in configs.py at full size, as a header-only checkpoint, through the preflight on this machine (CPU):
results.json lists each family with its source, the preflight's verdict and estimate, the stages it passed and the
message a user would see. The same check runs in the suite (tests/test_released_configs.py).

    python bench/released_configs/sweep.py --out bench/released_configs/results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

import configs  # noqa: E402


def one(name: str, work: Path) -> dict:
    import yaml

    from stages import preflight
    from stages.config import load_config

    source, values = configs.RELEASES[name]
    row = {"family": name, "model_type": values["model_type"], "source": source, "stages": []}
    model_dir, asset = configs.checkpoint(name, work / "model")
    base = yaml.safe_load((ROOT / "configs" / ("chatml.yaml" if asset == "tiny-chatml" else "default.yaml")).read_text())
    base["model"]["name_or_path"] = str(model_dir)
    base["preflight"] = {"gpu_memory_gib": 4096}
    for key in ("train_file", "eval_file"):
        base["data"][key] = str(ROOT / base["data"][key])
    (work / "config.yaml").write_text(yaml.safe_dump(base))
    t0 = time.perf_counter()
    try:
        r = preflight.run(load_config(work / "config.yaml"), work / "preflight", train_only=True)
        row |= {"preflight": "fits" if r.fits else "does not fit", "estimate_gib_cpu": round(r.estimate.total_gib, 2),
                "adapted": r.adapted, "result": "passed", "message": r.report_md.read_text().splitlines()[0][3:300]}
        row["stages"].append("preflight")
    except Exception as e:  # noqa: BLE001 - a refusal is the row's result
        row |= {"preflight": "refused", "result": "refused", "message": f"{type(e).__name__}: {str(e)[:600]}"}
    row["s"] = round(time.perf_counter() - t0, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    rows = []
    for name in a.only or configs.RELEASES:
        with tempfile.TemporaryDirectory() as work:
            rows.append(one(name, Path(work)))
            print(json.dumps(rows[-1])[:400], flush=True)
    Path(a.out).write_text(json.dumps({"note": "full-size header-only checkpoints through the preflight on a CPU (budget "
                                               "4096 GiB: the verdict is the model checks', the estimate the CPU run's)",
                                       "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
