"""When CUDA runs out of memory in training: what was in memory (the post-mortem), and what the next attempt
trains with (the OOM policy); the train stage's run() frees the failed attempt and trains again.

Halving the micro-batch and doubling the accumulation keeps the samples per optimizer step, so the run resumes
from its last checkpoint with the same effective batch; `training.oom_retries` bounds how often.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from stages import memory
from stages.config import RunConfig
from stages.errors import UserError
from stages.train import batches
from stages.train.hf_trainer import MemorySnapshot


class TrainOOMError(UserError, RuntimeError):
    """CUDA ran out of memory and halving the micro-batch did not help (or cannot)."""


def next_attempt(cfg: RunConfig, report: dict, retried: int, packed: bool, longest: int, plan, resume_from: Path | None,
                 freed: dict) -> tuple[RunConfig, dict]:
    """The OOM policy: from a failed attempt's post-mortem (`report`: its step, phase, batch and file), the config the
    next attempt trains with and the record of this recovery (with `freed`, what freeing the attempt left).

    fit: speed measured too tight a fit: the next attempt checkpoints every layer (fit: memory) at the same micro-batch.
    Otherwise the micro-batch halves (halve_micro_batch: the same samples per step), resuming from `resume_from`, at
    most training.oom_retries times (`retried` so far).

    Raises:
        TrainOOMError: no retry is left, or no smaller micro-batch is possible; it names the batch and the post-mortem.
    """
    t = cfg.training
    if t.planned_fit == "speed":
        return (cfg.model_copy(update={"training": t.model_copy(update={"fit": "memory"})}),
                {"step": report["step"], "postmortem": report["path"], "fit": "memory"} | freed)
    smaller = halve_micro_batch(cfg, packed, longest)
    if retried >= t.oom_retries or smaller is None:
        what = f"{plan.tokens_per_micro_batch}-token packed micro-batches" if packed else f"micro-batch {t.per_device_train_batch_size}"
        why = ("no smaller micro-batch is possible" if smaller is None else
               f"training.oom_retries is {t.oom_retries}" if not retried else f"{t.oom_retries} retries used")
        raise TrainOOMError(
            f"CUDA out of memory at step {report['step']} with {what} (rows {report['batch']['ids'][:4]}); {why}. "
            f"Post-mortem: {report['path']}. Run the preflight with this budget to get a change that fits."
        )
    s = smaller.training
    return smaller, ({"step": report["step"], "postmortem": report["path"], "resumed_from": str(resume_from),
                      "per_device_train_batch_size": s.per_device_train_batch_size,
                      "gradient_accumulation_steps": s.gradient_accumulation_steps}
                     | ({"max_tokens_per_batch": s.max_tokens_per_batch} if packed else {}) | freed)


def describe_recovery(report: dict, recovery: dict) -> str:
    """The log line of one OOM recovery."""
    if recovery.get("fit") == "memory":
        return f"train: CUDA OOM at step {report['step']} with fit: speed; post-mortem {report['path']}; resuming with fit: memory"
    batch = (f"{recovery['max_tokens_per_batch']}-token micro-batches" if "max_tokens_per_batch" in recovery
             else f"micro-batch {recovery['per_device_train_batch_size']}")
    return (f"train: CUDA OOM at step {report['step']}{' during eval' if report['phase'] == 'eval' else ''}; post-mortem "
            f"{report['path']}; {recovery.get('alloc_gib', 0):.2f} GiB still allocated after freeing the attempt; resuming with "
            f"{batch} x accumulation {recovery['gradient_accumulation_steps']}")


def halve_micro_batch(cfg: RunConfig, packed: bool, longest: int) -> RunConfig | None:
    """`cfg` with half the micro-batch and the same samples per step (batches.halved); None when it cannot get smaller."""
    change = batches.halved(cfg, packed, longest)
    return None if change is None else batches.with_training(cfg, change)


def postmortem(err: BaseException, cfg: RunConfig, trainer, model, collator: batches.Collator, path: Path) -> dict:
    """What was in memory when it ran out: the batch, the allocator, what requires grad."""
    stats = memory.stats()
    evaluating = getattr(trainer, "evaluating", False)
    leaked = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    report = {
        "path": str(path),
        "error": str(err).split("\n")[0][:500],
        "step": trainer.state.global_step + (0 if evaluating else 1),  # eval runs after its step ended
        "phase": "eval" if evaluating else "train",
        "batch": collator.batch(trainer.micro_batches - 1),  # the one training when memory ran out (or the last, in eval)
        "per_device_train_batch_size": cfg.training.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.training.gradient_accumulation_steps,
        "memory_gib": stats,
        "fragmentation_gib": (stats["reserved_gib"] - stats["alloc_gib"]) if "reserved_gib" in stats else None,
        "non_lora_params_requiring_grad": leaked[:20],
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    if torch.cuda.is_available():
        report["memory_summary"] = torch.cuda.memory_summary()
        if MemorySnapshot.recording:
            snap = path.with_suffix(".pickle")
            torch.cuda.memory._dump_snapshot(str(snap))
            report["snapshot"] = str(snap)
    path.write_text(json.dumps(report, indent=2))
    return report


def is_dataloader_shm_error(e: BaseException) -> bool:
    text = str(e).lower()
    return "dataloader worker" in text and ("shared memory" in text or "bus error" in text or "shm" in text)
