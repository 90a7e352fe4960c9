"""Does memory return after a model is built, trained and freed? (issue 12: the tied-embedding leak)

    python3 bench/memory_release/leak_check.py --out $OUT/leak_check.json [--cases qwen2.5-1.5b:lora mistral-7b:qlora]
    python3 bench/memory_release/leak_check.py --out $OUT/leak_check.json --cases --probe-then-train qwen2.5-1.5b:qlora mistral-7b:qlora

For each shape (tied and untied embeddings) and each of LoRA / QLoRA, with every `auto`
training default on: three times build the stage's model (stages.train.model.build_model), train
two optimizer steps through stages.train.hf_trainer.make_trainer, free it the way the stages do
(stages.train.hf_trainer.release + memory.free_gpu), and record what torch still has allocated.
Pass: allocated after each free within 16 MiB of the figure before the first build.

Then --probe-then-train: the flow's sequence in one process, preflight.run (scan, estimate,
probe) then train.run on a synthetic long-tailed chat dataset whose longest sample fills
max_length; training's peak reserved against the probe's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "gpu_figure"))

from random_checkpoints import make_checkpoint  # noqa: E402

from stages import memory, train  # noqa: E402
from stages.config import RunConfig  # noqa: E402
from stages.train import batches, hf_trainer  # noqa: E402
from stages.train import model as lora_model  # noqa: E402

MIB = 2**20
CUDA = torch.cuda.is_available()


def allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def config(model_dir: Path, qlora: bool, seq: int, micro_batch: int, data_file: Path | None = None, out: str = "/tmp/leak-artifacts") -> RunConfig:
    return RunConfig.model_validate({
        "model": {"name_or_path": str(model_dir)},
        "data": {"train_file": str(data_file or REPO / "assets/data/translate_train.jsonl"), "max_length": seq,
                 "long_sample_policy": "truncate"},
        "lora": {"r": 64, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj", "o_proj"], "lora_dropout": 0.05},
        "quantization": {"load_in_4bit": qlora},
        "training": {"per_device_train_batch_size": micro_batch, "max_steps": 2, "save_steps": 1000, "logging_steps": 1},
        "handoff": {"model_name": "bench"},
        "artifacts_dir": out,
    })


def rows(vocab: int, seq: int, n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (seq,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


def cycle(cfg: RunConfig, vocab: int, seq: int, out: Path) -> dict:
    t0 = time.perf_counter()
    model = lora_model.build_model(cfg)
    after_build = allocated()
    trainer = hf_trainer.make_trainer(cfg, model, rows(vocab, seq, 2 * cfg.training.per_device_train_batch_size), batches.Collator(0), out,
                                 max_steps=2, save_strategy="no", logging_steps=1000, disable_tqdm=True, logging_first_step=False)
    trainer.train()
    hf_trainer.release(trainer)
    del trainer, model
    memory.free_gpu()
    return {"after_build_mib": round(after_build / MIB, 1), "after_free_mib": round(allocated() / MIB, 1),
            "seconds": round(time.perf_counter() - t0, 1)}


def leak_case(shape: str, qlora: bool, seq: int) -> dict:
    model_dir = make_checkpoint(shape, Path("/tmp/bench-models"))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    cfg = config(model_dir, qlora, seq, 2)
    memory.free_gpu()
    before = allocated()
    cycles = []
    for i in range(3):
        c = cycle(cfg, vocab, seq, Path("/tmp/leak-train"))
        cycles.append(c)
        print(json.dumps({"shape": shape, "qlora": qlora, "cycle": i} | {k: v for k, v in c.items() if "mib" in k}), flush=True)
    # The first build also allocates what a CUDA process keeps once (cuBLAS workspaces: 32 MiB per stream
    # on Hopper); what matters is that every later free returns to the same figure.
    after = [c["after_free_mib"] for c in cycles]
    drift = max(after) - min(after)
    return {"shape": shape, "tied": json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False),
            "mode": "qlora" if qlora else "lora", "seq": seq, "micro_batch": 2, "before_mib": round(before / MIB, 1),
            "once_mib": round(after[0] - before / MIB, 1), "cycles": cycles, "max_drift_mib": round(drift, 1), "pass": drift <= 16}


def chat_data(path: Path, longest_words: int, n: int, seed: int = 0) -> Path:
    """Long-tailed synthetic chat: log-normal lengths, one sample of `longest_words` words (the worst batch)."""
    words = "moon green rain sun cat bird dog white blue house book tree door black red".split()
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            k = longest_words if i == n // 2 else min(longest_words - 1, max(4, int(rng.lognormvariate(4, 0.9))))
            text = " ".join(rng.choice(words) for _ in range(k))
            f.write(json.dumps({"messages": [{"role": "user", "content": "Repeat: " + text[: len(text) // 3]},
                                             {"role": "assistant", "content": text}]}) + "\n")
    return path


def probe_then_train(shape: str, qlora: bool, seq: int, micro_batch: int, steps: int) -> dict:
    """preflight.run then train.run in one process, as the flow runs them."""
    from stages import preflight

    model_dir = make_checkpoint(shape, Path("/tmp/bench-models"))
    root = Path(f"/tmp/ptt-{shape}-{int(qlora)}-{seq}x{micro_batch}")
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    # one epoch exactly, so the longest sample (truncated to max_length: it fills it) is trained on
    data_file = chat_data(root / "train.jsonl", longest_words=seq, n=micro_batch * steps)
    cfg = config(model_dir, qlora, seq, micro_batch, data_file, out=str(root / "artifacts"))
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"max_steps": steps, "logging_steps": 5})})
    memory.free_gpu()
    before = allocated()
    pre = preflight.run(cfg, root / "preflight", train_only=True)
    between = allocated()
    tr = train.run(cfg, root / "train")
    after = allocated()
    probe = pre.probe.peak_reserved_gib if pre.probe else None
    measured = tr.memory.peak_reserved_gib
    return {"shape": shape, "mode": "qlora" if qlora else "lora", "seq": seq, "micro_batch": micro_batch, "steps": tr.steps,
            "estimate_gib": pre.estimate.total_gib, "probe_gib": probe, "train_peak_reserved_gib": measured,
            "train_start_alloc_gib": tr.memory.start_alloc_gib, "train_end_alloc_gib": tr.memory.end_alloc_gib,
            "train_over_probe": round(measured / probe - 1, 4) if probe else None,
            "allocated_mib": {"before": round(before / MIB, 1), "after_preflight": round(between / MIB, 1), "after_train": round(after / MIB, 1)},
            "longest": pre.lengths.max}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", nargs="*", default=["qwen2.5-1.5b:lora", "qwen2.5-1.5b:qlora", "mistral-7b:lora", "mistral-7b:qlora"],
                    help="SHAPE:MODE[+MODE...]; each case in a fresh process, its modes one after the other in it")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--probe-then-train", nargs="*", default=[], metavar="SHAPE:MODE")
    ap.add_argument("--ptt-seq", type=int, default=4096)
    ap.add_argument("--ptt-steps", type=int, default=12)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    lines = a.out.with_suffix(".jsonl")
    if a.child:
        kind, shape, modes = a.child.split(":")
        for mode in modes.split("+"):
            try:
                r = (leak_case(shape, mode == "qlora", a.seq) if kind == "leak"
                     else {"check": "probe_then_train"} | probe_then_train(shape, mode == "qlora", a.ptt_seq, 2, a.ptt_steps))
            except Exception as e:  # one case must not cost the others
                import traceback

                r = {"shape": shape, "mode": mode, "error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-3000:]}
                memory.free_gpu()
            r |= {"process": a.child}
            print(json.dumps({k: v for k, v in r.items() if k not in ("traceback", "cycles")}), flush=True)
            with lines.open("a") as f:
                f.write(json.dumps(r) + "\n")
        return
    import subprocess

    for kind, cases in (("leak", a.cases), ("ptt", a.probe_then_train)):
        for case in cases:
            args = [sys.executable, __file__, "--out", str(a.out), "--child", f"{kind}:{case}", "--seq", str(a.seq),
                    "--ptt-seq", str(a.ptt_seq), "--ptt-steps", str(a.ptt_steps)]
            subprocess.run(args)
    rows = [json.loads(x) for x in lines.read_text().splitlines()] if lines.is_file() else []
    a.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__,
                                 "cases": [r for r in rows if r.get("check") != "probe_then_train"],
                                 "probe_then_train": [r for r in rows if r.get("check") == "probe_then_train"]}, indent=1))


if __name__ == "__main__":
    main()
