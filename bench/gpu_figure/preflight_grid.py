"""Preflight accuracy on a GPU: analytic estimate vs probe vs 20 real training steps.

    PYTHONPATH=. python bench/gpu_figure/preflight_grid.py --shape qwen2-7b --out $OUT/grid_qwen2-7b.json

For one model shape: a random-init checkpoint is written to local disk (memory depends on
shapes, not values), with the tiny default's SentencePiece tokenizer beside it so the
pipeline's own loaders work. Then, for every config of the grid, through the pipeline's
own code paths:
  estimate   stages.train.memory_model.estimate (re-computed offline by preflight_grid_report.py)
  probe      stages.preflight.probe: two optimizer steps on the worst padded micro-batch
  measured   stages.train.hf_trainer.make_trainer: 20 steps on rows of random length in [seq/2, seq],
             one of them exactly seq, padded dynamically as in training; peak reserved.
Rows go to --out as they finish, so a run stopped by its time limit keeps what it measured.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from stages import preflight  # noqa: E402
from stages.config import RunConfig  # noqa: E402
from stages.memory import GIB  # noqa: E402
from stages.train import batches, hf_trainer, memory_model  # noqa: E402
from stages.train import model as lora_model  # noqa: E402

SHAPES = {
    # ../shared/anchors: R7
    "qwen2-7b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                     max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False),
    # Llama-3-8B shapes: 128k vocabulary
    "llama-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     max_position_embeddings=32768, rope_theta=5e5, tie_word_embeddings=False),
    # Qwen2.5-1.5B shapes: tied 152k table, 6:1 GQA
    "qwen2.5-1.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=131072, rope_theta=1e6, tie_word_embeddings=True),
    # Llama-3.2-3B shapes: tied 128k table, 3:1 GQA, head_dim 128
    "llama-3b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=3072, intermediate_size=8192,
                     num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                     max_position_embeddings=131072, rope_theta=5e5, tie_word_embeddings=True),
    # Mistral-7B shapes: untied 32k table, 4:1 GQA
    "mistral-7b": dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                       max_position_embeddings=131072, rope_theta=1e6, tie_word_embeddings=False, sliding_window=None),
    # held out of the fit: SmolLM2-360M shapes (width 960, not a multiple of 256; tied 49k table, 3:1 GQA)
    "smollm2-360m": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=960, intermediate_size=2560,
                         num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5, vocab_size=49152,
                         max_position_embeddings=131072, rope_theta=1e5, tie_word_embeddings=True),
    # held out of the fit: Qwen2.5-0.5B shapes (width 896, 7:1 GQA, tied 152k table)
    "qwen2.5-0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=131072, rope_theta=1e6, tie_word_embeddings=True),
    # tiny shapes for CPU dry runs of the GPU scripts
    "tiny-tied": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=160,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True),
    "tiny-untied": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=160,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False),
}
QVO = ["q_proj", "v_proj", "o_proj"]
# (quant, r, targets, seq, micro-batch, checkpointing, cross-entropy)
GRID = [
    ("bf16", 64, QVO, 4096, 2, True, "plain"),
    ("bf16", 64, QVO, 4096, 2, True, "chunked"),
    ("bf16", 16, "all-linear", 4096, 2, True, "chunked"),
    ("bf16", 64, QVO, 4096, 2, False, "chunked"),
    ("bf16", 64, QVO, 1024, 4, True, "plain"),
    ("bf16", 16, "all-linear", 16384, 1, True, "chunked"),
    ("bf16", 64, QVO, 4096, 1, True, "plain"),
    ("nf4", 64, QVO, 4096, 2, True, "plain"),
    ("nf4", 64, QVO, 4096, 2, True, "chunked"),
    ("nf4", 16, "all-linear", 4096, 2, True, "chunked"),
    ("nf4", 64, QVO, 16384, 1, True, "chunked"),
    ("nf4", 64, QVO, 1024, 4, False, "plain"),
    ("nf4", 16, "all-linear", 1024, 1, False, "chunked"),
    ("nf4", 64, "all-linear", 4096, 4, True, "chunked"),
]


def make_checkpoint(shape: str, root: Path, shapes: dict | None = None, sparse: bool = False, **config_overrides) -> Path:
    """A random-init bf16 checkpoint of `shape` (from `shapes`, default SHAPES) with the tiny default's tokenizer;
    `sparse`: its data a hole that reads as zeros (sparse_checkpoint.py: a load then randomizes the weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / shape
    if (out / "config.json").is_file():
        return out
    spec = dict((shapes or SHAPES)[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **{k: v for k, v in spec.items() if k != "architectures"})
    config.architectures = spec["architectures"]
    for k, v in config_overrides.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    if sparse:
        import sparse_checkpoint

        sparse_checkpoint.write(config, out)
    else:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(out, max_shard_size="5GB")
        del model
    gc.collect()
    torch.cuda.empty_cache()
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(REPO / "assets" / "tiny-llama" / f, out / f)
    if config.model_type in ("mistral", "mixtral", "phi3"):   # read by a generic class: the tokenizer.json releases ship
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama").save_pretrained(out)
    return out


def run_config(model_dir: Path, row: tuple) -> RunConfig:
    quant, r, targets, seq, mb, ckpt, ce = row
    return RunConfig.model_validate({
        "model": {"name_or_path": str(model_dir), "torch_dtype": "bfloat16"},
        "data": {"train_file": str(REPO / "assets/data/translate_train.jsonl"), "max_length": seq},
        "lora": {"r": r, "lora_alpha": 32, "target_modules": targets, "lora_dropout": 0.05 if targets == QVO else 0.0},
        "quantization": {"load_in_4bit": quant == "nf4"},
        # measured before the offloads, Liger norms/SwiGLU, tiled MLP and 8-bit default existed: the grid's rows are that recipe
        "training": {"per_device_train_batch_size": mb, "gradient_checkpointing": ckpt, "cross_entropy": ce,
                     "offload_activations": "off", "offload_embeddings": "off", "fused_kernels": "off", "tiled_mlp": "off",
                     "optim": "adamw_torch",
                     "max_steps": 20, "learning_rate": 1e-4, "logging_steps": 5, "save_steps": 1000},
        "handoff": {"model_name": "bench"},
        "artifacts_dir": "/tmp/bench-artifacts",
    })


def measure(cfg: RunConfig, seq: int, vocab: int, steps: int = 20) -> dict:
    """20 Trainer steps on variable-length rows (one of exactly `seq` tokens)."""
    b = cfg.training.per_device_train_batch_size
    rng = random.Random(0)
    lengths = [rng.randint(seq // 2, seq - 1) for _ in range(steps * b)]
    lengths[rng.randrange(len(lengths))] = seq
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = lora_model.build_model(cfg)
    weights = torch.cuda.memory_allocated() / GIB
    trainer = hf_trainer.make_trainer(cfg, model, rows, batches.Collator(0), Path("/tmp/bench-train"), max_steps=steps, save_strategy="no",
                                 logging_steps=5, disable_tqdm=True)
    t0 = time.perf_counter()
    trainer.train()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out = {
        "measured_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "measured_alloc_gib": torch.cuda.max_memory_allocated() / GIB,
        "weights_alloc_gib": weights,
        "tokens_per_s": sum(lengths) / wall,
        "steps": trainer.state.global_step,
    }
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-seconds", type=float, default=540)
    ap.add_argument("--only", type=int, nargs="*", help="grid row indices")
    a = ap.parse_args()
    t_start = time.perf_counter()
    model_dir = make_checkpoint(a.shape, Path("/tmp/bench-models"))
    shapes = memory_model.Shapes.from_config(json.loads((model_dir / "config.json").read_text()))
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    rows = []
    for i, spec in enumerate(GRID):
        if a.only and i not in a.only:
            continue
        if time.perf_counter() - t_start > a.max_seconds:
            print(f"time limit: stopping before row {i}", flush=True)
            break
        cfg = run_config(model_dir, spec)
        quant, r, targets, seq, mb, ckpt, ce = spec
        row = {"model": a.shape, "index": i, "config": {"quant": quant, "r": r, "target_modules": targets, "seq": seq,
               "micro_batch": mb, "gradient_checkpointing": ckpt, "cross_entropy": ce,
               "lora_dropout": cfg.lora.lora_dropout}}
        t0 = time.perf_counter()
        try:
            row["estimate_gib_at_run"] = memory_model.estimate(cfg, shapes, seq, on_gpu=True).total_gib
            p = preflight.probe(cfg, seq, total, Path("/tmp/bench-probe"))
            row |= {"probe_gib": p.peak_reserved_gib, "probe_alloc_gib": p.peak_alloc_gib, "probe_ok": p.ok}
            row |= measure(cfg, seq, shapes.vocab)
        except Exception as e:  # one bad row must not cost the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            gc.collect()
            torch.cuda.empty_cache()
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
