"""Packed vs padded training on long-tailed lengths, against peft + Liger, on R7 shapes (H200).

    PYTHONPATH=/tmp/site:. python3 bench/packing_speed/packing_r7.py --mode qlora --out $OUT/packing_r7_qlora.json
    PYTHONPATH=/tmp/site:. python3 bench/packing_speed/packing_r7.py --mode lora  --out $OUT/packing_r7_lora.json

R7 (../shared/anchors): random-init Qwen2-7B shapes, LoRA r=64 alpha=32 dropout 0.05 on q/v/o.
Data: SAMPLES random-token samples, log-normal lengths (median 512, sigma 0.89, capped at 8192:
mean ~750, p99 ~4k, issue 13's distribution); the first 30% of each sample is prompt (label
-100), so "trained tokens" are the loss-carrying ones. The same samples, in the same seeded
random order, go to every row; each row trains on the first STEP_SAMPLES of them (200 padded
optimizer steps of micro-batch 4):

  baseline  peft + Liger Kernel (class-patched), dynamic padding, micro-batch 4, torch AdamW,
            bf16 autocast, the anchors' hand loop: the off-the-shelf bar
  padded    this stage (lora_model.build_model + hf_trainer.make_trainer, its defaults),
            packing off, micro-batch 4: today's path
  packed    this stage, packing on, 4 x 8192 = 32,768-token micro-batches, one row per
            packed attention kind (varlen, flex_attention, mask)
  profile   one small padded step (2 x ~300 tokens) of the stage, under torch.profiler: where
            the per-step time goes when the work is small (issue 13's ~0.5 s floor)

Each row runs in its own process (Liger's class patch and compiled kernels would leak between
rows). Reported per row: trained (loss-carrying) tokens/s and all-token tokens/s over the
timed steps (the first two excluded: compilation, allocator warm-up), peak reserved, and the
loss at each optimizer step with the samples seen so far, so curves can be compared per sample.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SAMPLES, STEP_SAMPLES, MICRO_BATCH, CAP, BUDGET = 4000, 800, 4, 8192, 4 * 8192
VOCAB = 152064
ROWS = ["baseline", "padded", "packed:varlen", "packed:flex_attention", "packed:mask", "profile"]
# A packed row may name its token budget: packed:varlen:16384 (default BUDGET, the padded worst case 4 x 8192).
STEP_SAMPLES = int(os.environ.get("STEP_SAMPLES", STEP_SAMPLES))  # fewer for a dry run


def lengths(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [max(16, min(CAP, round(512 * math.exp(rng.gauss(0, 0.89))))) for _ in range(SAMPLES)]


def samples(seed: int = 0) -> list[dict]:
    """The same rows for every run: random tokens, the first 30% prompt (no loss), shuffled order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths(seed)):
        ids = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        cut = max(1, int(0.3 * n))
        rows.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:], "id": f"s{i}"})
    random.Random(seed + 1).shuffle(rows)
    return rows[:STEP_SAMPLES]


def loss_tokens(rows: list[dict]) -> int:
    return sum(sum(1 for t in r["labels"][1:] if t != -100) for r in rows)


def stage_config(model_dir: Path, qlora: bool, **training):
    from stages.config import RunConfig

    return RunConfig.model_validate({
        "model": {"name_or_path": str(model_dir), "torch_dtype": "bfloat16"},
        "data": {"train_file": str(REPO / "assets/data/translate_train.jsonl"), "max_length": CAP},
        "lora": {"r": 64, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj", "o_proj"], "lora_dropout": 0.05},
        "quantization": {"load_in_4bit": qlora},
        "training": {"per_device_train_batch_size": MICRO_BATCH, "learning_rate": 1e-4, "max_steps": 10_000, "save_steps": 100_000,
                     "logging_steps": 1, "warmup_steps": 0, **training},
        "handoff": {"model_name": "bench"},
        "artifacts_dir": "/tmp/bench-artifacts",
    })


def run_row(row: str, mode: str, model_dir: Path) -> dict:
    import torch

    from stages.memory import GIB

    rows = samples()
    torch.cuda.reset_peak_memory_stats()
    if row == "baseline":
        out = baseline(model_dir, mode == "qlora", rows)
    elif row == "profile":
        out = profile(model_dir, mode == "qlora")
    else:
        packed = row.startswith("packed")
        parts = row.split(":")
        budget = int(parts[2]) if len(parts) > 2 else BUDGET
        extra = {"packing": "on", "packed_attention": parts[1], "max_tokens_per_batch": budget} if packed else {"packing": "off"}
        out = stage(stage_config(model_dir, mode == "qlora", **extra), rows)
    out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
    out["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
    return out


def _rates(times: list[float], tokens: list[int], trained: list[int]) -> dict:
    t = sum(times[2:])
    return {"steps": len(times), "timed_steps": len(times) - 2, "trained_tokens_per_s": round(sum(trained[2:]) / t),
            "tokens_per_s": round(sum(tokens[2:]) / t), "median_step_s": round(statistics.median(times[2:]), 3),
            "first_step_s": round(times[0], 2)}


def baseline(model_dir: Path, qlora: bool, rows: list[dict]) -> dict:
    """peft + Liger Kernel, the anchors' loop, DataCollatorForSeq2Seq-style dynamic padding, micro-batch 4."""
    import torch
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2

    from bench.train_speed.train_r7 import baseline_model

    apply_liger_kernel_to_qwen2()  # the class patch: fused linear cross-entropy, RMSNorm, SwiGLU, RoPE
    pm = baseline_model(model_dir, qlora)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)
    times, tokens, trained, curve, seen = [], [], [], [], 0
    for s in range(0, len(rows), MICRO_BATCH):
        group = rows[s:s + MICRO_BATCH]
        width = max(len(r["input_ids"]) for r in group)
        ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in group], device="cuda")
        labels = torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in group], device="cuda")
        mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in group], device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = pm(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(r["input_ids"]) for r in group))
        trained.append(loss_tokens(group))
        seen += len(group)
        curve.append([seen, round(loss.item(), 4)])
    return {"recipe": "peft + Liger Kernel 0.8.5 (class patch), dynamic padding, micro-batch 4, torch AdamW, bf16 autocast",
            **_rates(times, tokens, trained), "loss_by_samples_seen": curve}


def stage(cfg, rows: list[dict]) -> dict:
    """The train stage's own path (train.run without tokenization): its model, batches, Trainer."""
    import torch
    from transformers import TrainerCallback

    from stages.train import batches, hf_trainer, kernels
    from stages.train import model as lora_model

    packed = kernels.settings(cfg).packing
    longest = max(len(r["input_ids"]) for r in rows)
    train_data, plan = batches.dataset(cfg, rows, packed)
    collator = (batches.PackedCollator(varlen=kernels.settings(cfg).packed_attention == "varlen") if packed
                else batches.Collator(0))
    micro_batches = plan.micro_batches_per_epoch
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"max_steps": micro_batches})})
    if not packed:
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"train_sampling_strategy": "sequential"})})
    model = lora_model.build_model(cfg, longest)

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t = [], None

        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t)

    timer = Timer()
    trainer = hf_trainer.make_trainer(cfg, model, train_data, collator, Path("/tmp/bench-train"), callbacks=[timer],
                                      save_strategy="no", disable_tqdm=True)
    trainer.train()
    per_batch = [train_data[k] if packed else train_data[k * MICRO_BATCH:(k + 1) * MICRO_BATCH] for k in range(len(timer.times))]
    tokens = [sum(len(r["input_ids"]) for r in b) for b in per_batch]
    trained = [loss_tokens(b) for b in per_batch]
    seen, curve = 0, []
    for b, e in zip(per_batch, [e for e in trainer.state.log_history if "loss" in e], strict=False):
        seen += len(b)
        curve.append([seen, round(e["loss"], 4)])
    return {"settings": {k: v for k, v in kernels.resolve_auto(cfg, on_gpu=True, longest=longest).items()},
            "plan": plan.__dict__, **_rates(timer.times, tokens, trained), "loss_by_samples_seen": curve}


def profile(model_dir: Path, qlora: bool) -> dict:
    """One small padded step (2 rows of ~300 tokens) of the stage under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from transformers import TrainerCallback

    from stages.train import batches, hf_trainer
    from stages.train import model as lora_model

    cfg = stage_config(model_dir, qlora, packing="off", per_device_train_batch_size=2, max_steps=6)
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(3, VOCAB, (300 - i,), generator=gen).tolist()), "labels": ids} for i in range(12)]
    model = lora_model.build_model(cfg, 300)
    found: dict = {}

    class Prof(TrainerCallback):
        def __init__(self):
            self.p, self.t = None, None

        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.t = time.perf_counter()
            if state.global_step == 4:
                self.p = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.p.__enter__()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            found.setdefault("step_s", []).append(round(time.perf_counter() - self.t, 4))
            if self.p is not None:
                self.p.__exit__(None, None, None)
                avg = self.p.key_averages()
                found["top_cpu"] = [[e.key, round(e.self_cpu_time_total / 1e3, 2), e.count]
                                    for e in sorted(avg, key=lambda e: -e.self_cpu_time_total)[:25]]
                found["top_cuda"] = [[e.key, round(getattr(e, "self_device_time_total", 0) / 1e3, 2), e.count]
                                     for e in sorted(avg, key=lambda e: -getattr(e, "self_device_time_total", 0))[:25]]
                self.p = None

    trainer = hf_trainer.make_trainer(cfg, model, rows, batches.Collator(0), Path("/tmp/bench-prof"), callbacks=[Prof()],
                                      save_strategy="no", disable_tqdm=True, train_sampling_strategy="sequential")
    trainer.train()
    return {"what": "stage defaults, padded 2 x ~300 tokens; times in ms (self)", **found}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["qlora", "lora"], default="qlora")
    ap.add_argument("--rows", nargs="*", default=ROWS, help=f"of {ROWS}; packed rows may add :BUDGET")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row in this process
    ap.add_argument("--row-timeout", type=float, default=240)
    a = ap.parse_args()
    from bench.gpu_figure.random_checkpoints import make_checkpoint

    model_dir = make_checkpoint("qwen2-7b", Path("/tmp/bench-models"))
    if a.row:
        a.out.write_text(json.dumps(run_row(a.row, a.mode, model_dir)))
        return
    import torch

    rows = samples()
    ls = sorted(len(r["input_ids"]) for r in rows)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "mode": a.mode,
              "data": {"samples": len(rows), "mean": round(sum(ls) / len(ls)), "p50": ls[len(ls) // 2],
                       "p99": ls[int(0.99 * len(ls))], "max": ls[-1], "loss_tokens": loss_tokens(rows),
                       "distribution": "log-normal median 512 sigma 0.89 capped 8192, first 30% of each sample prompt"},
              "rows": {}}
    for row in a.rows:
        part = a.out.with_suffix(f".{row.replace(':', '-')}.json")
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--mode", a.mode, "--row", row, "--out", str(part)],
                               timeout=a.row_timeout, capture_output=True, text=True, env=os.environ)
            got = json.loads(part.read_text()) if p.returncode == 0 else {"error": p.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            got = {"error": f"over {a.row_timeout} s"}
        got["wall_s"] = round(time.perf_counter() - t0, 1)
        result["rows"][row] = got
        print(row, json.dumps({k: v for k, v in got.items() if k not in ("loss_by_samples_seen", "top_cpu", "top_cuda")})[:600], flush=True)
        a.out.write_text(json.dumps(result, indent=1))
    base = result["rows"].get("baseline", {}).get("trained_tokens_per_s")
    if base:
        result["vs_baseline"] = {r: round(v["trained_tokens_per_s"] / base, 3) for r, v in result["rows"].items()
                                 if "trained_tokens_per_s" in v}
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
