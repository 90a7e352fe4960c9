"""Packed vs padded training on long-tailed lengths, on CPU, with the embedded tiny model.

    .venv/bin/python bench/packing_speed/packing_cpu.py --out bench/packing_speed/results/packing_cpu.json

What `training.packing: auto` decides on a CPU rests on this run (the GPU decision on
bench/packing_speed/packing_r7.py). The model is assets/tiny-llama (random init, hidden 256); the data
SAMPLES random-token samples with log-normal lengths (median 48, sigma 0.89, capped at 512:
issue 13's distribution scaled down 16x to this model's size), the first 30% of each sample
prompt (no loss). The same samples in the same order go to every row:

  peft      plain peft, the padded hand loop (torch AdamW), micro-batch 4: off the shelf
  padded    this stage (lora_model.build_model + hf_trainer.make_trainer), packing off, micro-batch 4
  packed    this stage, packing on, 4 x 512 = 2048-token micro-batches, attention `mask` and `varlen`

Trained tokens/s counts loss-carrying tokens only; each row also records its loss per samples seen.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SAMPLES, MICRO_BATCH, CAP = 480, 4, 512
MODEL = REPO / "assets" / "tiny-llama"


def samples(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(SAMPLES):
        n = max(8, min(CAP, round(48 * math.exp(rng.gauss(0, 0.89)))))
        ids = torch.randint(3, 440, (n,), generator=gen).tolist()
        cut = max(1, int(0.3 * n))
        rows.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:], "id": f"s{i}"})
    return rows


def loss_tokens(rows: list[dict]) -> int:
    return sum(sum(1 for t in r["labels"][1:] if t != -100) for r in rows)


def config(**training):
    from stages.config import RunConfig

    return RunConfig.model_validate({
        "model": {"name_or_path": str(MODEL)},
        "data": {"train_file": str(REPO / "assets/data/translate_train.jsonl"), "max_length": CAP},
        "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear"},  # as the peft row
        "training": {"per_device_train_batch_size": MICRO_BATCH, "learning_rate": 1e-3, "max_steps": 10_000, "save_steps": 100_000,
                     "logging_steps": 1, "warmup_steps": 0, "train_sampling_strategy": "sequential", **training},
        "handoff": {"model_name": "bench"},
        "artifacts_dir": "/tmp/bench-artifacts",
    })


def peft_baseline(rows: list[dict]) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    m.config.use_cache = False
    m.train()
    pm = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"))
    pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pm.enable_input_require_grads()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-3)
    t0, curve, seen = time.perf_counter(), [], 0
    for s in range(0, len(rows), MICRO_BATCH):
        group = rows[s:s + MICRO_BATCH]
        w = max(len(r["input_ids"]) for r in group)
        ids = torch.tensor([r["input_ids"] + [0] * (w - len(r["input_ids"])) for r in group])
        labels = torch.tensor([r["labels"] + [-100] * (w - len(r["labels"])) for r in group])
        mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (w - len(r["input_ids"])) for r in group])
        loss = pm(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += len(group)
        curve.append([seen, round(loss.item(), 4)])
    return _result(time.perf_counter() - t0, rows, curve, {"recipe": "peft, padded hand loop, torch AdamW, micro-batch 4"})


def stage(rows: list[dict], **training) -> dict:
    from stages.train import batches, hf_trainer, kernels
    from stages.train import model as lora_model

    cfg = config(**training)
    packed = kernels.settings(cfg).packing
    train_data, plan = batches.dataset(cfg, rows, packed)
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"max_steps": plan.micro_batches_per_epoch})})
    collator = batches.PackedCollator(varlen=kernels.settings(cfg).packed_attention == "varlen") if packed else batches.Collator(0)
    model = lora_model.build_model(cfg, max(len(r["input_ids"]) for r in rows))
    trainer = hf_trainer.make_trainer(cfg, model, train_data, collator, Path("/tmp/bench-packing-cpu"), save_strategy="no",
                                      disable_tqdm=True)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    per_batch = [train_data[k] if packed else rows[k * MICRO_BATCH:(k + 1) * MICRO_BATCH] for k in range(trainer.state.global_step)]
    seen, curve = 0, []
    for b, e in zip(per_batch, [e for e in trainer.state.log_history if "loss" in e], strict=False):
        seen += len(b)
        curve.append([seen, round(e["loss"], 4)])
    return _result(wall, [r for b in per_batch for r in b], curve, {"plan": plan.__dict__, "packed_attention": kernels.settings(cfg).packed_attention})


def _result(wall: float, trained_rows: list[dict], curve: list, extra: dict) -> dict:
    tokens = sum(len(r["input_ids"]) for r in trained_rows)
    return {**extra, "wall_s": round(wall, 2), "samples": len(trained_rows), "tokens_per_s": round(tokens / wall),
            "trained_tokens_per_s": round(loss_tokens(trained_rows) / wall), "optimizer_steps": len(curve),
            "final_loss": curve[-1][1], "loss_by_samples_seen": curve}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rows = samples()
    ls = sorted(len(r["input_ids"]) for r in rows)
    out = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
           "data": {"samples": len(rows), "mean": round(sum(ls) / len(ls), 1), "p50": ls[len(ls) // 2], "p99": ls[int(0.99 * len(ls))],
                    "max": ls[-1], "loss_tokens": loss_tokens(rows)}, "rows": {}}
    runs = [("peft", lambda: peft_baseline(rows)),
            ("padded", lambda: stage(rows, packing="off")),
            ("packed:mask", lambda: stage(rows, packing="on", packed_attention="mask", max_tokens_per_batch=MICRO_BATCH * CAP)),
            ("packed:varlen", lambda: stage(rows, packing="on", packed_attention="varlen", max_tokens_per_batch=MICRO_BATCH * CAP))]
    for name, fn in runs:
        out["rows"][name] = fn()
        print(name, {k: v for k, v in out["rows"][name].items() if k != "loss_by_samples_seen"}, flush=True)
    base = out["rows"]["peft"]["trained_tokens_per_s"]
    out["vs_peft"] = {k: round(v["trained_tokens_per_s"] / base, 3) for k, v in out["rows"].items()}
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["vs_peft"]))


if __name__ == "__main__":
    main()
