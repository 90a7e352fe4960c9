"""The train stage's loss and memory curves as PNGs (and the loss as JSON lines)."""

from __future__ import annotations

import json
from pathlib import Path

from stages import memory


def plot_memory(out_dir: Path, budget_gib: float | None) -> Path | None:
    """memory_steps.jsonl as a timeline: what torch allocated/reserved (GPU) or RSS (CPU), and the budget."""
    path = out_dir / memory.STEPS_FILE
    if not path.is_file():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [k for k in ("alloc_gib", "reserved_gib", "peak_reserved_gib", "nvml_used_gib") if k in steps[0]] or ["rss_gib", "peak_rss_gib"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k in keys:
        ax.plot([r["step"] for r in steps], [r.get(k) for r in steps], label=k.removesuffix("_gib"))
    if budget_gib:
        ax.axhline(budget_gib, color="red", linestyle="--", label=f"budget {budget_gib:.1f} GiB")
    ax.set(xlabel="optimizer step", ylabel="GiB", title="train memory per step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "memory.png", dpi=100)
    plt.close(fig)
    return out_dir / "memory.png"


def plot_loss(losses: list[dict], out_dir: Path, evals: list[dict] | None = None) -> Path:
    """Training loss per logging step (loss.jsonl) and, when there is eval data, the eval loss per eval
    (eval_loss.jsonl) on the same axes: both are mean cross-entropy per loss-carrying token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with (out_dir / "loss.jsonl").open("w") as f:
        for e in losses:
            f.write(json.dumps({"step": e["step"], "loss": e["loss"], "learning_rate": e.get("learning_rate")}) + "\n")
    if evals:
        with (out_dir / "eval_loss.jsonl").open("w") as f:
            f.writelines(json.dumps(e) + "\n" for e in evals)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([e["step"] for e in losses], [e["loss"] for e in losses], marker=".", label="training")
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], marker="o", label="eval (held-out)")
        ax.legend(fontsize=8)
    ax.set(xlabel="optimizer step", ylabel="loss per token", title="train loss" + (" and eval loss" if evals else ""))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=100)
    plt.close(fig)
    return out_dir / "loss.png"
