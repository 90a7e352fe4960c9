"""Data-parallel training through the train stage's own launcher: 1 GPU vs 2 GPUs on R7.

    PYTHONPATH=. python3 bench/multi_gpu/ddp_x2.py --out $OUT/ddp_x2.json                      # nvidia-h200-x2
    PYTHONPATH=. python bench/multi_gpu/ddp_x2.py --model assets/tiny-llama --seq 256 --out /tmp/ddp.json   # CPU dry run

Both runs are `stages.train.run` with `training.launcher: accelerate` (accelerate launch on
GPUs, torchrun on CPU) and the same effective batch: 1 process x micro-batch 2 x
accumulation 2, then 2 processes x micro-batch 2 x accumulation 1. Throughput is the
stage's own tokens/s (all ranks' tokens over the training wall time); loss parity
compares the two runs' logged losses step by step (same seed, same data order: an
optimizer step sees the same 4 rows either way).
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

from stages import train  # noqa: E402
from stages.config import RunConfig  # noqa: E402


def dataset(path: Path, n: int, words_per_sample: int) -> Path:
    """Chat samples of random words from the default's vocabulary, long enough to fill `seq`."""
    text = (REPO / "assets/data/translate_train.jsonl").read_text()
    vocab = sorted({w for w in text.replace('"', " ").replace(":", " ").replace(",", " ").split() if w.isalpha()})
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(rng.choice(vocab) for _ in range(words_per_sample))
            f.write(json.dumps({"id": f"s{i}", "messages": [{"role": "user", "content": "Tell a story."},
                                                            {"role": "assistant", "content": text}]}) + "\n")
    return path


def config(model: str, data: Path, seq: int, procs: int, steps: int, work: Path) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"name_or_path": model, "torch_dtype": "auto"},
        "data": {"train_file": str(data), "max_length": seq, "long_sample_policy": "truncate"},
        "lora": {"r": 64, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj", "o_proj"], "lora_dropout": 0.0},
        "training": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2 // procs, "max_steps": steps,
                     "learning_rate": 1e-4, "logging_steps": 1, "save_steps": 10_000, "launcher": "accelerate",
                     "num_processes": procs, "train_sampling_strategy": "sequential"},
        "preflight": {"probe": False},
        "smoke": {"check": "stops"},
        "handoff": {"model_name": "bench"},
        "artifacts_dir": str(work),
    })


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", help="a model directory (default: a random-init R7 checkpoint)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-ddp"))
    a = ap.parse_args()
    t0 = time.perf_counter()
    if a.model is None:
        from bench.gpu_figure.random_checkpoints import make_checkpoint

        a.model = str(make_checkpoint("qwen2-7b", Path("/tmp/bench-models")))
    a.work.mkdir(parents=True, exist_ok=True)
    data = dataset(a.work / "train.jsonl", n=4 * a.steps + 8, words_per_sample=a.seq)  # truncated to seq tokens
    report = {"model": a.model, "seq": a.seq, "steps": a.steps, "setup_s": round(time.perf_counter() - t0, 1), "runs": {}}
    for procs in (1, 2):
        cfg = config(a.model, data, a.seq, procs, a.steps, a.work)
        out = a.work / f"train-{procs}"
        t = time.perf_counter()
        r = train.run(cfg, out)
        losses = [json.loads(x)["loss"] for x in (out / "loss.jsonl").read_text().splitlines()]
        report["runs"][procs] = {"processes": procs, "tokens_per_s": r.tokens_per_s, "train_tokens": r.train_tokens, "steps": r.steps,
                                 "losses": losses, "wall_s_incl_launch_and_load": round(time.perf_counter() - t, 1),
                                 "peak_gib_rank0": r.memory.peak_gib if r.memory else None}
        a.out.write_text(json.dumps(report, indent=1))
    one, two = report["runs"][1], report["runs"][2]
    pairs = list(zip(one["losses"], two["losses"], strict=False))
    report["scaling"] = round(two["tokens_per_s"] / one["tokens_per_s"], 3)
    report["loss_max_abs_diff"] = round(max(abs(x - y) for x, y in pairs), 5) if pairs else None
    report["final_loss"] = {"1": one["losses"][-1], "2": two["losses"][-1]}
    a.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("scaling", "loss_max_abs_diff", "final_loss")}))


if __name__ == "__main__":
    main()
