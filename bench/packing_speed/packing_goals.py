"""Issue 22's goals on R7 (H200): the stage's defaults against padded peft + Liger and TRL's padding-free packing,
an optimizer step of 32 samples, two long-tailed length distributions.

    PYTHONPATH=/tmp/site:. python3 bench/packing_speed/packing_goals.py --mode qlora --out $OUT/goals_qlora.json
    PYTHONPATH=/tmp/site:. python3 bench/packing_speed/packing_goals.py --mode lora --out $OUT/goals_lora.json --rows baseline stage

R7 (../shared/anchors): random-init Qwen2-7B shapes, LoRA r=64 alpha=32 dropout 0.05 on q/v/o, NF4 (qlora) or bf16
(lora), data.max_length 8192. Samples are random tokens, the first 30% of each a prompt (label -100), so "trained
tokens" are the loss-carrying ones. Two length distributions, the same samples in the same order for every row:

  lognormal  median 512, sigma 1.02 (p99 ~5.5k), capped at 8192
  bimodal    70% ~150 tokens, 28% ~2,500, 2% 5,800-8,200

Rows (each its own process: Liger's class patch and compiled kernels would leak between rows; one model load serves
every run of a row, each run with a fresh optimizer and its own peak):

  baseline    peft + Liger Kernel 0.8.5 (class patch), dynamic padding, micro-batch 4 x accumulation 8 (32 samples a
              step), torch AdamW, bf16 autocast: once with SDPA as torch picks it (cuDNN attention first on Hopper) and
              once with cuDNN attention off (as the stage runs)
  stage       the train stage (stages.train.model.build_model, batches.dataset, hf_trainer.make_trainer) with its
              defaults: packed by samples, micro-batch 4 x accumulation 8 = 32 samples a step, the token budget it
              picks; stage:N sets training.max_tokens_per_batch N (32768: the padded worst case, tiled MLP on)
  trl         TRL 1.16 SFTTrainer: packing (bfd, padding-free), max_length 16384, one packed row x accumulation 2
              (~32 samples a step), use_liger_kernel, gradient checkpointing, bf16, peft LoraConfig (QLoRA: the
              NF4 model as TRL takes it, prepare_model_for_kbit_training included)

Each run trains STEPS optimizer steps; the first is excluded from the rates (compilation, autotuning, allocator
warm-up). Reported per run: loss-carrying tokens/s and all tokens/s over the timed steps, the median step, peak
reserved and allocated, samples per step.
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

STEPS = int(os.environ.get("STEPS", 5))
STEP_SAMPLES, MICRO_BATCH, ACCUM, CAP = 32, 4, 8, 8192
VOCAB = int(os.environ.get("VOCAB", 152064))
SHAPE = os.environ.get("SHAPE", "qwen2-7b")
DISTS = ("lognormal", "bimodal")
# SHAPE=tiny: a dry run of every row's code on CPU (VOCAB=1000 STEPS=3)
TINY = {"tiny": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)}


def lengths(dist: str, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(f"{dist}/{seed}")
    if dist == "lognormal":
        return [max(16, min(CAP, round(512 * math.exp(rng.gauss(0, 1.02))))) for _ in range(n)]
    out = []
    for _ in range(n):
        u = rng.random()
        n_ = rng.gauss(150, 40) if u < 0.70 else rng.gauss(2500, 500) if u < 0.98 else rng.uniform(5800, 8200)
        out.append(max(16, min(CAP, round(n_))))
    return out


def samples(dist: str, n: int = 0) -> list[dict]:
    """The same rows for every run of a distribution: random tokens, the first 30% prompt (no loss)."""
    import torch

    n = n or STEPS * STEP_SAMPLES
    gen = torch.Generator().manual_seed(1 if dist == "lognormal" else 2)
    rows = []
    for i, k in enumerate(lengths(dist, n)):
        ids = torch.randint(3, VOCAB, (k,), generator=gen).tolist()
        cut = max(1, int(0.3 * k))
        rows.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:], "id": f"{dist}{i}"})
    return rows


def describe(rows: list[dict]) -> dict:
    ls = sorted(len(r["input_ids"]) for r in rows)
    return {"samples": len(ls), "mean": round(sum(ls) / len(ls)), "p50": ls[len(ls) // 2], "p99": ls[int(0.99 * len(ls))],
            "max": ls[-1], "tokens": sum(ls)}


def trained(labels) -> int:
    """Loss-carrying tokens of a collated batch: labels other than -100, less the first position of each row (it
    predicts nothing)."""
    return int((labels[..., 1:] != -100).sum())


def rates(times: list[float], tokens: list[int], loss_tokens: list[int], samples_per_step: list[int]) -> dict:
    t = sum(times[1:])
    return {"steps": len(times), "timed_steps": len(times) - 1, "trained_tokens_per_s": round(sum(loss_tokens[1:]) / t),
            "tokens_per_s": round(sum(tokens[1:]) / t), "median_step_s": round(statistics.median(times[1:]), 3),
            "first_step_s": round(times[0], 2), "samples_per_step": samples_per_step}


class Counting:
    """Counts what the model is actually given, from a forward pre-hook on the top-level model: tokens,
    loss-carrying tokens and samples (a packed row's samples are where its position ids restart). A collator
    wrapper would count one micro-batch early: accelerate's dataloader fetches one batch ahead."""

    def __init__(self, model) -> None:
        self.tokens = self.trained = self.samples = 0
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        import torch

        if not torch.is_grad_enabled():
            return
        ids, labels, pos, mask = (kwargs.get(k) for k in ("input_ids", "labels", "position_ids", "attention_mask"))
        if ids is None or labels is None:
            return
        self.tokens += int(mask.sum()) if mask is not None else ids.numel()
        self.trained += trained(labels)
        self.samples += int((pos == 0).sum()) if pos is not None and ids.shape[0] == 1 else ids.shape[0]

    def take(self) -> tuple[int, int, int]:
        got = self.tokens, self.trained, self.samples
        self.tokens = self.trained = self.samples = 0
        return got


def step_timer(counter: Counting):
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.tokens, self.trained, self.samples, self.t = [], [], [], [], None

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.times.append(time.perf_counter() - self.t)
            tok, tr, n = counter.take()
            self.tokens.append(tok)
            self.trained.append(tr)
            self.samples.append(n)

    return Timer()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fresh_peak() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peaks() -> dict:
    import torch

    from stages.memory import GIB

    if not torch.cuda.is_available():
        return {"peak_reserved_gib": 0.0, "peak_alloc_gib": 0.0}
    return {"peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
            "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / GIB, 3)}


def baseline(model_dir: Path, qlora: bool, dists: list[str]) -> dict:
    """peft + Liger Kernel, the anchors' loop, dynamic padding, micro-batch 4 x accumulation 8."""
    import torch
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2

    from bench.train_speed.train_r7 import baseline_model

    apply_liger_kernel_to_qwen2()  # the class patch: fused linear cross-entropy, RMSNorm, SwiGLU, RoPE
    pm = baseline_model(model_dir, qlora)
    out = {}
    for dist in dists:
        rows = samples(dist)
        for cudnn in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)
            fresh_peak()
            times, tokens, loss_tokens, curve = [], [], [], []
            for s in range(0, len(rows), STEP_SAMPLES):
                step = rows[s:s + STEP_SAMPLES]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                n_tok = n_tr = 0
                for m in range(0, len(step), MICRO_BATCH):
                    group = step[m:m + MICRO_BATCH]
                    width = max(len(r["input_ids"]) for r in group)
                    ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in group], device="cuda")
                    labels = torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in group], device="cuda")
                    mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in group], device="cuda")
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = pm(input_ids=ids, attention_mask=mask, labels=labels).loss
                    (loss / ACCUM).backward()
                    n_tok += sum(len(r["input_ids"]) for r in group)
                    n_tr += trained(labels)
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                tokens.append(n_tok)
                loss_tokens.append(n_tr)
                curve.append(round(loss.item(), 4))
            out[f"{dist}:{'cudnn' if cudnn else 'no-cudnn'}"] = {
                **rates(times, tokens, loss_tokens, [STEP_SAMPLES] * len(times)), **peaks(), "loss": curve}
            del opt
    out["recipe"] = ("peft + Liger Kernel 0.8.5 (class patch), dynamic padding, micro-batch 4 x accumulation 8, torch AdamW, "
                     "bf16 autocast, gradient checkpointing; cudnn: SDPA as torch picks it, no-cudnn: cuDNN attention off")
    return out


def stage_config(model_dir: Path, qlora: bool, **training):
    from stages.config import RunConfig

    return RunConfig.model_validate({
        "model": {"name_or_path": str(model_dir), "torch_dtype": "bfloat16"},
        "data": {"train_file": str(REPO / "assets/data/translate_train.jsonl"), "max_length": CAP},
        "lora": {"r": 64, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj", "o_proj"], "lora_dropout": 0.05},
        "quantization": {"load_in_4bit": qlora},
        "training": {"per_device_train_batch_size": MICRO_BATCH, "gradient_accumulation_steps": ACCUM, "max_steps": STEPS,
                     "logging_steps": 1, **training},
        "handoff": {"dir": "/tmp/bench-handoff", "model_name": "r7-bench"},
    })


def stage(model_dir: Path, qlora: bool, dist: str, budget: int | None) -> dict:
    """The train stage's own path (train.run without tokenization, evals or checkpoints): its model, plan, Trainer."""
    from stages.train import batches, hf_trainer, kernels
    from stages.train import model as lora_model

    cfg = stage_config(model_dir, qlora, **({"max_tokens_per_batch": budget} if budget else {}))
    rows = samples(dist)
    longest = max(len(r["input_ids"]) for r in rows)
    packed = kernels.settings(cfg).packing
    train_data, plan = batches.dataset(cfg, rows, packed)
    collator = (batches.PackedCollator(varlen=kernels.settings(cfg).packed_attention == "varlen") if packed
                else batches.Collator(0))
    model = lora_model.build_model(cfg, longest)
    fresh_peak()
    timer = step_timer(Counting(model))
    trainer = hf_trainer.make_trainer(cfg, model, train_data, collator, Path("/tmp/bench-train"), callbacks=[timer],
                                      save_strategy="no", disable_tqdm=True)
    trainer.train()
    loss = [round(e["loss"], 4) for e in trainer.state.log_history if "loss" in e]
    return {dist: {**rates(timer.times, timer.tokens, timer.trained, timer.samples), **peaks(), "loss": loss,
                   "settings": kernels.resolve_auto(cfg, on_gpu=True, longest=longest), "plan": plan.__dict__,
                   "token_budget": batches.token_budget(cfg)}}


def trl_row(model_dir: Path, qlora: bool, dists: list[str]) -> dict:
    """TRL's SFTTrainer with padding-free packing, as its docs set it up."""
    import datasets
    import torch
    import trl
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token or tok.eos_token
    out = {"recipe": f"TRL {trl.__version__} SFTTrainer: packing bfd (padding-free), max_length 16384, batch 1 x accumulation 2, "
                     "use_liger_kernel, gradient checkpointing, bf16, peft LoraConfig r64 q/v/o"}
    for dist in dists:
        rows = samples(dist, 3 * STEPS * STEP_SAMPLES)  # the others' rows first; more, so that every packed step is full
        ds = datasets.Dataset.from_list([{"input_ids": r["input_ids"],
                                          "completion_mask": [0 if t == -100 else 1 for t in r["labels"]]} for r in rows])
        kw = {"dtype": torch.bfloat16, "attn_implementation": "sdpa", "device_map": {"": 0} if torch.cuda.is_available() else None}
        if qlora:
            kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
        args = trl.SFTConfig(output_dir="/tmp/bench-trl", max_steps=STEPS, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                             learning_rate=1e-4, logging_steps=1, bf16=torch.cuda.is_available(), gradient_checkpointing=True, use_liger_kernel=torch.cuda.is_available(),
                             packing=True, packing_strategy="bfd", padding_free=True, max_length=16384, completion_only_loss=True,
                             report_to="none", save_strategy="no", disable_tqdm=True, optim="adamw_torch", dataloader_num_workers=0,
                             seed=0)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                                 peft_config=LoraConfig(r=64, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "v_proj", "o_proj"],
                                                        task_type="CAUSAL_LM"))
        timer = step_timer(Counting(trainer.model))
        trainer.add_callback(timer)
        fresh_peak()
        trainer.train()
        out[dist] = {**rates(timer.times, timer.tokens, timer.trained, timer.samples), **peaks(),
                     "loss": [round(e["loss"], 4) for e in trainer.state.log_history if "loss" in e]}
        del trainer, model
        fresh_peak()
    return out


def run_row(row: str, mode: str, model_dir: Path, dists: list[str]) -> dict:
    kind, _, arg = row.partition(":")
    qlora = mode == "qlora"
    if kind == "baseline":
        return baseline(model_dir, qlora, dists)
    if kind == "trl":
        return trl_row(model_dir, qlora, dists)
    if kind == "stage":
        return stage(model_dir, qlora, dists[0], int(arg) if arg else None)
    raise SystemExit(f"unknown row {row}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["qlora", "lora"], default="qlora")
    ap.add_argument("--rows", nargs="*", default=["stage", "stage:32768", "baseline", "trl"],
                    help="baseline, trl, stage[:BUDGET]; a stage row runs each distribution in its own process")
    ap.add_argument("--dists", nargs="*", default=list(DISTS))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", type=Path, default=Path("/tmp/bench-models"))
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row in this process
    ap.add_argument("--row-timeout", type=float, default=240)
    a = ap.parse_args()
    from bench.gpu_figure.random_checkpoints import make_checkpoint

    model_dir = make_checkpoint(SHAPE, a.models, TINY if SHAPE in TINY else None)
    if a.row:
        a.out.write_text(json.dumps(run_row(a.row, a.mode, model_dir, a.dists)))
        return
    import torch

    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "mode": a.mode, "shape": SHAPE, "steps": STEPS, "samples_per_step": STEP_SAMPLES,
              "data": {d: describe(samples(d)) for d in a.dists}, "rows": {}}
    # a stage row runs each distribution in its own process; stage:N@lognormal names one
    jobs = [(row.split("@")[0], [d]) if row.startswith("stage") else (row, a.dists) for row in a.rows
            for d in (([row.split("@")[1]] if "@" in row else a.dists) if row.startswith("stage") else [None])]
    for row, dists in jobs:
        name = row if not row.startswith("stage") else f"{row}@{dists[0]}"
        part = a.out.with_suffix(f".{name.replace(':', '-').replace('@', '-')}.json")
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--mode", a.mode, "--row", row, "--dists", *dists, "--out", str(part),
                                "--models", str(a.models)], timeout=a.row_timeout, capture_output=True, text=True, env=os.environ)
            got = json.loads(part.read_text()) if p.returncode == 0 else {"error": p.stderr[-2500:]}
        except subprocess.TimeoutExpired:
            got = {"error": f"over {a.row_timeout} s"}
        got["wall_s"] = round(time.perf_counter() - t0, 1)
        result["rows"][name] = got
        print(name, json.dumps({k: ({kk: vv for kk, vv in v.items() if kk in ("trained_tokens_per_s", "peak_reserved_gib", "token_budget")}
                                    if isinstance(v, dict) else v) for k, v in got.items()})[:900], flush=True)
        a.out.write_text(json.dumps(result, indent=1))
    result["summary"] = summary(result)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


def summary(result: dict) -> dict:
    """Per distribution: each run's loss-carrying tokens/s, its ratio to the baselines and to TRL, and its peak
    reserved over TRL's."""
    out = {}
    for dist in result["data"]:
        runs = {}
        for name, r in result["rows"].items():
            for key, v in r.items():
                if isinstance(v, dict) and "trained_tokens_per_s" in v and key.split(":")[0] == dist:
                    runs[name.split("@")[0] + (":" + key.split(":")[1] if ":" in key else "")] = v
        base = {k: runs[k]["trained_tokens_per_s"] for k in ("baseline:cudnn", "baseline:no-cudnn") if k in runs}
        trl_run = runs.get("trl")
        out[dist] = {k: {"trained_tokens_per_s": v["trained_tokens_per_s"], "peak_reserved_gib": v["peak_reserved_gib"],
                         **{f"x {b}": round(v["trained_tokens_per_s"] / t, 2) for b, t in base.items()},
                         **({"x trl": round(v["trained_tokens_per_s"] / trl_run["trained_tokens_per_s"], 2),
                             "reserved / trl's": round(v["peak_reserved_gib"] / max(trl_run["peak_reserved_gib"], 1e-9), 2)} if trl_run else {})}
                     for k, v in runs.items()}
    return out


if __name__ == "__main__":
    main()
