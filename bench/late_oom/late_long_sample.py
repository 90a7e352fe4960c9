"""The user's failure, reproduced and prevented, in one run ("enough VRAM, yet OOM at step 150").

    PYTHONPATH=. python bench/late_oom/late_long_sample.py --out $OUT/late_long_sample.json

A random-init Qwen2-7B-shaped model (R7), LoRA r=64 on q/v/o, micro-batch 2, a 24 GiB
budget (torch.cuda.set_per_process_memory_fraction), and a dataset of 400 samples of
512-1024 tokens with one 12,288-token sample at position 300: step 150 of 200, in order.

1. baseline: plain transformers Trainer + peft (the usual recipe: bf16, gradient
   checkpointing, DataCollatorForSeq2Seq) on that data, capped at 24 GiB.
2. this pipeline: stages.preflight.run with preflight.gpu_memory_gib=24. It either refuses
   before step 1 (recording the fix it printed) or passes.
3. the fix applied (the overrides preflight printed), preflight again, then stages.train.run
   for all 200 steps under the same cap.
--tiny runs the same on the CPU with the embedded default (for a dry run of the script).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "gpu_figure"))

from stages import data, preflight, train  # noqa: E402
from stages.config import load_config  # noqa: E402
from stages.memory import GIB  # noqa: E402
from stages.model.load import load_tokenizer  # noqa: E402

WORDS = "red blue green black white cat dog bird fish tree sun moon star rain snow house door book road hill".split()


def write_dataset(path: Path, n: int, short: tuple[int, int], long_at: int, long_len: int, per_word: float = 1.0) -> None:
    """Lengths in tokens; `per_word` is the tokenizer's tokens per word (tokenizer versions differ)."""
    short = (int(short[0] / per_word), int(short[1] / per_word))
    long_len = int(long_len / per_word)
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            k = long_len if i == long_at else rng.randint(*short)
            words = [rng.choice(WORDS) for _ in range(k)]
            f.write(json.dumps({"prompt": "Repeat: " + " ".join(words[: k // 2]), "completion": " ".join(words[k // 2:])}) + "\n")


def write_config(tmp: Path, model_dir: Path, data_file: Path, max_length: int, budget: float, steps: int) -> Path:
    import yaml

    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"train_file": str(data_file), "max_length": max_length},
        "lora": {"r": 64, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj", "o_proj"]},
        "training": {"per_device_train_batch_size": 2, "max_steps": steps, "learning_rate": 1e-4, "logging_steps": 10,
                     "save_steps": 1000, "train_sampling_strategy": "sequential"},
        "preflight": {"gpu_memory_gib": budget},
        "smoke": {"check": "stops"},
        "handoff": {"model_name": "late-long"},
        "artifacts_dir": str(tmp / "artifacts"),
    }
    p = tmp / "config.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def baseline(cfg, cap_gib: float | None) -> dict:
    """The usual recipe: HF Trainer + peft + DataCollatorForSeq2Seq, nothing else."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    tok = load_tokenizer(cfg.model)
    t = data.tokenize(data.read_jsonl(cfg.data.train_file), tok, cfg.data.max_length, "error")
    rows = [{"input_ids": i, "labels": l} for i, l in zip(t.input_ids, t.labels, strict=True)]
    on_gpu = torch.cuda.is_available()
    if on_gpu and cap_gib:
        torch.cuda.set_per_process_memory_fraction(cap_gib * GIB / torch.cuda.get_device_properties(0).total_memory)
        torch.cuda.reset_peak_memory_stats()
    model = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=torch.bfloat16 if on_gpu else torch.float32,
                                                 device_map={"": "cuda" if on_gpu else "cpu"})
    model = get_peft_model(model, LoraConfig(r=64, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"))
    steps_done = []

    class Track(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            steps_done.append(state.global_step)

    args = TrainingArguments(output_dir="/tmp/late-baseline", per_device_train_batch_size=2, max_steps=cfg.training.max_steps,
                             learning_rate=1e-4, gradient_checkpointing=True, bf16=on_gpu, use_cpu=not on_gpu, logging_steps=10,
                             save_strategy="no", report_to=[], train_sampling_strategy="sequential", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Track()],
                      data_collator=DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100))
    out = {"recipe": "transformers Trainer + peft, DataCollatorForSeq2Seq, bf16, gradient checkpointing"}
    try:
        trainer.train()
        out |= {"completed_steps": steps_done[-1] if steps_done else 0, "oom": False}
    except torch.OutOfMemoryError as e:
        failed = (steps_done[-1] if steps_done else 0) + 1
        out |= {"completed_steps": failed - 1, "oom": True, "oom_at_step": failed, "error": str(e).split("\n")[0][:200]}
    if on_gpu:
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    del trainer, model
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on the embedded default")
    a = ap.parse_args()
    tmp = Path("/tmp/late-long")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    result: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    t0 = time.perf_counter()
    if a.tiny:
        model_dir, n, short, long_len, budget, steps = REPO / "assets" / "tiny-llama", 40, (8, 16), 200, 0.025, 20
    else:
        from random_checkpoints import make_checkpoint

        model_dir = make_checkpoint("qwen2-7b", Path("/tmp/bench-models"))
        n, short, long_len, budget, steps = 400, (512, 1024), 12288, 24.0, 200
    data_file = tmp / "train.jsonl"
    tok = AutoTokenizer.from_pretrained(model_dir)
    per_word = len(tok(" ".join(WORDS * 10), add_special_tokens=False)["input_ids"]) / (10 * len(WORDS))
    write_dataset(data_file, n, short, long_at=n * 3 // 4, long_len=long_len, per_word=per_word)
    cfg_path = write_config(tmp, model_dir, data_file, max_length=2 * long_len, budget=budget, steps=steps)
    result["tokens_per_word"] = per_word
    cfg = load_config(cfg_path)
    result["setup"] = {"samples": n, "short_tokens": short, "long_tokens": long_len, "long_sample_step": n * 3 // 4 // 2 + 1,
                       "micro_batch": 2, "steps": steps, "budget_gib": budget}

    result["baseline"] = baseline(cfg, budget)
    print(json.dumps(result["baseline"]), flush=True)

    fixed, overrides, attempts = cfg, [], []
    for attempt in range(3):  # apply the printed fix until preflight passes
        try:
            pre = preflight.run(fixed, tmp / f"preflight-{attempt}", train_only=True)
            attempts.append({"refused": False, "overrides": list(overrides), "estimate_gib": pre.estimate.total_gib,
                             "probe_gib": pre.probe.peak_reserved_gib if pre.probe else None})
            break
        except preflight.PreflightError as e:
            report = json.loads((tmp / f"preflight-{attempt}" / "preflight.json").read_text())
            fix = preflight.smallest_fix(report["suggestions"])
            attempts.append({"refused": True, "message": str(e), "estimate_gib": report["estimate"]["total_gib"],
                             "probe": report.get("probe"), "fix": fix})
            if fix is None:
                break
            overrides += fix["overrides"]
            fixed = load_config(cfg_path, overrides)
    result["pipeline_preflight"] = attempts
    print(json.dumps(result["pipeline_preflight"])[:2000], flush=True)

    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(budget * GIB / torch.cuda.get_device_properties(0).total_memory)
        torch.cuda.reset_peak_memory_stats()
    r = train.run(fixed, tmp / "train")
    result["pipeline_train"] = {"steps": r.steps, "completed": r.steps == steps, "first_loss": r.first_loss, "final_loss": r.final_loss,
                                "tokens_per_s": r.tokens_per_s, "peak_reserved_gib": r.memory.peak_reserved_gib,
                                "peak_gib": r.memory.peak_gib}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result["pipeline_train"]), flush=True)
    a.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
