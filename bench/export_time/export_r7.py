"""The export side on an R7-shaped model: merge -> convert -> Q4_K_M, Q5_K_S -> fidelity -> smoke.

    PYTHONPATH=. python3 bench/export_time/export_r7.py --out $OUT/export_r7.json                  # H200, CUDA llama.cpp
    PYTHONPATH=. python bench/export_time/export_r7.py --shape tiny-llama --out /tmp/export.json   # CPU dry run

A random-init checkpoint with R7's (Qwen2-7B) shapes (sizes and times depend on shapes, not values)
with the tiny default's SentencePiece tokenizer, and a random QLoRA adapter (r=64 on
q/v/o, B small and not zero so the merge changes weights). Then the pipeline's own stage functions,
in order, each timed, with its memory report: merge (both QLoRA choices measured),
export (official converter, both quantizations, tokenizer and fidelity checks), smoke
under an 8 GiB serving budget. Random weights neither stop at EOS nor agree on near-tie
argmaxes, so the smoke and fidelity gates are opened (their figures are still recorded):
this run measures time and memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.gpu_figure.random_checkpoints import SHAPES, make_checkpoint  # noqa: E402
from stages import export, memory, merge, smoke  # noqa: E402  # noqa: E402
from stages.config import RunConfig  # noqa: E402

# R7's shapes in the Llama architecture (Qwen2 differs only by q/k/v biases: same matrices,
# same sizes). The tiny SentencePiece tokenizer inside a qwen2 GGUF gets llama.cpp's
# space-after-special-token rule, which export's tokenization check rightly refuses; a
# real Qwen2 ships a BPE tokenizer and does not meet that case.
SHAPES = SHAPES | {
    "r7-llama": SHAPES["qwen2-7b"] | dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "tiny-llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                       max_position_embeddings=2048, tie_word_embeddings=False),
}


def make_model(shape: str, root: Path) -> Path:
    if (root / shape).is_dir() and not any((root / shape).glob("*.safetensors")):
        shutil.rmtree(root / shape)  # an earlier --free-disk run deleted its weights
    # the tiny SentencePiece tokenizer's ids (the converter reads them from config.json)
    return make_checkpoint(shape, root, SHAPES, bos_token_id=1, eos_token_id=2)


def make_adapter(model_dir: Path, out: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (out / "adapter_config.json").is_file():
        return out
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map={"": "cuda" if torch.cuda.is_available() else "cpu"})
    torch.manual_seed(1)
    pm = get_peft_model(base, LoraConfig(r=64, lora_alpha=32, target_modules=["q_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"))
    for n, p in pm.named_parameters():  # a trained adapter's B is small, not zero (zero would make the merge a no-op)
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=2e-3)
    pm.save_pretrained(out)
    del pm, base
    gc.collect()
    return out


def config(model_dir: Path, work: Path) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"name_or_path": str(model_dir), "torch_dtype": "bfloat16"},
        "data": {"train_file": str(REPO / "assets/data/translate_train.jsonl"), "eval_file": str(REPO / "assets/data/translate_eval.jsonl")},
        "lora": {"r": 64, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj", "o_proj"]},
        "quantization": {"load_in_4bit": True},
        "merge": {"samples": 4},
        "export": {"fidelity": {"samples": 2, "max_mean_kl": {"default": 1e9}, "min_top1": {"default": 0.0}}},
        "smoke": {"gpu_memory_gib": 8, "n_ctx": 2048, "max_tokens": 32, "max_prompts": 3, "check": "stops", "min_accuracy": 0.0},
        "handoff": {"model_name": "bench"},
        "artifacts_dir": str(work),
    })


def wait_for(path: Path | None, limit: float = 480) -> float:
    t = time.perf_counter()
    while path is not None and not path.exists():
        if path.with_suffix(".failed").exists() or time.perf_counter() - t > limit:
            raise SystemExit(f"llama.cpp build did not finish: see build.log ({path})")
        time.sleep(2)
    return round(time.perf_counter() - t, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="r7-llama", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-export"))
    ap.add_argument("--wait-for", type=Path, help="before export, wait for this file (a llama.cpp build running meanwhile)")
    ap.add_argument("--free-disk", action="store_true", help="delete the base weights once merged (a 64 GB disk)")
    a = ap.parse_args()
    report: dict = {"shape": a.shape, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "stages": {}}

    def save():
        a.out.write_text(json.dumps(report, indent=1, default=str))

    t0 = time.perf_counter()
    model_dir = make_model(a.shape, a.work / "models")
    adapter = make_adapter(model_dir, a.work / "adapter")
    report["setup_s"] = round(time.perf_counter() - t0, 1)
    cfg = config(model_dir, a.work)
    shutil.rmtree(a.work / "run", ignore_errors=True)
    # the build runs on the same CPUs: wait for it so that it does not slow the export side down
    report["waited_for_llama_cpp_s"] = wait_for(a.wait_for)
    export_cfg = cfg
    export_side = time.perf_counter()
    steps = [
        ("merge", lambda: merge.run(cfg, adapter, a.work / "run" / "merge")),
        ("export", lambda: export.run(export_cfg, a.work / "run" / "merge" / "model", a.work / "run" / "export")),
        ("smoke", lambda: smoke.run(cfg, [(f.quant, f.path) for f in report["_export"].files], a.work / "run" / "smoke")),
    ]
    for name, fn in steps:
        if name == "export":
            if a.free_disk:  # the merged model carries the same tokenizer files, which export compares the GGUFs with
                for f in model_dir.glob("*.safetensors"):
                    f.unlink()
                export_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": str(a.work / "run" / "merge" / "model")})})
            import llama_cpp

            report |= {"llama_cpp_python": llama_cpp.__version__, "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload())}
        t = time.perf_counter()
        try:
            r = fn()
        except Exception as e:  # record and stop: later stages need this one's output
            import traceback

            traceback.print_exc()
            report["stages"][name] = {"error": f"{type(e).__name__}: {str(e)[:600]}", "wall_s": round(time.perf_counter() - t, 1)}
            save()
            break
        if name == "export":
            report["_export"] = r
        row = memory.jsonable(r)
        row["wall_s"] = round(time.perf_counter() - t, 1)
        report["stages"][name] = row
        print(json.dumps({name: {k: row.get(k) for k in ("wall_s", "base", "kl", "seconds", "fidelity")}}, default=str)[:3000], flush=True)
        save()
    report.pop("_export", None)
    report["export_side_s"] = round(time.perf_counter() - export_side, 1)
    report["goal_s"] = 180
    save()
    print(json.dumps({k: report.get(k) for k in ("export_side_s", "setup_s", "gpu_offload", "waited_for_llama_cpp_s")}))


if __name__ == "__main__":
    main()
