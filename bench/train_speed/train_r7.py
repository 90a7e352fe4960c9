"""Training stage vs the plain-peft and peft+Liger baselines on R7, in one GPU run.

    PYTHONPATH=. python3 bench/train_speed/train_r7.py --out $OUT/train_r7.json

R7 (../shared/anchors): random-init Qwen2-7B shapes, LoRA r=64 alpha=32 dropout 0.05 on
q/v/o, non-reentrant checkpointing, random tokens. Rows:

  baseline   the anchors' hand-written loop (torch AdamW, bf16 autocast): plain peft, then
             peft + Liger Kernel patched on the class (the off-the-shelf floor), run last
             because Liger's class patch would leak into everything built after it.
  stage      stages.train.model.build_model + stages.train.hf_trainer.make_trainer (the HF Trainer exactly as
             the train stage runs it) on fixed-length rows, with the stage's defaults
             (fit: memory) or fit: speed under a 24 GiB budget; ablations toggle one hardened
             default at a time on the same model.

Peak = torch's peak reserved over the run; tokens/s = tokens per optimizer step / median
step time (steps after the first). Rows go to --out as they finish.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.gpu_figure.random_checkpoints import make_checkpoint  # noqa: E402
from stages import train  # noqa: E402
from stages.config import RunConfig  # noqa: E402
from stages.memory import GIB  # noqa: E402
from stages.train import batches, hf_trainer, kernels  # noqa: E402
from stages.train import model as lora_model  # noqa: E402

QVO = ["q_proj", "v_proj", "o_proj"]
VOCAB = 152064
T0 = time.perf_counter()
ROWS: list[dict] = []
PARTS = ["plain", "qlora", "ablations", "speed", "long", "bf16", "liger"]


def emit(out: Path, row: dict) -> None:
    row["t"] = round(time.perf_counter() - T0, 1)
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": ROWS}, indent=1))


def clean() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


# --- baselines: the anchors' loop ---------------------------------------------------------

def baseline_model(model_dir: Path, qlora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kw = {}
    if qlora:
        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                                       bnb_4bit_compute_dtype=torch.bfloat16)
    m = AutoModelForCausalLM.from_pretrained(model_dir, device_map={"": 0}, dtype=torch.bfloat16, attn_implementation="sdpa", **kw)
    m.config.use_cache = False
    m.train()
    pm = get_peft_model(m, LoraConfig(r=64, lora_alpha=32, target_modules=QVO, lora_dropout=0.05, task_type="CAUSAL_LM"))
    pm.train()
    pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pm.enable_input_require_grads()
    return pm


def baseline_run(pm, bs: int, seq: int, steps: int = 4) -> dict:
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)
    clean()
    times = []
    try:
        for _ in range(steps):
            x = torch.randint(0, VOCAB, (bs, seq), device="cuda")
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = pm(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times[1:])
        return {"peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
                "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
                "tokens_per_s": round(bs * seq / med), "step_s": round(med, 3), "loss": round(loss.item(), 3)}
    except torch.OutOfMemoryError as e:
        return {"error": "OOM: " + str(e).split("\n")[0][:200]}
    finally:
        del opt
        clean()


# --- this stage -----------------------------------------------------------------------------

def stage_config(model_dir: Path, qlora: bool, **training) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"name_or_path": str(model_dir), "torch_dtype": "bfloat16"},
        "data": {"train_file": str(REPO / "assets/data/translate_train.jsonl"), "max_length": 4096},
        "lora": {"r": 64, "lora_alpha": 32, "target_modules": QVO, "lora_dropout": 0.05},
        "quantization": {"load_in_4bit": qlora},
        "training": {"per_device_train_batch_size": 2, "learning_rate": 1e-4, "max_steps": 5, "save_steps": 10_000,
                     "logging_steps": 1000, "fit": "memory", **training},
        "preflight": {"gpu_memory_gib": 24},
        "handoff": {"model_name": "bench"},
        "artifacts_dir": "/tmp/bench-artifacts",
    })


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.t = None

    def on_step_begin(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t)


class RowsPacked(batches.PackedCollator):
    """A padded micro-batch's rows laid end to end, as the stage's packed plan would lay them (this bench hands the
    Trainer rows, not the plan's packed items)."""

    def __call__(self, batch: list[dict]) -> dict:
        return self._counted(batch)


def stage_collator(cfg: RunConfig):
    """The collation the stage's settings ask for: packed with varlen attention where it packs (the default on a
    GPU: its varlen attention refuses a padded batch), else padded."""
    s = kernels.settings(cfg)
    return RowsPacked(varlen=s.packed_attention == "varlen") if s.packing else batches.Collator(0)


def stage_run(cfg: RunConfig, model, bs: int, seq: int, steps: int = 5, **overrides) -> dict:
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(3, VOCAB, (seq,), generator=gen).tolist()), "labels": ids} for _ in range(bs * steps)]
    clean()
    timer = StepTimer()
    trainer = hf_trainer.make_trainer(cfg, model, rows, stage_collator(cfg), Path("/tmp/bench-train"), callbacks=[timer],
                                 per_device_train_batch_size=bs, max_steps=steps, save_strategy="no", disable_tqdm=True,
                                 logging_first_step=False, **overrides)
    try:
        trainer.train()
        med = statistics.median(timer.times[1:])
        out = {"peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
               "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
               "tokens_per_s": round(bs * seq / med), "step_s": round(med, 3), "first_step_s": round(timer.times[0], 2),
               "optim": trainer.args.optim.value if hasattr(trainer.args.optim, "value") else str(trainer.args.optim)}
        if trainer.offload is not None:
            out["offloaded_gib_per_microbatch"] = round(trainer.offload.offloaded_bytes / GIB / (steps * 1), 3)
        return out
    except torch.OutOfMemoryError as e:
        return {"error": "OOM: " + str(e).split("\n")[0][:200]}
    except Exception as e:  # one broken row must not cost the others
        import traceback

        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        del trainer
        clean()


def upcast_norms(model, dtype) -> int:
    n = 0
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.to(dtype)
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-seconds", type=float, default=560)
    ap.add_argument("--long", type=int, nargs="*", default=[65536, 98304, 131072, 163840])
    ap.add_argument("--parts", nargs="*", default=PARTS, choices=PARTS)
    a = ap.parse_args()
    out = a.out
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    model_dir = make_checkpoint("qwen2-7b", Path("/tmp/bench-models"))
    emit(out, {"name": "setup", "note": "random-init Qwen2-7B checkpoint written"})
    budget_left = lambda: a.max_seconds - (time.perf_counter() - T0)  # noqa: E731

    # 1. plain peft, the anchors' recipe
    for mode in ("bf16", "qlora") if "plain" in a.parts else ():
        pm = baseline_model(model_dir, mode == "qlora")
        emit(out, {"name": "peft (anchors' recipe)", "mode": mode, "seq": 4096, "micro_batch": 2, "baseline": True,
                   **baseline_run(pm, 2, 4096)})
        del pm
        clean()

    # 2. this stage, QLoRA: defaults, ablations on the same model, fit: speed, longest context
    cfg = stage_config(model_dir, True)
    model = lora_model.build_model(cfg)
    emit(out, {"name": "stage (defaults: fit memory)", "mode": "qlora", "seq": 4096, "micro_batch": 2, "baseline": False,
               "fit": "memory", "offload_activations": True, "offload_embeddings": kernels.settings(cfg).offload_embeddings,
               **stage_run(cfg, model, 2, 4096)})
    if "qlora" in a.parts:
        del model
        clean()
        ce = stage_config(model_dir, True, offload_embeddings="off")
        model = lora_model.build_model(ce)
        emit(out, {"name": "ablation: embeddings on the GPU", "mode": "qlora", "seq": 4096, "micro_batch": 2, "baseline": False,
                   **stage_run(ce, model, 2, 4096)})
    if "ablations" not in a.parts:
        ablations = []
    else:
        ablations = [
            ("ablation: no activation offload", {"offload_activations": "off"}, {}),
            ("ablation: fused AdamW (fp32 states)", {"optim": "adamw_torch_fused"}, {}),
            ("ablation: torch AdamW (not fused)", {"optim": "adamw_torch"}, {}),
            ("ablation: token count through Trainer (.item() per micro-batch)", {}, {"include_num_input_tokens_seen": "non_padding"}),
        ]
    for name, training, overrides in ablations:
        c = stage_config(model_dir, True, **training)
        emit(out, {"name": name, "mode": "qlora", "seq": 4096, "micro_batch": 2, "baseline": False, **stage_run(c, model, 2, 4096, **overrides)})
    if "ablations" in a.parts:
        # torch's own save_on_cpu instead of the side-stream offload
        c = stage_config(model_dir, True, offload_activations="off")
        orig = hf_trainer.make_trainer

        def with_save_on_cpu(*args, **kw):
            t = orig(*args, **kw)
            base = t.compute_loss_context_manager

            def ctx():
                stack = base()
                stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=True))
                return stack
            t.compute_loss_context_manager = ctx
            return t
        hf_trainer.make_trainer = with_save_on_cpu
        emit(out, {"name": "ablation: torch.autograd.graph.save_on_cpu offload", "mode": "qlora", "seq": 4096, "micro_batch": 2,
                   "baseline": False, **stage_run(c, model, 2, 4096)})
        hf_trainer.make_trainer = orig
        # the same model in the anchors' hand loop: what the Trainer itself costs
        emit(out, {"name": "ablation: stage model in the anchors' hand loop (no Trainer, no offload)", "mode": "qlora", "seq": 4096,
                   "micro_batch": 2, "baseline": False, **baseline_run(model, 2, 4096)})
        n = upcast_norms(model, torch.float32)
        emit(out, {"name": f"ablation: fp32 RMSNorm weights ({n} norms)", "mode": "qlora", "seq": 4096, "micro_batch": 2, "baseline": False,
                   **stage_run(cfg, model, 2, 4096)})
        upcast_norms(model, torch.bfloat16)

    if "speed" in a.parts:
        # fit: speed under 24 GiB, chosen by the stage's own measurement
        cs = stage_config(model_dir, True, fit="speed")
        gen = torch.Generator().manual_seed(1)
        rows = [{"input_ids": (ids := torch.randint(3, VOCAB, (4096,), generator=gen).tolist()), "labels": ids} for _ in range(2)]
        torch.cuda.set_per_process_memory_fraction(24 / total)
        fit = train.choose_fit(cs, model, rows, stage_collator(cs), Path("/tmp/bench-train"))
        emit(out, {"name": "stage (fit speed, 24 GiB budget)", "mode": "qlora", "seq": 4096, "micro_batch": 2, "baseline": False,
                   "fit": "speed", "checkpointed_layers": fit.checkpointed_layers, "fit_reason": fit.reason, "fit_measured": fit.measured,
                   **stage_run(cs, model, 2, 4096)})
        lora_model.checkpoint_only(model, fit.total_layers)

    # longest context under 24 GiB (process capped), micro-batch 1, defaults; without tiled MLP first
    for tiled, seqs in ((False, [65536]), (True, a.long)) if "long" in a.parts else ():
        kernels.tile_mlp(model, tiled)
        for seq in seqs:
            if budget_left() < 120:
                emit(out, {"name": "long context", "seq": seq, "tiled_mlp": tiled, "skipped": "time limit"})
                break
            r = stage_run(cfg, model, 1, seq, steps=2)
            emit(out, {"name": "stage long context (24 GiB cap)", "mode": "qlora", "seq": seq, "micro_batch": 1, "baseline": False,
                       "tiled_mlp": tiled, **r})
            if "error" in r:
                break
    kernels.tile_mlp(model, False)
    torch.cuda.set_per_process_memory_fraction(1.0)
    del model
    clean()

    # 3. this stage, bf16 LoRA
    if "bf16" in a.parts:
        cb = stage_config(model_dir, False)
        model = lora_model.build_model(cb)
        emit(out, {"name": "stage (defaults: fit memory)", "mode": "bf16", "seq": 4096, "micro_batch": 2, "baseline": False,
                   "offload_embeddings": kernels.settings(cb).offload_embeddings, **stage_run(cb, model, 2, 4096)})
        del model
        clean()
        cb = stage_config(model_dir, False, offload_embeddings="off")
        model = lora_model.build_model(cb)
        emit(out, {"name": "ablation: embeddings on the GPU", "mode": "bf16", "seq": 4096, "micro_batch": 2, "baseline": False,
                   **stage_run(cb, model, 2, 4096)})
        del model
        clean()

    # 4. peft + Liger Kernel (class patch, as in the anchors), last
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2

    apply_liger_kernel_to_qwen2(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True)
    for mode in ("qlora", "bf16") if "liger" in a.parts else ():
        if budget_left() < 45:
            emit(out, {"name": "peft + Liger", "mode": mode, "skipped": "time limit"})
            continue
        pm = baseline_model(model_dir, mode == "qlora")
        emit(out, {"name": "peft + Liger Kernel 0.8.5", "mode": mode, "seq": 4096, "micro_batch": 2, "baseline": True,
                   **baseline_run(pm, 2, 4096)})
        del pm
        clean()


if __name__ == "__main__":
    main()
