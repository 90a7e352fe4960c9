"""Train a LoRA (or, with quantization.load_in_4bit, QLoRA) adapter on the run's dataset.

    python -m stages.train --config configs/default.yaml [--out artifacts/runs/x/train]

The base model is frozen: 16-bit, or NF4 through bitsandbytes for QLoRA. Settings that
silently lose memory savings are set explicitly here, not left to defaults:

- `model.train()` before gradient checkpointing: `from_pretrained` returns eval mode, in
  which checkpointing silently does nothing.
- non-reentrant checkpointing with input grads enabled, so a frozen embedding still lets
  gradients reach the first adapted layer.
- no `prepare_model_for_kbit_training`: it upcasts embeddings, lm_head and norms to fp32
  (+2 GiB and 3.5x slower steps on a 7B, measured on the baseline 7B, docs/benchmarks.md).

Micro-batches are packed to a token budget (`training.packing`, stages/train/packing.py) or padded
to their longest row (stages/train/batches.py). The pieces: stages/train/model.py builds the model
(the preflight's probe builds it the same way), stages/train/kernels.py resolves the `auto`
settings, stages/train/hf_trainer.py is the Trainer, stages/train/launch.py the multi-process launcher.

Checkpoints go to <out>/checkpoints every `training.save_steps`; running again after a
crash resumes from the last one (packed: the same micro-batches, from the seeded plan). Per-step memory goes to <out>/memory_steps.jsonl, the
loss curve to <out>/loss.jsonl and <out>/loss.png.

With eval data (data.eval_file or data.eval_split), the eval loss per loss-carrying token is
measured every `training.eval_steps` (stages/train/eval_loss.py) into <out>/eval_loss.jsonl and the
second line of loss.png; `training.early_stopping_patience` stops training after that many evals
without a lower one, and with `training.load_best` the adapter written is the checkpoint of the
lowest eval loss. `training.report_to` sends all of it to TensorBoard and/or MLflow (stages/train/tracking.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from stages import data, memory, result_files
from stages.config import RunConfig, load_config
from stages.errors import UserError
from stages.memory import MemoryReport
from stages.modelio import device, load_tokenizer
from stages.train import autofit, batches, eval_loss, kernels, launch, sharding
from stages.train.attention import attention_kernel
from stages.train.hf_trainer import InjectOOM, MemorySnapshot, last_checkpoint, make_trainer, release, step_of
from stages.train.model import build_model
from stages.train.plots import plot_loss, plot_memory
from stages.train.tracking import Tracker


@dataclass
class TrainResult:
    adapter_dir: Path
    steps: int
    first_loss: float
    final_loss: float
    train_tokens: int          # non-padding tokens trained on by this process
    tokens_per_s: float
    trainable_params: int
    resumed_from: str | None   # checkpoint the run continued from, if any
    loss_png: Path
    memory: MemoryReport | None
    skipped: bool = False      # the adapter was already there
    oom_recoveries: list = field(default_factory=list)  # each: step, post-mortem, new micro-batch
    memory_png: Path | None = None
    fit: dict = field(default_factory=dict)  # checkpointed layers, offload, and why (autofit.FitChoice)
    batches: dict = field(default_factory=dict)  # packed or padded, tokens per micro-batch, efficiency (batches.Plan)
    eval_curve: list = field(default_factory=list)  # each: step, eval_loss (per loss-carrying token), eval_tokens; [] without eval data
    best_step: int | None = None          # the eval with the lowest eval loss
    best_eval_loss: float | None = None
    stopped_early: bool = False           # training.early_stopping_patience ended it before max_steps
    adapter_step: int | None = None       # the step the adapter in adapter_dir is from (best_step with training.load_best)


class TrainOOMError(UserError, RuntimeError):
    """CUDA ran out of memory and halving the micro-batch did not help (or cannot)."""


def run(cfg: RunConfig, out_dir: Path, *, inject_oom_at: int | None = None) -> TrainResult:
    """Train the adapter into <out_dir>/adapter; resume from <out_dir>/checkpoints if present.

    On a CUDA out-of-memory error: write <out_dir>/oom-postmortem-<n>.json, then resume from
    the last checkpoint with half the micro-batch (packed: half the token budget) and twice the
    accumulation (the same effective batch and optimizer step), up to training.oom_retries times.
    Nothing of the failed attempt (model, optimizer, batches, the traceback's frames) is left
    when the model is built again; the recovery record says so (previous_attempt_freed).

    Args:
        inject_oom_at: test hook; raise torch.OutOfMemoryError when optimizer step N begins
            (first attempt only).
    """
    out_dir = Path(out_dir)
    if result_files.done(out_dir, "train"):
        print(f"train: adapter already trained in {out_dir / 'adapter'}; skipping")
        return _load_result(result_files.load(out_dir, "train"))
    if cfg.training.launcher == "accelerate" and not os.environ.get(launch.LAUNCHED):
        with memory.track("train", out_dir / "launcher") as meter:
            launch.launch(cfg, out_dir)
        if cfg.training.machine_rank > 0:
            print(f"train: machine {cfg.training.machine_rank} of {cfg.training.num_machines} done; machine 0 writes the adapter")
            return None
        result = _load_result(result_files.load(out_dir, "train"))
        result.memory, result.skipped = result.memory or meter.report, False
        return result

    tokenizer = load_tokenizer(cfg.model)
    tset = data.training_set(cfg, tokenizer)  # tokenized once per content (the preflight made it), memory-mapped
    train_rows, lengths = tset.rows, tset.lengths
    held_out = eval_loss.rows(cfg, tokenizer)
    every = eval_loss.eval_steps(cfg, bool(held_out))  # a save_steps/eval_steps clash fails here, before the model loads
    print(f"train: {_describe_eval(cfg, held_out, every)}")
    longest = max(lengths)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    attempt_cfg, recoveries = cfg, []
    with Tracker(cfg, out_dir) as tracker:
        with memory.track("train", out_dir) as meter:
            while True:
                packed = kernels.packing(attempt_cfg)
                dataset, plan = batches.dataset(attempt_cfg, train_rows, packed, world, lengths)
                collator = (batches.PackedCollator(varlen=kernels.packed_attention(attempt_cfg) == "varlen") if packed
                            else batches.Collator(tokenizer.pad_token_id))
                print(f"train: {plan.describe()}")
                model = build_model(attempt_cfg, longest)
                fit = choose_fit(attempt_cfg, model, train_rows, collator, out_dir, lengths)
                resume = last_checkpoint(out_dir / "checkpoints")
                hooks = [InjectOOM(inject_oom_at)] if inject_oom_at and not recoveries else []
                if attempt_cfg.training.memory_snapshot_steps and torch.cuda.is_available() and not recoveries:
                    hooks.append(MemorySnapshot(attempt_cfg.training.memory_snapshot_steps, out_dir / "memory_snapshot.pickle"))
                hooks += tracker.callbacks(step_of(resume) if resume else 0)
                trainer = make_trainer(attempt_cfg, model, dataset, collator, out_dir, callbacks=hooks,
                                       eval_rows=held_out, memory_sinks=(tracker.memory,))
                if resume:
                    print(f"train: resuming from {resume}")
                t0 = time.perf_counter()
                report = None
                try:
                    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
                except torch.OutOfMemoryError as e:
                    report = postmortem(e, attempt_cfg, trainer, model, collator, out_dir / f"oom-postmortem-{len(recoveries) + 1}.json")
                    # The traceback keeps every frame of the failed step alive (the Trainer's loop with its model,
                    # optimizer and batches; the forward's activations), and a frame that re-raised holds the
                    # exception in a cycle only the collector breaks: their locals go now, before the rebuild.
                    traceback.clear_frames(e.__traceback__)
                except RuntimeError as e:
                    if is_dataloader_shm_error(e):
                        raise RuntimeError(
                            f"not a GPU out-of-memory: a DataLoader worker ran out of shared memory (/dev/shm) ({e}); "
                            "keep dataloader workers at 0 or give the container more /dev/shm (docker --shm-size)"
                        ) from e
                    raise
                if report is None:
                    break
                # Here, outside the except block, the exception is gone; then the attempt itself.
                failed = [weakref.ref(x) for x in (model, trainer.optimizer) if x is not None]
                release(trainer)
                del trainer, model
                memory.free_gpu()
                freed = {"previous_attempt_freed": all(r() is None for r in failed)} | {
                    k: round(v, 4) for k, v in memory.stats().items() if k in ("alloc_gib", "reserved_gib")}
                if not freed["previous_attempt_freed"]:
                    print(f"train: WARNING: the failed attempt is still reachable ({_holders(failed)}); the rebuild may run out too")
                report |= freed
                attempt_cfg, recovery = next_attempt(attempt_cfg, report, len(recoveries), packed, longest, plan,
                                                     last_checkpoint(out_dir / "checkpoints"), freed)
                recoveries.append(recovery)
                print(describe_recovery(report, recovery))
            wall = time.perf_counter() - t0
            # FSDP: every process hands in its shards of the adapter (with training.load_best, of the best
            # checkpoint, which the Trainer has loaded back by now); process 0 writes it, whole, once
            whole = sharding.adapter_state_dict(model) if sharding.is_sharded(model) else None
            ranks = sharding.per_rank_memory() if world > 1 or whole is not None else None
            release(trainer)
            if trainer.is_world_process_zero():  # DDP/FSDP: rank 0 writes the adapter and the results
                model.save_pretrained(out_dir / "adapter", safe_serialization=True, **({"state_dict": whole} if whole else {}))
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # a shard counts its whole tensor
            # Trainer and model hold each other through cycles (callbacks, hooks, Liger's bound forward):
            # collected here, inside the stage, or the next stage would start with this model still allocated.
            del model
            memory.free_gpu()
            meter.extra["steps_this_process"] = trainer.state.global_step - (step_of(resume) if resume else 0)
            meter.extra["oom_recoveries"] = recoveries
            meter.extra["fit"] = memory.jsonable(fit)
            if ranks:  # each process's own peak: with fsdp, what one GPU holds of the sharded model
                meter.extra["per_rank"] = ranks
                meter.extra["distributed"] = {"kind": cfg.training.distributed, "processes": world,
                                              "machines": cfg.training.num_machines}
        if not trainer.is_world_process_zero():
            return None
        losses = [e for e in trainer.state.log_history if "loss" in e]
        evals = evaluation(trainer, cfg)
        tokens = collator.tokens(trainer.micro_batches) * trainer.args.world_size  # each DDP rank trains its own share
        result = TrainResult(
            adapter_dir=out_dir / "adapter",
            steps=trainer.state.global_step,
            first_loss=losses[0]["loss"] if losses else float("nan"),
            final_loss=losses[-1]["loss"] if losses else float("nan"),
            train_tokens=tokens,
            tokens_per_s=round(tokens / wall, 1) if wall > 0 else 0.0,
            trainable_params=trainable,
            resumed_from=str(resume) if resume else None,
            loss_png=plot_loss(losses, out_dir, evals["eval_curve"]),
            memory=meter.report,
            oom_recoveries=recoveries,
            memory_png=plot_memory(out_dir, _budget_gib(cfg)),
            fit=memory.jsonable(fit),
            batches=asdict(plan),
            **evals,
        )
        done = result_files.save(out_dir, "train", result)
        tracker.finish(result.steps, [result.loss_png, result.memory_png, out_dir / "eval_loss.jsonl", done],
                       {k: getattr(result, k) for k in ("final_loss", "tokens_per_s", "best_step", "best_eval_loss", "stopped_early", "adapter_step")})
    return result


def _holders(refs: list) -> str:
    """What still refers to a failed attempt's objects (for the warning that says the rebuild may not fit)."""
    import gc

    alive = [r() for r in refs if r() is not None]
    return "; ".join(f"{type(x).__name__} held by " + ", ".join(sorted({type(h).__name__ for h in gc.get_referrers(x)})[:6]) for x in alive)


def _describe_eval(cfg: RunConfig, rows: list[dict], every: int | None) -> str:
    t = cfg.training
    if not every:
        return ("no eval data (data.eval_file and data.eval_split are unset), so no eval loss: training.eval_steps, "
                "early_stopping_patience and load_best have no effect")
    stop = f"; stops after {t.early_stopping_patience} evals without a lower eval loss" if t.early_stopping_patience else ""
    keep = "the checkpoint with the lowest eval loss" if t.load_best else "the last step's"
    return (f"eval loss every {every} steps on {len(rows)} held-out samples "
            f"({sum(len(r['input_ids']) for r in rows)} tokens){stop}; adapter kept: {keep}")


def evaluation(trainer, cfg: RunConfig) -> dict:
    """The eval curve and what it decided, from the Trainer's state (restored on resume, so the curve
    includes the evals before the checkpoint), as TrainResult fields."""
    state = trainer.state
    curve = [{"step": e["step"], "eval_loss": e["eval_loss"], "eval_tokens": e.get("eval_tokens")} for e in state.log_history if "eval_loss" in e]
    stopped = bool(curve) and bool(cfg.training.early_stopping_patience) and state.global_step < state.max_steps
    best = Path(state.best_model_checkpoint) if state.best_model_checkpoint else None
    adapter_step = step_of(best) if trainer.args.load_best_model_at_end and best is not None else state.global_step
    if stopped:
        print(f"train: stopped early at step {state.global_step}: {cfg.training.early_stopping_patience} evals without a lower eval loss")
    if curve:
        print(f"train: lowest eval loss {state.best_metric:.4f} at step {state.best_global_step}; adapter from step {adapter_step}")
    return {"eval_curve": curve, "best_step": state.best_global_step if curve else None,
            "best_eval_loss": state.best_metric if curve else None, "stopped_early": stopped, "adapter_step": adapter_step}


def choose_fit(cfg: RunConfig, model, train_rows, collator, out_dir: Path, lengths: list[int] | None = None) -> autofit.FitChoice:
    """Checkpoint every layer, or (fit: speed) as few as the budget allows, measured on the heaviest micro-batch."""
    packed = isinstance(collator, batches.PackedCollator)
    worst = batches.worst(train_rows, collator, cfg.token_budget() if packed else None, cfg.training.per_device_train_batch_size, lengths,
                          cfg.samples_per_step() if cfg.training.packed_step == "samples" else None)
    batch = {k: v.to(device()) if torch.is_tensor(v) else v for k, v in worst.items()}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fit = autofit.choose(cfg, model, batch, trainable, kernels.optimizer(cfg))
    fit.attention = attention_kernel(model)
    print(f"train: {fit.checkpointed_layers}/{fit.total_layers} layers checkpointed; {fit.reason}; attention: {fit.attention}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fit.json").write_text(json.dumps(memory.jsonable(fit), indent=2))
    return fit


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
    if t.fit == "speed":
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
    """Half the micro-batch (packed: half the widest micro-batch's tokens, never below the longest sample) and,
    where a step is counted in micro-batches, twice the accumulation: the same samples per step; None when it
    cannot get smaller."""
    t = cfg.training
    if packed:
        tokens = min(cfg.token_budget(), cfg.widest_packed(longest)) // 2
        if tokens < longest:
            return None
        # by samples a step keeps its samples in more micro-batches; by tokens it needs twice as many of them
        update = {"max_tokens_per_batch": tokens} | ({} if t.packed_step == "samples" else
                                                     {"gradient_accumulation_steps": t.gradient_accumulation_steps * 2})
        return cfg.model_copy(update={"training": t.model_copy(update=update)})
    if t.per_device_train_batch_size == 1:
        return None
    return cfg.model_copy(update={"training": t.halved()})


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


def _budget_gib(cfg: RunConfig) -> float | None:
    if cfg.preflight.gpu_memory_gib:
        return cfg.preflight.gpu_memory_gib
    return torch.cuda.get_device_properties(0).total_memory / memory.GIB if torch.cuda.is_available() else None


def _load_result(d: dict) -> TrainResult:
    mem = d.pop("memory")
    mem.pop("peak_gib", None)
    return TrainResult(
        **{k: Path(v) if k in ("adapter_dir", "loss_png", "memory_png") and v else v for k, v in d.items() if k != "skipped"},
        memory=MemoryReport(**mem) if mem else None,
        skipped=True,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Train a LoRA/QLoRA adapter (one stage of train-and-export).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. training.max_steps=20")
    ap.add_argument("--out", type=Path, help="stage directory (default: artifacts/runs/<new id>/train)")
    a = ap.parse_args(argv)
    if os.environ.get(launch.LAUNCHED):  # a rank started by launch.launch: never outlive the launcher
        launch.die_with_parent()
        if os.getppid() == 1:
            raise SystemExit("train: the launcher is already gone")
        if torch.cuda.is_available():  # streams, peak counters and the CUDA context of rank k belong on GPU k, not cuda:0
            torch.cuda.set_device(device())
    cfg = load_config(a.config, a.set)
    from stages.paths import RunPaths

    out = a.out or RunPaths.for_run(cfg).stage("train")
    r = run(cfg, out)
    if r is None:  # a DDP rank other than 0
        return
    print(f"adapter: {r.adapter_dir}  steps {r.steps}  loss {r.first_loss:.3f} -> {r.final_loss:.3f}  {r.tokens_per_s:.0f} tok/s")
