"""A real CUDA OOM late in a run, recovered (issue 21): the train stage capped so that one late long micro-batch
does not fit, resuming from its last checkpoint at half the micro-batch, to the same loss curve.

    python3 bench/oom_recovery/oom_recovery.py --out $OUT/oom_recovery.json [--shape qwen2.5-1.5b]

Qwen2.5-1.5B shapes (random init), bf16 LoRA r=64 q/v/o, padded micro-batches read in order, 30 optimizer
steps of 4 samples of 300-900 tokens with one 6,144-token sample in step 18, a checkpoint every 4 steps:
  half     uncapped, micro-batch 2 x accumulation 2 from the start: the run the recovery must become
  full     uncapped, micro-batch 4 x accumulation 1: what step 18 needs at full size
  capped   micro-batch 4, the process capped between the two (at `half`'s peak reserved + 2%, below `full`'s
           peak allocated): step 18 runs out of memory, the stage writes its post-mortem, frees the attempt,
           and resumes from checkpoint-16 with micro-batch 2 x accumulation 2
Both curves train the same 4 samples per optimizer step in the same order, so `capped`'s loss per step must be
`full`'s up to step 16 and `half`'s after (bf16 arithmetic differs between micro-batch sizes: compared with
a tolerance, reported per step).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "gpu_figure"))

STEPS, LONG_STEP, SAVE = 30, 18, 4
LONG = 6144  # the late sample is written longer and truncated to exactly this (--long-tokens)
LONG_TOKENS = [LONG]


def write_data(path: Path, long_tokens: int) -> None:
    """4 x STEPS records of 300-900 tokens in order, the first of step LONG_STEP long_tokens long (tiny-llama tokenizer: ~1.6 tokens a word)."""
    rng = random.Random(0)
    words = "sun moon cat bird dog red green blue river stone light rain tree house road book".split()

    def rec(tokens: int) -> dict:
        n = int(tokens / 1.6)
        t = [rng.choice(words) for _ in range(n)]
        return {"prompt": " ".join(t[: n // 3]), "completion": " ".join(t[n // 3:])}

    lengths = [rng.randint(300, 900) for _ in range(4 * STEPS)]
    lengths[4 * (LONG_STEP - 1)] = 2 * long_tokens
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(rec(n)) + "\n" for n in lengths))


TARGETS: list = [["q_proj", "v_proj", "o_proj"]]   # --targets
QLORA = [False]                                      # --qlora


def config(model_dir: Path, data: Path, work: Path, micro_batch: int):
    from stages.config import RunConfig

    return RunConfig.model_validate({
        "model": {"name_or_path": str(model_dir)},
        "data": {"train_file": str(data), "max_length": LONG_TOKENS[0], "long_sample_policy": "truncate", "num_proc": 1},
        "lora": {"r": 64, "lora_alpha": 32, "target_modules": TARGETS[0], "lora_dropout": 0.0},
        "quantization": {"load_in_4bit": QLORA[0]},
        "training": {"per_device_train_batch_size": micro_batch, "gradient_accumulation_steps": 4 // micro_batch, "packing": "off",
                     "train_sampling_strategy": "sequential", "max_steps": STEPS, "save_steps": SAVE, "logging_steps": 1,
                     "learning_rate": 1e-3, "warmup_steps": 0, "lr_scheduler_type": "constant"},
        "smoke": {"check": "stops"},
        "handoff": {"model_name": "bench"},
        "artifacts_dir": str(work / "artifacts"),
    })


def losses(train_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (train_dir / "loss.jsonl").read_text().splitlines()) if "loss" in r}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--work", type=Path, default=Path("/tmp/oom-recovery"))
    ap.add_argument("--long-tokens", type=int, default=LONG)
    ap.add_argument("--targets", default="q_proj,v_proj,o_proj", help="lora.target_modules: comma-separated names, or all-linear "
                    "(attention and, on a MoE, every routed expert stack)")
    ap.add_argument("--qlora", action="store_true", help="quantization.load_in_4bit: NF4 linear layers and expert stacks")
    a = ap.parse_args()
    TARGETS[0] = a.targets if a.targets == "all-linear" else a.targets.split(",")
    QLORA[0] = a.qlora
    import torch
    from capped_grid import shapes, trial
    from random_checkpoints import make_checkpoint

    model_dir = make_checkpoint(a.shape, a.work / "models", shapes())
    data = a.work / "data" / "train.jsonl"
    LONG_TOKENS[0] = a.long_tokens
    write_data(data, a.long_tokens)
    runs = {}
    t0 = time.perf_counter()
    runs["half"] = trial(config(model_dir, data, a.work / "half", 2), a.work / "half" / "train", None)
    runs["full"] = trial(config(model_dir, data, a.work / "full", 4), a.work / "full" / "train", None)
    if any(not r["ok"] for r in runs.values()):
        raise SystemExit(json.dumps(runs))
    if not torch.cuda.is_available():  # CPU dry run: the two uncapped runs only
        print(json.dumps(runs, indent=1), {k: losses(a.work / k / "train") for k in runs})
        return
    cap = 1.02 * runs["half"]["peak_reserved_gib"]
    result = {"shape": a.shape, "targets": TARGETS[0], "qlora": QLORA[0], "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "cap_gib": round(cap, 3),
              "runs": runs}
    if cap >= runs["full"]["peak_alloc_gib"]:
        result["error"] = "the cap does not separate the two micro-batch sizes: raise --long-tokens"
    else:
        from stages import train

        cfg = config(model_dir, data, a.work / "capped", 4)
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"oom_retries": 2})})
        runs["capped"] = trial(cfg, a.work / "capped" / "train", cap)
        done = json.loads((a.work / "capped" / "train" / "train_result.json").read_text()) if runs["capped"]["ok"] else {}
        result["recoveries"] = done.get("oom_recoveries")
        curves = {k: losses(a.work / k / "train") for k in ("half", "full", "capped") if (a.work / k / "train" / "loss.jsonl").is_file()}
        if "capped" in curves:
            resumed = int(result["recoveries"][0]["resumed_from"].rsplit("-", 1)[1]) if result["recoveries"] else STEPS
            rel = {s: abs(curves["capped"][s] - (curves["full"] if s <= resumed else curves["half"])[s]) / (curves["half"][s])
                   for s in curves["capped"]}
            result |= {"loss_per_step": curves, "resumed_from_step": resumed,
                       "max_rel_diff_before_resume": max((v for s, v in rel.items() if s <= resumed), default=None),
                       "max_rel_diff_after_resume": max((v for s, v in rel.items() if s > resumed), default=None),
                       "max_rel_diff_half_vs_full": max(abs(curves["half"][s] - curves["full"][s]) / curves["half"][s] for s in curves["half"])}
        del train
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("loss_per_step", "runs")}, indent=1))
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
