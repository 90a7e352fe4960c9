"""The preflight's data scan on a million short samples, and host memory at 10k vs 1M samples.

    .venv/bin/python bench/data_scan/data_scan.py --out bench/data_scan/results/data_scan.json [--sizes 10000 1000000]

For each size N: N short chat samples (the embedded translate task's form, JSON Lines) and the
embedded tiny model's tokenizer. Each measurement runs in a fresh process:

  cold    data.training_set: read, tokenize in data.num_proc processes (2 here), write the Arrow cache
  scan    preflight.scan_lengths on the same data: the cache hit the preflight and train stage see
  rows    the training set opened and every row read once (what a training epoch touches), peak RSS

Reported: wall seconds and the process's peak RSS (VmHWM) for each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORDS = "red green blue cat dog bird sun moon rain white black tree house water fire".split()


def make_data(path: Path, n: int) -> None:
    rng = random.Random(n)
    with path.open("w") as f:
        for _ in range(n):
            words = rng.choices(WORDS, k=rng.randint(2, 6))
            f.write(json.dumps({"prompt": "Translate to French: " + " ".join(words), "completion": " ".join(w[::-1] for w in words)}) + "\n")


def measure(kind: str, cfg_path: Path) -> dict:
    sys.path.insert(0, str(REPO))
    from stages import data, preflight
    from stages.config import load_config
    from stages.memory import peak_rss_gib
    from stages.model.load import load_tokenizer

    cfg = load_config(cfg_path)
    tok = load_tokenizer(cfg.model)
    t0 = time.perf_counter()
    if kind == "cold":
        got = data.training_set(cfg, tok)
        out = {"samples": len(got.lengths), "cached": got.cached}
    elif kind == "scan":
        scan = preflight.scan_lengths(cfg, tok)
        out = {"samples": scan.n_samples, "p50": scan.p50, "max": scan.max}
    else:
        got = data.training_set(cfg, tok)
        tokens = sum(len(r["input_ids"]) for r in got.rows)
        out = {"samples": len(got.lengths), "tokens": tokens, "cached": got.cached}
    return out | {"wall_s": round(time.perf_counter() - t0, 2), "peak_rss_gib": round(peak_rss_gib(), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", type=int, nargs="*", default=[10_000, 1_000_000])
    ap.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # internal: KIND CONFIG, in a fresh process
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure[0], Path(a.measure[1]))))
        return
    import yaml

    work = Path("/tmp/bench-data-scan")
    result = {"cpus": os.cpu_count(), "sizes": {}}
    for n in a.sizes:
        d = work / str(n)
        d.mkdir(parents=True, exist_ok=True)
        make_data(d / "train.jsonl", n)
        raw = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
        raw["model"]["name_or_path"] = str(REPO / raw["model"]["name_or_path"])
        raw["data"] = {"train_file": str(d / "train.jsonl"), "eval_file": str(REPO / raw["data"]["eval_file"]), "max_length": 64,
                       "num_proc": 2}
        raw["artifacts_dir"] = str(d / "artifacts")
        raw["handoff"]["dir"] = str(d / "handoff")
        (d / "config.yaml").write_text(yaml.safe_dump(raw))
        row = {"jsonl_mib": round((d / "train.jsonl").stat().st_size / 2**20, 1)}
        for kind in ("cold", "scan", "rows"):
            p = subprocess.run([sys.executable, __file__, "--out", "-", "--measure", kind, str(d / "config.yaml")],
                               capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
            row[kind] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-800:]}
            print(n, kind, row[kind], flush=True)
        result["sizes"][str(n)] = row
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
