"""distributed: fsdp on the one GPU this session is lent: does the sharded path run on CUDA with
QLoRA (NF4 stored in bf16, loaded on the host), Liger, the offloads and packed varlen attention,
and how close is the preflight's per-GPU estimate to what one FSDP process holds?

    STEP_SAMPLES=400 python3 bench/multi_gpu/fsdp_h200.py --out $OUT/fsdp_h200.json    (environment: bench/multi_gpu/README.md)

R7 shapes (random-init Qwen2-7B), LoRA r=64 q/v/o, issue 13's long-tailed data, packed varlen at
16,384 tokens. Rows, each in its own process, the same data:
  single  the stage's in-process path (distributed: ddp, one process), the baseline of this run
  fsdp    the same config with distributed: fsdp under torchrun, one process: accelerate's FSDP2
          wraps every layer, all-gathers it per use, and checkpoints and saves through DCP
Each row: trained tokens/s, peak allocated/reserved, and memory_model.estimate for its config.
Two GPUs (the shape that does not fit one) need nvidia-h200-x2, not lent in this session.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

BUDGET = 16384


def row_config(model_dir: Path, row: str):
    """Rows are single|fsdp, optionally -lora (bf16 base instead of NF4) and :BUDGET (tokens per micro-batch)."""
    from bench.packing_speed.packing_r7 import stage_config

    name, _, budget = row.partition(":")
    extra = {"packing": "on", "packed_attention": "varlen", "max_tokens_per_batch": int(budget or BUDGET)}
    if name.startswith("fsdp"):
        extra |= {"launcher": "accelerate", "distributed": "fsdp", "num_processes": 1}
    return stage_config(model_dir, not name.endswith("-lora"), **extra)


def run_row(row: str, model_dir: Path) -> dict:
    import torch

    from bench.packing_speed.packing_r7 import samples, stage
    from stages.memory import GIB
    from stages.train import memory_model, sharding

    if torch.distributed.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rows = samples()
    cfg = row_config(model_dir, row)
    shapes = memory_model.Shapes.from_config(json.loads((model_dir / "config.json").read_text()))
    longest = max(len(r["input_ids"]) for r in rows)
    est = memory_model.estimate(cfg, shapes, longest, on_gpu=True)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = stage(cfg, rows)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
    out["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
    out["estimate_gib"] = est.total_gib
    out["estimate_items_gib"] = est.items_gib
    out["estimate_vs_alloc"] = round(est.total_gib / out["peak_alloc_gib"] - 1, 4)
    out["sharded"] = sharding.active(cfg)
    return out


def reestimate(results: Path, out: Path) -> None:
    """The run's measured peaks against the estimate as memory_model computes it now (CPU only)."""
    from bench.gpu_figure.random_checkpoints import SHAPES
    from bench.packing_speed.packing_r7 import samples
    from stages.train import memory_model

    d = json.loads(results.read_text())
    shapes = memory_model.Shapes.from_config(dict(SHAPES["qwen2-7b"]))
    longest = max(len(r["input_ids"]) for r in samples())
    rows = {}
    for row, r in d["rows"].items():
        est = memory_model.estimate(row_config(Path("unused"), row), shapes, longest, on_gpu=True)
        rows[row] = {"peak_alloc_gib": r["peak_alloc_gib"], "estimate_at_run_gib": r["estimate_gib"], "estimate_now_gib": est.total_gib,
                     "estimate_now_vs_alloc": round(est.total_gib / r["peak_alloc_gib"] - 1, 4), "items_gib": est.items_gib}
    out.write_text(json.dumps({"from": str(results), "longest": longest, "rows": rows}, indent=2))
    print(json.dumps({k: {x: v[x] for x in ("peak_alloc_gib", "estimate_at_run_gib", "estimate_now_gib")} for k, v in rows.items()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--rows", nargs="*", default=["single", "fsdp"], help="single|fsdp[-lora][:BUDGET]")
    ap.add_argument("--row-timeout", type=float, default=280)
    ap.add_argument("--reestimate", type=Path, help="a results JSON: the estimate of today's memory_model for each row, no GPU")
    a = ap.parse_args()
    if a.reestimate:
        return reestimate(a.reestimate, a.out)
    from bench.gpu_figure.random_checkpoints import make_checkpoint

    model_dir = make_checkpoint("qwen2-7b", Path("/tmp/bench-models"))
    if a.row:
        result = run_row(a.row, model_dir)
        if int(os.environ.get("RANK", "0")) == 0:
            a.out.write_text(json.dumps(result))
        return
    import torch

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "budget_tokens": BUDGET, "rows": {}}
    for row in a.rows:
        part = a.out.with_suffix(f".{row.replace(':', '-')}.json")
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"] if row.startswith("fsdp") else []
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, *launcher, __file__, "--row", row, "--out", str(part)], timeout=a.row_timeout,
                               capture_output=True, text=True, env=os.environ)
            got = json.loads(part.read_text()) if p.returncode == 0 else {"error": p.stdout[-1500:] + p.stderr[-2500:]}
        except subprocess.TimeoutExpired:
            got = {"error": f"timed out after {a.row_timeout} s"}
        got["process_s"] = round(time.perf_counter() - t0, 1)
        result["rows"][row] = got
        print(row, json.dumps({k: v for k, v in got.items() if k not in ("loss_by_samples_seen", "estimate_items_gib")})[:1500], flush=True)
        a.out.write_text(json.dumps(result, indent=2))
    s, f = result["rows"].get("single", {}), result["rows"].get("fsdp", {})
    if "trained_tokens_per_s" in s and "trained_tokens_per_s" in f:
        result["fsdp_vs_single"] = {"tokens_per_s": round(f["trained_tokens_per_s"] / s["trained_tokens_per_s"], 3),
                                    "peak_reserved": round(f["peak_reserved_gib"] / s["peak_reserved_gib"], 3)}
    a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
