"""Every release in configs.py, twice, on this machine (CPU):

1. at full size, as a header-only checkpoint, through the preflight (the model checks and the estimate);
2. as its narrowest copy that keeps every ratio (configs.narrow(): the release's widths, head counts, head_dim,
   nope/rope split, expert counts and top-k, per-layer types, at 2 layers or what the family needs, intermediate
   sizes divided by one power of two, random init, the tokenizer its family's releases ship) through every stage:
   preflight -> train -> merge -> export -> smoke, with the project's defaults (export: Q4_K_M and Q5_K_S, imatrix
   auto) and tests/test_families.py's settings for random weights (4 steps, fidelity and smoke gates open).
   Each copy runs in its own process, so one family's memory or crash is not the next one's.

results.json: a row per family: `family`, `source`, `preflight` (the full size's verdict), `stages` (those the copy
passed), `result` (passed | refused: stopped before training with the reason and the fix | failed: a traceback, a
finding), `message`; the copy's changes from the release (`copy.changed`: {key: [release, copy]}; every other key is
the release's), its losses, files, times and peak memory.

    python bench/released_configs/sweep.py --out bench/released_configs/results.json            # both, every release
    python bench/released_configs/sweep.py --out F --only gpt-oss-20b --preflight-only        # 1. alone; --only
                                                                                              # replaces its rows in F
    python bench/released_configs/sweep.py --copy gpt-oss-20b --work DIR                      # 2. one copy, here
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

import configs  # noqa: E402

QUANTS = ("Q4_K_M", "Q5_K_S")   # the export's defaults (stages/config.py), both, each with and without the imatrix


def full_size(name: str, work: Path) -> dict:
    """The release at full size through the preflight: its verdict, estimate and first line."""
    import yaml

    from stages import preflight
    from stages.config import load_config

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
        row = {"preflight": "fits" if r.fits else "does not fit", "estimate_gib_cpu": round(r.estimate.total_gib, 2),
               "adapted": r.adapted, "preflight_message": r.report_md.read_text().splitlines()[0][3:300]}
    except Exception as e:  # noqa: BLE001 - a refusal is the row's result
        row = {"preflight": "refused", "preflight_message": f"{type(e).__name__}: {str(e)[:600]}"}
    return row | {"preflight_s": round(time.perf_counter() - t0, 2)}


def _where(tb) -> str | None:
    """The innermost frame of the project's own code, else the innermost frame."""
    frames = traceback.extract_tb(tb)
    f = ([f for f in frames if f.filename.startswith(str(ROOT)) and "/.venv/" not in f.filename] or frames or [None])[-1]
    return f and f"{f.filename.removeprefix(str(ROOT) + '/')}:{f.lineno} ({f.name})"


def copy_through_stages(name: str, work: Path) -> dict:
    """The release's narrow copy through every stage, in this process; the record of what it passed."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages import merge, preflight, smoke
    from stages.errors import UserError
    from stages.export import stage as export_stage
    from stages.train import stage as train_stage
    from tests.test_families import _config

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    rec: dict = {"stages": [], "seconds": {}, "threads": torch.get_num_threads()}
    stage, t0 = "build", time.perf_counter()

    def passed(stage: str) -> None:
        nonlocal t0
        rec["stages"].append(stage)
        rec["seconds"][stage] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()

    try:
        model_dir, asset, changed = configs.model(name, work / "model")
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).parameters())
        rec["copy"] = {"tokenizer": asset, "params_m": round(n / 1e6, 1), "changed": changed}
        cfg = _config(work, model_dir, asset, quant_types=QUANTS, imatrix="auto")
        rec["seconds"]["build"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        stage = "preflight"
        pre = preflight.run(cfg, work / "preflight")
        rec["adapted"] = pre.adapted
        passed(stage)
        stage = "train"
        trained = train_stage.run(cfg, work / "train")
        lora = load_file(trained.adapter_dir / "adapter_model.safetensors")
        lora_b = {k: bool(v.abs().sum() > 0) for k, v in lora.items() if "lora_B" in k}
        experts = [k for k in lora_b if ".experts." in k]
        rec["train"] = {"steps": trained.steps, "first_loss": round(trained.first_loss, 4), "final_loss": round(trained.final_loss, 4),
                        "lora_b": len(lora_b), "lora_b_trained": sum(lora_b.values()),
                        "expert_lora_b": len(experts), "expert_lora_b_trained": sum(lora_b[k] for k in experts)}
        if not trained.final_loss == trained.final_loss or not any(lora_b.values()):   # NaN, or nothing learned
            raise RuntimeError(f"the adapter did not train: loss {trained.final_loss}, {sum(lora_b.values())} of "
                               f"{len(lora_b)} lora_B tensors moved from zero")
        passed(stage)
        stage = "merge"
        merged = merge.run(cfg, trained.adapter_dir, work / "merge")
        rec["merge"] = {"max_abs_logit_diff": merged.max_abs_logit_diff}
        passed(stage)
        stage = "export"
        exported = export_stage.run(cfg, merged.merged_dir, work / "export")
        rec["export"] = {"files": {f.quant: {"mib": round(f.size_mib, 1), "imatrix": f.imatrix,
                                             "fallbacks": f.fallbacks} for f in exported.files},
                         "fidelity": [{k: f[k] for k in ("file", "mean_kl", "top1_agreement")} for f in exported.fidelity_table()],
                         "seconds": exported.seconds}
        passed(stage)
        stage = "smoke"
        smoked = smoke.run(cfg, exported.gguf_files(), work / "smoke")
        rec["smoke"] = {f.quant: {"prompts": f.n_prompts, "gen_tok_s": round(f.gen_tokens_per_s, 1), "stopped_at_eos": f.stopped_at_eos,
                                  "answers": [[e["got"], e["finish_reason"]] for e in f.examples[:3]]} for f in smoked.files}
        passed(stage)
        files = ", ".join(f"{q} ({v['mib']} MiB{', imatrix' if v['imatrix'] else ''})" for q, v in rec["export"]["files"].items())
        rec |= {"result": "passed", "message": f"every stage: {trained.steps} steps, {rec['train']['lora_b_trained']} of "
                                               f"{len(lora_b)} lora_B tensors trained; {files}; llama.cpp ran "
                                               f"{smoked.files[0].n_prompts} prompts through each"}
    except Exception as e:  # noqa: BLE001 - the sweep records every outcome
        refused = isinstance(e, UserError) and stage in ("build", "preflight")
        rec |= {"result": "refused" if refused else "failed", "stage": stage,
                "message": f"{stage}: {type(e).__name__}: {str(e)[:1200]}", "where": _where(e.__traceback__)}
        traceback.print_exc()
    rec["peak_rss_gib"] = round(max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                                    resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2**20, 2)
    return rec


def copy_in_subprocess(name: str, work: Path, timeout: int, log: Path) -> dict:
    cmd = [sys.executable, __file__, "--copy", name, "--work", str(work)]
    with log.open("w") as err:
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"stages": [], "result": "failed", "message": f"over the sweep's {timeout} s per family (log: {log})"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"stages": [], "result": "failed",
                                                 "message": f"the process ended with {p.returncode} and no record (log: {log})"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--preflight-only", action="store_true")
    ap.add_argument("--copy", help="one release's narrow copy through every stage in this process (one JSON line)")
    ap.add_argument("--work", type=Path)
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "released_configs")
    a = ap.parse_args()
    if a.copy:
        print(json.dumps(copy_through_stages(a.copy, a.work)), flush=True)
        return
    out = Path(a.out)
    kept = {r["family"]: r for r in json.loads(out.read_text())["rows"]} if a.only and out.is_file() else {}
    a.logs.mkdir(parents=True, exist_ok=True)
    for name in a.only or configs.RELEASES:
        source, values = configs.RELEASES[name]
        started = time.perf_counter()
        row = {"family": name, "model_type": values["model_type"], "source": source}
        with tempfile.TemporaryDirectory() as work:
            row |= full_size(name, Path(work))
        if not a.preflight_only:
            with tempfile.TemporaryDirectory() as work:
                row |= copy_in_subprocess(name, Path(work), a.timeout, a.logs / f"{name}.log")
        else:
            row |= {"stages": ["preflight"] if row["preflight"] == "fits" else [], "result": row["preflight"],
                    "message": row["preflight_message"]}
        kept[name] = row | {"wall_s": round(time.perf_counter() - started, 1)}
        print(json.dumps({k: row.get(k) for k in ("family", "preflight", "stages", "result", "message")})[:600], flush=True)
        rows = [kept[n] for n in configs.RELEASES if n in kept]   # --only replaces its rows of an earlier --out
        out.write_text(json.dumps({
            "note": "full size: header-only checkpoints through the preflight on a CPU (budget 4096 GiB: the verdict is the "
                    "model checks', the estimate the CPU run's); stages: each release's narrow copy (configs.narrow) on a CPU",
            "minutes": round(sum(r.get("wall_s", 0) for r in rows) / 60, 1), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
