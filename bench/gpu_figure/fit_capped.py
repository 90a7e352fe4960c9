"""The estimate against the capped runs' need (CPU): recomputes every row's estimate with the committed code
(or with --coef overrides) from the row's config.json and settings, and prints estimate / need.

    python bench/gpu_figure/fit_capped.py bench/gpu_figure/results/need_run*.json [--coef slack=0.02 slack_gib=0.07]
    python bench/gpu_figure/fit_capped.py bench/gpu_figure/results/validate_run*.json --table     # the docs/preflight.md table
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "gpu_figure"))


def recompute(row: dict, coef: dict | None = None) -> tuple[float, float]:
    """(estimate, allocation part) for a grid row, with the code as it is now."""
    from capped_grid import ROWS, row_config

    from stages.train import memory_model

    cfg = row_config(row["name"], Path("m"), Path("t.jsonl"), Path("e.jsonl"), Path("/tmp/w"), False)
    if tuple(ROWS[row["name"]][:5]) != (row["shape"], row["quant"], row["packing"], row["max_length"], row["micro_batch"]):
        raise SystemExit(f"row {row['name']} changed since it was measured")
    # packed: the micro-batch the row's run trained at its heaviest (rows measured before packed steps held a step's samples
    # filled every micro-batch to the budget, which is what they recorded)
    est = memory_model.estimate(cfg, memory_model.Shapes.from_config(row["config_json"]), row["longest"], on_gpu=True, coef=coef,
                                packed_tokens=row["worst_batch_tokens"] if row.get("packed") else None)
    overhead = next(v for k, v in est.items_gib.items() if k.startswith("allocator"))
    return est.total_gib, est.total_gib - overhead


def table(rows: list[dict]) -> str:
    """One line per validated row: the run capped at the estimate, and at 0.95 x it."""
    from stages.train import memory_model

    out = ["| row | model shape (what it tests) | mode | micro-batches | LoRA | estimate GiB | peak allocated GiB | at the estimate | at 0.95 x |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["name"][0], int(r["name"][1:]))):
        s = memory_model.Shapes.from_config(r["config_json"])
        what = ", ".join(x for x in ("tied" if s.tied else "untied", f"{s.vocab // 1000}k vocab", f"GQA {s.heads // s.kv_heads}:1",
                                     "q/k norms" if s.arch and s.arch.qk_norm else "",
                                     "fused qkv/gate_up" if s.arch and "qkv_proj" in s.arch.linears else "") if x)
        at, below = r["trials"][0], (r["trials"][1] if len(r["trials"]) > 1 else None)
        tokens = f"packed {r['worst_batch_tokens']}" if r["packed"] else f"padded {r['micro_batch']} x {r['max_length']}"
        lora = f"r{r['r']} {'all-linear' if r['targets'] == 'all-linear' else 'q/v/o'}"
        out.append(f"| {r['name']}{' (held out)' if r['held_out'] else ''} | {r['shape']} ({what}) | {'QLoRA' if r['quant'] == 'nf4' else 'LoRA bf16'} | "
                   f"{tokens} | {lora} | {r['estimate_gib']:.2f} | {at['peak_alloc_gib']:.2f} | "
                   f"{'completes' if at['ok'] else '**OOM**'} ({at['steps'] if at['ok'] else '-'} steps, {at.get('evals', 0)} evals) | "
                   + ("not run (time limit)" if below is None else "fails (OOM)" if not below["ok"] else "**completes** (estimate > +5%)") + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--coef", nargs="*", default=[], help="NAME=VALUE overrides of memory_model.COEF")
    ap.add_argument("--table", action="store_true", help="validate rows as the Markdown table of docs/preflight.md")
    a = ap.parse_args()
    coef = {k: float(v) for k, v in (x.split("=") for x in a.coef)}
    rows = [r for f in a.files for r in json.loads(f.read_text())["rows"] if "error" not in r]
    if a.table:
        print(table(rows))
        return
    for r in sorted(rows, key=lambda r: (r["name"][0], int(r["name"][1:]))):
        est, alloc = recompute(r, coef)
        if "need_gib" in r:
            print(f"{r['name']:4} {r['shape']:13} {r['quant']} {r['packing']:3} {r['max_length']}x{r['micro_batch']} "
                  f"alloc model {alloc / r['alloc_gib'] - 1:+.3f}  need {r['need_gib']:.3f} (fails {r['fail_gib']})  "
                  f"estimate {est:.3f} = {est / r['need_gib']:.3f} x need, {est / (r['fail_gib'] or r['alloc_gib']):.3f} x failing cap")
        else:
            t = r.get("trials", [])
            print(f"{r['name']:4} {r['shape']:13} {r['quant']} {r['packing']:3} {r['max_length']}x{r['micro_batch']} estimate at run "
                  f"{r['estimate_gib']:.3f} now {est:.3f}; at estimate: {r.get('completes_at_estimate')}, at 0.95x fails: {r.get('fails_below')}; "
                  f"peak alloc {t[0].get('peak_alloc_gib') if t else None}")


if __name__ == "__main__":
    main()
