"""Fit the preflight estimate (stages.train.memory_model.COEF) to the default-settings grid, and report it.

    python bench/gpu_figure/fit_memory.py                       # fit on the fitting shapes, report every row
    python bench/gpu_figure/fit_memory.py --report              # no fit: the committed COEF against every row
    python bench/gpu_figure/fit_memory.py --hold-out llama-3b   # fit without a shape, see how it does there

Reads bench/gpu_figure/results/memory_grid_raw_run*.jsonl (bench/gpu_figure/memory_grid.py on an H200). The model
being fitted is stages.train.memory_model.estimate itself, called with candidate coefficients, so the
formula has one source. The activation coefficients are fitted against the measured peak
*allocated* (what the tensors take); the allocator's slack on top is not fitted but set from
bench/gpu_figure/cap_check.py (a capped run gives back what an uncapped one over-reserves). Under-estimates
weigh 3x: an estimate that says "fits" when it does not is the failure that matters. Shapes in HELD_OUT never enter
the fit; they check the estimate on widths, vocabularies and GQA ratios it did not see.
--report writes bench/gpu_figure/results/memory_grid.json: rows {model, config, estimate_gib, probe_gib,
measured_reserved_gib, measured_alloc_gib, ...}, and the README's table (memory_grid.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "gpu_figure"))

from memory_grid import run_config  # noqa: E402
from random_checkpoints import SHAPES  # noqa: E402

from stages.train import memory_model  # noqa: E402

HELD_OUT = {"smollm2-360m", "qwen2.5-0.5b"}
# layer_kv stays at its count (the saved keys and values): key/value width is too close to a fixed share of the
# hidden width across the grid for a fit to tell the two apart
ACTIVATION = ["layer_h", "layer_i", "tiled_h", "tile_i", "mask", "nf4_i", "nf4_tiled_h"]
OVERHEAD = ["slack_gib", "slack"]  # not fitted: set from the cap check (bench/gpu_figure/cap_check.py), reported here
GIB = 2**30


def load_rows() -> list[dict]:
    rows = []
    for p in sorted((REPO / "bench" / "gpu_figure" / "results").glob("memory_grid_raw_run*.jsonl")):
        rows += [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return [r for r in rows if "error" not in r and r.get("measured_reserved_gib")]


def estimate(row: dict, coef: dict) -> memory_model.Estimate:
    c = row["config"]
    cfg = run_config(Path("/nonexistent"), c["quant"], c["r"], c["target_modules"], c["seq"], c["micro_batch"])
    return memory_model.estimate(cfg, memory_model.Shapes.from_config(SHAPES[c["shape"]]), c["seq"], on_gpu=True, coef=coef)


def allocated(est: memory_model.Estimate) -> float:
    return (est.total_gib * GIB - next(v for k, v in est.items_bytes.items() if k.startswith("allocator"))) / GIB


def fit(rows: list[dict]) -> dict:
    """The activation coefficients against the measured peak allocated (the allocator's slack is not fitted)."""
    coef = dict(memory_model.COEF)

    def residuals(x):
        c = coef | dict(zip(ACTIVATION, x, strict=True))
        e = np.array([(allocated(estimate(r, c)) - r["measured_alloc_gib"]) / r["measured_alloc_gib"] for r in rows])
        return np.where(e < 0, 3 * e, e)

    x0 = [coef[n] for n in ACTIVATION]
    lower = [-np.inf if n == "nf4_tiled_h" else 0 for n in ACTIVATION]
    res = least_squares(residuals, x0, bounds=(lower, np.inf), x_scale=np.maximum(np.abs(x0), 0.1), diff_step=1e-3)
    print(f"fit: {res.message} cost {res.cost:.4g}")
    return coef | {n: round(float(v), 3) for n, v in zip(ACTIVATION, res.x, strict=True)}


def report(rows: list[dict], coef: dict) -> list[dict]:
    out = []
    for r in rows:
        est = estimate(r, coef)
        m = r["measured_reserved_gib"]
        out.append({"model": r["model"], "config": r["config"] | {"tiled_mlp": r["tiled_mlp"]}, "fitted_on": r["model"] not in HELD_OUT,
                    "estimate_gib": round(est.total_gib, 3), "probe_gib": r.get("probe_gib"), "measured_reserved_gib": round(m, 3),
                    "measured_alloc_gib": round(r["measured_alloc_gib"], 3), "estimate_alloc_gib": round(allocated(est), 3),
                    "error": round(est.total_gib / m - 1, 4), "probe_error": round(r["probe_gib"] / m - 1, 4) if r.get("probe_gib") else None})
    return out


def print_table(out: list[dict]) -> None:
    for o in out:
        c = o["config"]
        print(f"{o['model']:13} {c['quant']:4} r{c['r']:<3} {c['seq']:>6}x{c['micro_batch']} {'tiled' if c['tiled_mlp'] else '     '} "
              f"est {o['estimate_gib']:7.3f}  measured {o['measured_reserved_gib']:7.3f}  {o['error']:+7.1%}  "
              f"(alloc est {o['estimate_alloc_gib']:6.3f} / {o['measured_alloc_gib']:6.3f})  probe {o['probe_error']:+.1%}"
              f"{'' if o['fitted_on'] else '  held out'}")
    for name, sel in (("fitted", [o for o in out if o["fitted_on"]]), ("held out", [o for o in out if not o["fitted_on"]])):
        if sel:
            a = [o["estimate_alloc_gib"] / o["measured_alloc_gib"] - 1 for o in sel]
            print(f"{name}: allocation model vs peak allocated {min(a):+.1%} .. {max(a):+.1%}, mean |error| {np.mean(np.abs(a)):.1%}")
            e = [o["error"] for o in sel]
            print(f"{name}: {len(sel)} rows, estimate vs uncapped peak reserved {min(e):+.1%} .. {max(e):+.1%}, "
                  f"mean |error| {np.mean(np.abs(e)):.1%}, within 3%: {sum(abs(x) <= 0.03 for x in e)}/{len(e)}")


def markdown(out: list[dict]) -> str:
    """The README's accuracy table."""
    rows = ["| model | mode | tokens | estimate GiB | peak allocated GiB | allocation model | estimate - allocated | "
            "uncapped peak reserved GiB | probe reserved GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for o in out:
        c = o["config"]
        rows.append(f"| {o['model']}{'' if o['fitted_on'] else ' (held out)'} | {'QLoRA' if c['quant'] == 'nf4' else 'LoRA'} r{c['r']} | "
                    f"{c['micro_batch']} x {c['seq']}{' tiled' if c['tiled_mlp'] else ''} | {o['estimate_gib']:.2f} | {o['measured_alloc_gib']:.2f} | "
                    f"{o['estimate_alloc_gib'] / o['measured_alloc_gib'] - 1:+.1%} | {o['estimate_gib'] - o['measured_alloc_gib']:+.2f} | "
                    f"{o['measured_reserved_gib']:.2f} | {o['probe_gib']:.2f} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", action="store_true", help="no fit: the committed COEF")
    ap.add_argument("--hold-out", nargs="*", default=None, help="shapes left out of the fit (default: HELD_OUT)")
    a = ap.parse_args()
    rows = load_rows()
    held = set(HELD_OUT) if a.hold_out is None else set(a.hold_out)
    HELD_OUT.clear()
    HELD_OUT.update(held)
    coef = dict(memory_model.COEF) if a.report else fit([r for r in rows if r["model"] not in HELD_OUT])
    if not a.report:
        print("COEF:", json.dumps({k: coef[k] for k in ACTIVATION + OVERHEAD}))
    out = report(rows, coef)
    print_table(out)
    if a.report:
        (REPO / "bench" / "gpu_figure" / "results" / "memory_grid.md").write_text(markdown(out))
        (REPO / "bench" / "gpu_figure" / "results" / "memory_grid.json").write_text(json.dumps({"coef": {k: coef[k] for k in ACTIVATION + OVERHEAD},
                                                                                 "held_out": sorted(HELD_OUT), "rows": out}, indent=1))


if __name__ == "__main__":
    main()
