"""Preflight accuracy on the defaults users get (issue 12): estimate vs probe vs real training steps.

    python3 bench/gpu_figure/memory_grid.py --groups 0 1 2 --out $OUT/memory_grid.json --max-seconds 400

Every `auto` training default on (host embeddings, offloaded layer inputs, Liger kernels and
fused linear cross-entropy, 8-bit paged AdamW, the tiled MLP from 32k tokens per micro-batch).
A group is one model build (shape, LoRA or QLoRA, rank, targets), run in its own process;
each of its rows is a micro-batch shape on that model:
  probe      stages.preflight.probe on the built model: two optimizer steps on the worst padded batch
  measured   stages.train.hf_trainer.make_trainer: `steps` optimizer steps on rows of random length in
             [seq/2, seq], the one of exactly seq in the second-to-last step; peak reserved
plus what the estimate needs to be checked by mechanism: allocated after the build, the
optimizer's paged (managed, outside torch's counters) and unpaged state bytes.
The estimate is recomputed offline from each row's `spec` (bench/gpu_figure/fit_memory.py), so a refit
never needs the GPU again. Rows are appended as they finish: a run stopped by its time limit
keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "gpu_figure"))

QVO = ["q_proj", "v_proj", "o_proj"]
LONG = [(2048, 1), (8192, 1), (16384, 1), (32768, 1), (65536, 1), (4096, 2), (4096, 4)]
MID = [(2048, 1), (8192, 1), (16384, 1), (32768, 1), (4096, 2), (4096, 4)]
# (shape, quant, r, targets, rows). Fixes the preflight can suggest appear as rows of their own:
# micro-batch halved (4 -> 2 -> 1 x 4096), QLoRA instead of LoRA, a lower rank, a shorter max_length.
GROUPS = [
    ("qwen2.5-1.5b", "bf16", 64, QVO, LONG),
    ("qwen2.5-1.5b", "nf4", 64, QVO, LONG),
    ("llama-3b", "nf4", 64, QVO, LONG),
    ("llama-3b", "bf16", 64, QVO, MID),
    ("qwen2.5-1.5b", "nf4", 16, "all-linear", [(4096, 2), (16384, 1)]),
    ("mistral-7b", "nf4", 64, QVO, MID),
    ("mistral-7b", "bf16", 64, QVO, [(2048, 1), (8192, 1), (4096, 2), (16384, 1)]),
    ("qwen2-7b", "nf4", 64, QVO, [(2048, 1), (16384, 1), (4096, 2), (4096, 4)]),
    ("qwen2-7b", "nf4", 32, QVO, [(4096, 2)]),
    ("llama-3b", "nf4", 16, "all-linear", [(4096, 2), (16384, 1)]),
    # held out of the fit (shapes the estimate never saw)
    ("smollm2-360m", "bf16", 64, QVO, [(2048, 1), (16384, 1), (4096, 2), (32768, 1)]),
    ("qwen2.5-0.5b", "nf4", 64, QVO, [(4096, 2), (16384, 1), (65536, 1)]),
    ("llama-8b", "nf4", 64, QVO, [(4096, 2), (16384, 1)]),
    # CPU dry run
    ("tiny-tied", "bf16", 8, QVO, [(256, 1), (128, 2)]),
]


def run_config(model_dir: Path, quant: str, r: int, targets, seq: int, micro_batch: int):
    from stages.config import RunConfig

    return RunConfig.model_validate({
        "model": {"name_or_path": str(model_dir)},
        "data": {"train_file": str(REPO / "assets/data/translate_train.jsonl"), "max_length": seq},
        "lora": {"r": r, "lora_alpha": 32, "target_modules": targets, "lora_dropout": 0.05},
        "quantization": {"load_in_4bit": quant == "nf4"},
        "training": {"per_device_train_batch_size": micro_batch, "max_steps": 4, "save_steps": 1000},  # everything else: defaults
        "handoff": {"model_name": "bench"},
        "artifacts_dir": "/tmp/bench-artifacts",
    })


def optimizer_state_bytes(opt) -> dict:
    """bitsandbytes keeps large states in CUDA managed memory (`is_paged`), outside torch's counters."""
    paged = unpaged = 0
    for state in opt.state.values():
        for t in state.values():
            if hasattr(t, "numel") and getattr(t, "is_cuda", False):
                n = t.numel() * t.element_size()
                if getattr(t, "is_paged", False):
                    paged += n
                else:
                    unpaged += n
    return {"paged_state_mib": round(paged / 2**20, 2), "unpaged_state_mib": round(unpaged / 2**20, 2)}


def measure(cfg, model, seq: int, vocab: int, steps: int) -> dict:
    import torch

    from stages import memory
    from stages.memory import GIB
    from stages.train import batches, hf_trainer

    b = cfg.training.per_device_train_batch_size
    rng = random.Random(0)
    lengths = [rng.randint(seq // 2, seq - 1) for _ in range(steps * b)]
    lengths[(steps - 2) * b] = seq  # the longest arrives after the optimizer states exist
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(3, vocab, (n,), generator=gen).tolist()), "labels": ids} for n in lengths]
    memory.free_gpu()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = hf_trainer.make_trainer(cfg, model, rows, batches.Collator(0), Path("/tmp/bench-train"), max_steps=steps, save_strategy="no",
                                 train_sampling_strategy="sequential", logging_steps=1000, disable_tqdm=True, logging_first_step=False)
    t0 = time.perf_counter()
    trainer.train()
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out = {"measured_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None,
           "measured_alloc_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
           "tokens_per_s": round(sum(lengths) / wall, 1), "steps": trainer.state.global_step}
    out |= optimizer_state_bytes(trainer.optimizer)
    hf_trainer.release(trainer)
    del trainer
    memory.free_gpu()
    return out


def run_group(index: int, out: Path, deadline: float) -> None:
    """One model build and its rows, appended to `out` (JSON lines) as they finish."""
    import torch
    from random_checkpoints import make_checkpoint

    from stages import memory, preflight
    from stages.memory import GIB
    from stages.train import kernels, memory_model
    from stages.train import model as lora_model

    shape, quant, r, targets, shapes_rows = GROUPS[index]
    model_dir = make_checkpoint(shape, Path("/tmp/bench-models"))
    shapes = memory_model.Shapes.from_config(json.loads((model_dir / "config.json").read_text()))
    cuda = torch.cuda.is_available()
    total = torch.cuda.get_device_properties(0).total_memory / GIB if cuda else 0
    t0 = time.perf_counter()
    cfg0 = run_config(model_dir, quant, r, targets, *shapes_rows[0])
    memory.free_gpu()
    model = lora_model.build_model(cfg0)
    built = {"build_s": round(time.perf_counter() - t0, 1), "weights_alloc_gib": torch.cuda.memory_allocated() / GIB if cuda else None}
    for seq, mb in shapes_rows:
        if time.time() > deadline:
            print(f"group {index}: time limit before {seq}x{mb}", flush=True)
            break
        cfg = run_config(model_dir, quant, r, targets, seq, mb)
        tiled = kernels.settings(cfg).tiled_mlp
        kernels.tile_mlp(model, on=tiled) if cuda else None
        spec = {"shape": shape, "quant": quant, "r": r, "target_modules": targets, "seq": seq, "micro_batch": mb}
        row = {"model": shape, "config": spec, "group": index, "tiled_mlp": tiled} | built
        t1 = time.perf_counter()
        try:
            row["estimate_gib_at_run"] = memory_model.estimate(cfg, shapes, seq, on_gpu=cuda).total_gib
            if cuda:
                p = preflight.probe(cfg, seq, total, Path("/tmp/bench-probe"), model=model)
                row |= {"probe_gib": p.peak_reserved_gib, "probe_alloc_gib": p.peak_alloc_gib, "probe_ok": p.ok}
            long = seq * mb >= 32768
            row |= measure(cfg, model, seq, shapes.vocab, steps=3 if long else 4)
        except Exception as e:  # one bad row must not cost the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            memory.free_gpu()
        row["seconds"] = round(time.perf_counter() - t1, 1)
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, nargs="+", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-seconds", type=float, default=400)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        run_group(a.child, a.out, a.deadline)
        return
    deadline = time.time() + a.max_seconds
    lines = a.out.with_suffix(".jsonl")
    for g in a.groups:
        if time.time() > deadline:
            break
        # one process per build: what a run gets, and nothing carried over from the previous model
        try:
            rc = subprocess.run([sys.executable, __file__, "--groups", str(g), "--out", str(lines), "--child", str(g),
                                 "--deadline", str(deadline)], timeout=max(10, deadline - time.time() + 120)).returncode
        except subprocess.TimeoutExpired:
            rc = "a timeout"
        if rc:
            print(f"group {g} exited with {rc}", flush=True)
    rows = [json.loads(x) for x in lines.read_text().splitlines()] if lines.is_file() else []
    import torch

    a.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                 "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
