"""Train a LoRA (or, with quantization.load_in_4bit, QLoRA) adapter on the run's dataset.

    python -m stages.train --config configs/default.yaml [--out artifacts/runs/x/train]

The base model is frozen: 16-bit, or NF4 through bitsandbytes for QLoRA. Settings that
silently lose memory savings are set explicitly here, not left to defaults:

- `model.train()` before gradient checkpointing: `from_pretrained` returns eval mode, in
  which checkpointing silently does nothing.
- non-reentrant checkpointing with input grads enabled, so a frozen embedding still lets
  gradients reach the first adapted layer.
- no `prepare_model_for_kbit_training`: it upcasts embeddings, lm_head and norms to fp32
  (+2 GiB and 3.5x slower steps on a 7B, measured in ../shared/anchors).

Checkpoints go to <out>/checkpoints every `training.save_steps`; running again after a
crash resumes from the last one. Per-step memory goes to <out>/memory_steps.jsonl, the
loss curve to <out>/loss.jsonl and <out>/loss.png.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback

from stages import data, memory
from stages.config import RunConfig, load_config
from stages.memory import MemoryReport
from stages.modelio import compute_dtype, device, load_base, load_tokenizer


@dataclass
class TrainResult:
    adapter_dir: Path
    steps: int
    first_loss: float
    final_loss: float
    train_tokens: int          # non-padding tokens seen
    tokens_per_s: float
    trainable_params: int
    resumed_from: str | None   # checkpoint the run continued from, if any
    loss_png: Path
    memory: MemoryReport | None
    skipped: bool = False      # the adapter was already there


def run(cfg: RunConfig, out_dir: Path) -> TrainResult:
    """Train the adapter into <out_dir>/adapter; resume from <out_dir>/checkpoints if present."""
    out_dir = Path(out_dir)
    done = out_dir / "train_result.json"
    if done.is_file() and (out_dir / "adapter" / "adapter_config.json").is_file():
        print(f"train: adapter already trained in {out_dir / 'adapter'}; skipping")
        return _load_result(done)

    tokenizer = load_tokenizer(cfg.model)
    samples = data.read_jsonl(cfg.data.train_file)
    tok = data.tokenize(samples, tokenizer, cfg.data.max_length, cfg.data.long_sample_policy)
    with memory.track("train", out_dir) as meter:
        model = build_model(cfg)
        trainer = make_trainer(cfg, model, rows(tok), tokenizer.pad_token_id, out_dir)
        resume = last_checkpoint(out_dir / "checkpoints")
        if resume:
            print(f"train: resuming from {resume}")
        t0 = time.perf_counter()
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        wall = time.perf_counter() - t0
        model.save_pretrained(out_dir / "adapter", safe_serialization=True)
        meter.extra["steps_this_process"] = trainer.state.global_step - (_step_of(resume) if resume else 0)
    losses = [e for e in trainer.state.log_history if "loss" in e]
    tokens = int(trainer.state.num_input_tokens_seen) if trainer.state.num_input_tokens_seen else sum(tok.lengths)
    result = TrainResult(
        adapter_dir=out_dir / "adapter",
        steps=trainer.state.global_step,
        first_loss=losses[0]["loss"] if losses else float("nan"),
        final_loss=losses[-1]["loss"] if losses else float("nan"),
        train_tokens=tokens,
        tokens_per_s=round(tokens / wall, 1) if wall > 0 else 0.0,
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        resumed_from=str(resume) if resume else None,
        loss_png=plot_loss(losses, out_dir),
        memory=meter.report,
    )
    done.write_text(json.dumps(_jsonable(result), indent=2))
    return result


def build_model(cfg: RunConfig):
    """Frozen base + LoRA adapter, in train mode, checkpointing set up the way that works."""
    from peft import LoraConfig, get_peft_model

    model = load_base(cfg.model, cfg.quantization)
    if cross_entropy(cfg) == "chunked":
        use_chunked_loss(model)
    model.config.use_cache = False  # the KV cache is useless in training and costs memory
    model.train()  # from_pretrained returns eval mode; checkpointing is a no-op there
    if cfg.training.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **cfg.lora.model_dump()))
    check_only_lora_trains(model)
    return model


def cross_entropy(cfg: RunConfig) -> str:
    """plain or chunked: `auto` is chunked (Liger's fused linear cross-entropy) on a GPU."""
    choice = cfg.training.cross_entropy
    if choice == "auto":
        return "chunked" if device().type == "cuda" and _has_liger() else "plain"
    if choice == "chunked" and not (device().type == "cuda" and _has_liger()):
        raise ValueError(
            "training.cross_entropy: chunked needs a CUDA GPU and liger-kernel (`pip install -e .[gpu]`, Triton-based); "
            "set training.cross_entropy: plain (or auto) on this machine"
        )
    return choice


def _has_liger() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def use_chunked_loss(model) -> None:
    """Never materialise vocab x tokens logits: Liger computes lm_head + cross-entropy in chunks.

    Patched on this instance only (rope, norms and MLP stay transformers' own), so the
    saving measured is the loss alone.
    """
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model.config.model_type)
    if apply is None:
        raise ValueError(f"liger-kernel has no fused cross-entropy for model_type {model.config.model_type!r}; set training.cross_entropy: plain")
    apply(model=model, fused_linear_cross_entropy=True, cross_entropy=False, rope=False, rms_norm=False, swiglu=False)


def check_only_lora_trains(model) -> None:
    """Frozen means frozen: a base weight with requires_grad would add grads and optimizer state."""
    leaked = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    if leaked:
        raise RuntimeError(f"{len(leaked)} non-LoRA parameters require grad (e.g. {leaked[:3]}); only adapters may train")


def rows(tok: data.Tokenized) -> list[dict]:
    return [{"input_ids": i, "labels": l} for i, l in zip(tok.input_ids, tok.labels, strict=True)]


def collate(batch: list[dict], pad_id: int) -> dict:
    """Dynamic padding to the longest row: the batch holding the longest sample is the worst step."""
    width = max(len(r["input_ids"]) for r in batch)
    pad = [width - len(r["input_ids"]) for r in batch]
    return {
        "input_ids": torch.tensor([r["input_ids"] + [pad_id] * n for r, n in zip(batch, pad, strict=True)]),
        "labels": torch.tensor([r["labels"] + [-100] * n for r, n in zip(batch, pad, strict=True)]),
        "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * n for r, n in zip(batch, pad, strict=True)]),
    }


def make_trainer(cfg: RunConfig, model, train_rows: list[dict], pad_id: int, out_dir: Path, **overrides):
    """The HF Trainer exactly as training uses it; `overrides` change TrainingArguments (the probe's 2 steps)."""
    from transformers import Trainer, TrainingArguments

    t = cfg.training
    on_gpu = device().type == "cuda"
    dtype = compute_dtype(cfg.model.torch_dtype)
    kwargs = dict(
        output_dir=str(out_dir / "checkpoints"),
        per_device_train_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        max_steps=t.max_steps,
        optim=t.optim,
        train_sampling_strategy=t.train_sampling_strategy,
        logging_steps=t.logging_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        seed=t.seed,
        data_seed=t.seed,
        gradient_checkpointing=False,  # set up in build_model, in the order that works
        bf16=on_gpu and dtype == torch.bfloat16,
        fp16=on_gpu and dtype == torch.float16,
        use_cpu=not on_gpu,
        dataloader_pin_memory=on_gpu,
        dataloader_num_workers=0,  # workers fork the dataset; /dev/shm errors are not worth it here
        remove_unused_columns=False,
        include_num_input_tokens_seen="non_padding",
        report_to=[],
        disable_tqdm=False,
        logging_first_step=True,
    )
    args = TrainingArguments(**(kwargs | overrides))
    return Trainer(
        model=model, args=args, train_dataset=train_rows, data_collator=lambda b: collate(b, pad_id),
        callbacks=[MemoryCallback(out_dir / "memory_steps.jsonl")],
    )


class MemoryCallback(TrainerCallback):
    """Appends memory.stats() at every optimizer step to a JSON-lines file.

    Only reads state; the CUDA figures come from the allocator's counters, not a sync.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def on_step_end(self, args, state, control, **kwargs):
        row = {"step": state.global_step, "time": round(time.time(), 3)} | {
            k: round(v, 4) for k, v in memory.stats().items()
        }
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return control


def last_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint (trainer_state.json is written last)."""
    done = [p for p in ckpt_dir.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    return max(done, key=_step_of, default=None)


def _step_of(p: Path) -> int:
    return int(p.name.rsplit("-", 1)[1])


def plot_loss(losses: list[dict], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with (out_dir / "loss.jsonl").open("w") as f:
        for e in losses:
            f.write(json.dumps({"step": e["step"], "loss": e["loss"], "learning_rate": e.get("learning_rate")}) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([e["step"] for e in losses], [e["loss"] for e in losses], marker=".")
    ax.set(xlabel="optimizer step", ylabel="training loss", title="train loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=100)
    plt.close(fig)
    return out_dir / "loss.png"


def _jsonable(r: TrainResult) -> dict:
    d = asdict(r)
    d["memory"] = r.memory.to_json() if r.memory else None
    return json.loads(json.dumps(d, default=str))


def _load_result(path: Path) -> TrainResult:
    d = json.loads(path.read_text())
    mem = d.pop("memory")
    mem.pop("peak_gib", None)
    return TrainResult(
        **{k: Path(v) if k in ("adapter_dir", "loss_png") else v for k, v in d.items() if k != "skipped"},
        memory=MemoryReport(**mem) if mem else None,
        skipped=True,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Train a LoRA/QLoRA adapter (one stage of train-and-export).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. training.max_steps=20")
    ap.add_argument("--out", type=Path, help="stage directory (default: artifacts/runs/<new id>/train)")
    a = ap.parse_args(argv)
    cfg = load_config(a.config, a.set)
    from stages.paths import RunPaths

    out = a.out or RunPaths.for_run(cfg).stage("train")
    r = run(cfg, out)
    print(f"adapter: {r.adapter_dir}  steps {r.steps}  loss {r.first_loss:.3f} -> {r.final_loss:.3f}  {r.tokens_per_s:.0f} tok/s")


if __name__ == "__main__":
    main()
