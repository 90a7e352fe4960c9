"""Fit the preflight estimate's coefficients (stages.preflight.COEF) to the GPU grid.

    python bench/fit_preflight.py                      # fit on every row, print COEF and errors
    python bench/fit_preflight.py --train-on qwen2-7b  # fit on one shape, report the other held out

Reads bench/results/preflight_grid_raw_*.json (bench/preflight_grid.py on an H200). The
model being fitted is stages.preflight.estimate itself, called with candidate
coefficients, so the formula has one source. The loss is the relative error against the
measured peak reserved of 20 real steps, with under-estimates weighted 3x: an estimate
that says "fits" when it does not is the failure that matters.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from preflight_grid import GRID, SHAPES, run_config  # noqa: E402

from stages import preflight  # noqa: E402

FREE = ["work_h", "work_i", "work_d", "full_h", "full_i", "full_d", "loss_h", "logits", "chunked", "mask", "frag_logits", "frag_gib"]


def load_rows() -> list[dict]:
    rows = []
    for p in sorted((REPO / "bench" / "results").glob("preflight_grid_raw_*.json")):
        rows += [r for r in json.loads(p.read_text())["rows"] if "error" not in r]
    return rows


def predict(row: dict, coef: dict) -> float:
    cfg = run_config(Path("/nonexistent"), GRID[row["index"]])
    shapes = preflight.Shapes.from_config(SHAPES[row["model"]])
    return preflight.estimate(cfg, shapes, row["config"]["seq"], on_gpu=True, coef=coef).total_gib


def errors(rows: list[dict], coef: dict) -> np.ndarray:
    return np.array([(predict(r, coef) - r["measured_reserved_gib"]) / r["measured_reserved_gib"] for r in rows])


def fit(rows: list[dict]) -> dict:
    def residuals(x):
        e = errors(rows, dict(zip(FREE, x, strict=True)))
        return np.where(e < 0, 3 * e, e)

    x0 = [preflight.COEF[n] for n in FREE]
    res = least_squares(residuals, x0, bounds=(0, np.inf), x_scale=np.maximum(np.abs(x0), 0.1), diff_step=1e-3)
    print(f"fit: {res.message} cost {res.cost:.4g} after {res.nfev} evaluations")
    return dict(zip(FREE, (round(float(v), 3) for v in res.x), strict=True))


def report(rows: list[dict]) -> None:
    """bench/results/preflight_grid.json with the committed COEF, and the README table."""
    out = []
    for r in rows:
        est = predict(r, {})
        out.append({"model": r["model"], "config": r["config"], "estimate_gib": round(est, 3), "probe_gib": r["probe_gib"],
                    "measured_reserved_gib": round(r["measured_reserved_gib"], 3), "measured_alloc_gib": round(r["measured_alloc_gib"], 3),
                    "probe_alloc_gib": r["probe_alloc_gib"], "tokens_per_s": round(r["tokens_per_s"]),
                    "estimate_error_pct": round(100 * (est - r["measured_reserved_gib"]) / r["measured_reserved_gib"], 2),
                    "probe_error_pct": round(100 * (r["probe_gib"] - r["measured_reserved_gib"]) / r["measured_reserved_gib"], 2)})
    (REPO / "bench" / "results" / "preflight_grid.json").write_text(json.dumps(out, indent=1))
    print("| model | quant | r | targets | seq x mb | ckpt | CE | estimate | probe | measured | est. err | probe err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for o in out:
        c = o["config"]
        t = "all-linear" if c["target_modules"] == "all-linear" else "q,v,o"
        print(f"| {o['model']} | {c['quant']} | {c['r']} | {t} | {c['seq']} x {c['micro_batch']} | {'on' if c['gradient_checkpointing'] else 'off'} "
              f"| {c['cross_entropy']} | {o['estimate_gib']:.2f} | {o['probe_gib']:.2f} | {o['measured_reserved_gib']:.2f} "
              f"| {o['estimate_error_pct']:+.1f}% | {o['probe_error_pct']:+.1f}% |")
    e = np.array([o["estimate_error_pct"] for o in out])
    p = np.array([o["probe_error_pct"] for o in out])
    print(f"\nestimate: worst over {e.max():+.1f}%, worst under {e.min():+.1f}%, mean |err| {np.abs(e).mean():.1f}%; "
          f"probe: within 1% on {(np.abs(p) <= 1).sum()}/{len(p)} rows, worst {p[np.abs(p).argmax()]:+.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-on", help="fit on this shape only; the other shape's rows are held out")
    ap.add_argument("--report", action="store_true", help="no fit: write bench/results/preflight_grid.json with the committed COEF")
    a = ap.parse_args()
    rows = load_rows()
    if a.report:
        report(rows)
        return
    train = [r for r in rows if a.train_on in (None, r["model"])]
    coef = fit(train)
    print("COEF updates:", json.dumps(coef))
    for r, e in zip(rows, errors(rows, coef), strict=True):
        held = "" if a.train_on in (None, r["model"]) else "  held out"
        print(f"{r['model']:9s} #{r['index']:2d} measured {r['measured_reserved_gib']:6.2f}  estimate {predict(r, coef):6.2f}  {100 * e:+5.1f}%{held}")
    e = errors(rows, coef)
    print(f"worst over: {100 * e.max():+.1f}%  worst under: {100 * e.min():+.1f}%  mean |err|: {100 * np.abs(e).mean():.1f}%")


if __name__ == "__main__":
    main()
