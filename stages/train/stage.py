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
settings, stages/train/hf_trainer.py is the Trainer, stages/train/oom.py the OOM post-mortem and policy,
stages/train/launch.py the multi-process launcher.

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

from stages import data, inputs, memory, result_files
from stages.artifact import Artifact
from stages.config import RunConfig
from stages.memory import MemoryReport
from stages.model.load import device, load_tokenizer
from stages.train import autofit, batches, eval_loss, kernels, launch, sharding, widen
from stages.train.attention import attention_kernel
from stages.train.hf_trainer import InjectOOM, MemorySnapshot, StageTrainer, last_checkpoint, make_trainer, release, step_of
from stages.train.model import build_model
from stages.train.oom import describe_recovery, is_dataloader_shm_error, next_attempt, postmortem
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

    @classmethod
    def from_record(cls, record: dict, *, skipped: bool = True) -> TrainResult:
        """The result as stages.result_files saved it (also one saved before a field was added: its default);
        `skipped`: this process found it done, rather than trained it."""
        return result_files.restore(cls, record, skipped=skipped)

    def artifacts(self) -> list[Artifact]:
        """What the flow shows of training beside its memory table: memory per step and the eval curve, each if there."""
        return self._memory_steps() + self._eval_curve()

    def _memory_steps(self) -> list[Artifact]:
        # adapter_dir sits in the stage dir, so a result cached before this method existed finds the file too
        steps_file = self.adapter_dir.parent / memory.STEPS_FILE
        if not steps_file.is_file():
            return []
        rows = [json.loads(line) for line in steps_file.read_text().splitlines()]
        every = max(1, len(rows) // 100)  # at most ~100 rows in the UI; the PNG has them all
        return [Artifact("memory-steps-train", f"Memory per optimizer step (every {every}); plot: {self.memory_png}", table=rows[::every])]

    def _eval_curve(self) -> list[Artifact]:
        if not self.eval_curve:  # no eval data
            return []
        stop = f", stopped early at step {self.steps}" if self.stopped_early else ""
        return [Artifact("eval-loss-train", f"Eval loss per loss-carrying token on the held-out data; lowest {self.best_eval_loss:.4f} at step "
                                            f"{self.best_step}{stop}; adapter from step {self.adapter_step}; plot: {self.loss_png}",
                         table=self.eval_curve)]


def run(cfg: RunConfig, out_dir: Path, *, inject_oom_at: int | None = None) -> TrainResult:
    """Train the adapter into <out_dir>/adapter; resume from <out_dir>/checkpoints if present.

    On a CUDA out-of-memory error: write <out_dir>/oom-postmortem-<n>.json, then resume from
    the last checkpoint with half the micro-batch (packed: half the token budget) and twice the
    accumulation (the same effective batch and optimizer step), up to training.oom_retries times
    (stages/train/oom.py). Nothing of the failed attempt (model, optimizer, batches, the traceback's
    frames) is left when the model is built again; the recovery record says so (previous_attempt_freed).

    Several processes (DDP/FSDP) each train their share; process 0 writes the adapter and the result,
    and every process returns that result.

    Args:
        inject_oom_at: test hook; raise torch.OutOfMemoryError when optimizer step N begins
            (first attempt only).
    """
    out_dir = Path(out_dir)
    if (done := result_files.load_if_done(out_dir, "train", TrainResult)) is not None:
        print(f"train: adapter already trained in {out_dir / 'adapter'}; skipping")
        return done
    if cfg.training.launcher == "accelerate" and not os.environ.get(launch.LAUNCHED):
        return _launched(cfg, out_dir)
    inputs = _read_inputs(cfg)
    # the packed budget the preflight sized (its result, where this run has one, beside this stage's directory)
    cfg = widen.in_training(cfg, inputs.longest, result_files.load_if_done(out_dir.parent / "preflight", "preflight"))
    with Tracker(cfg, out_dir) as tracker:
        with memory.track("train", out_dir) as meter:
            final, recoveries = _train_until_it_fits(cfg, inputs, out_dir, tracker, inject_oom_at)
            # FSDP: every process hands in its shards of the adapter (with training.load_best, of the best
            # checkpoint, which the Trainer has loaded back by now); process 0 writes it, whole, once
            whole = sharding.adapter_state_dict(final.model) if sharding.is_sharded(final.model) else None
            ranks = sharding.per_rank_memory() if inputs.world > 1 or whole is not None else None
            trainable = _save_adapter(final, whole, out_dir)
            meter.extra |= _memory_extra(cfg, final, recoveries, ranks, inputs.world)
        result = done = None
        if final.trainer.is_world_process_zero():  # DDP/FSDP: rank 0 writes the adapter and the results
            result = _result(cfg, final, recoveries, trainable, meter.report, out_dir)
            done = result_files.save(out_dir, "train", result)
        result = _on_every_process(result, cfg, out_dir)
        if done:
            _track(tracker, result, out_dir, done)
    return result


@dataclass(frozen=True)
class Inputs:
    """What every attempt trains on: read once, before any model is built."""
    tokenizer: object
    rows: object               # data.TrainingSet.rows: memory-mapped
    lengths: list[int]
    held_out: list[dict]       # eval rows; [] without eval data
    longest: int               # tokens of the longest sample
    world: int                 # processes training together


@dataclass
class Attempt:
    """One try at training, with what it trained with; model and trainer are let go of (None) once it is done with them."""
    cfg: RunConfig
    settings: kernels.Settings
    plan: batches.Plan
    collator: batches.Collator | batches.PackedCollator
    model: object
    fit: autofit.FitChoice
    resume: Path | None        # the checkpoint it continued from
    trainer: StageTrainer | None
    wall_s: float = 0.0        # its trainer.train(), when it ran to the end

    @property
    def packed(self) -> bool:
        return self.settings.packing


def _read_inputs(cfg: RunConfig) -> Inputs:
    tokenizer = load_tokenizer(cfg.model)
    tset = data.training_set(cfg, tokenizer)  # tokenized once per content (the preflight made it), memory-mapped
    held_out = eval_loss.rows(cfg, tokenizer)
    every = eval_loss.eval_steps(cfg, bool(held_out))  # a save_steps/eval_steps clash fails here, before the model loads
    print(f"train: {_describe_eval(cfg, held_out, every)}")
    return Inputs(tokenizer, tset.rows, tset.lengths, held_out, max(tset.lengths), int(os.environ.get("WORLD_SIZE", "1")))


def _launched(cfg: RunConfig, out_dir: Path) -> TrainResult:
    """Train in the processes `launch.launch` starts on this machine; the result their process 0 saved
    (on another machine than 0, the copy its processes kept)."""
    with memory.track("train", out_dir / "launcher") as meter:
        launch.launch(cfg, out_dir)
    t = cfg.training
    if t.machine_rank > 0:
        print(f"train: machine {t.machine_rank} of {t.num_machines} done; machine 0 writes the adapter")
    saved = result_files.path(out_dir, "train") if t.machine_rank == 0 else launch.machine_result(out_dir, t.machine_rank)
    result = TrainResult.from_record(json.loads(saved.read_text()), skipped=False)
    result.memory = result.memory or meter.report
    return result


def _train_until_it_fits(cfg: RunConfig, inputs: Inputs, out_dir: Path, tracker: Tracker,
                         inject_oom_at: int | None) -> tuple[Attempt, list[dict]]:
    """Train to the end; after a CUDA OOM, free the attempt and train again as the OOM policy says (oom.next_attempt).
    The attempt that finished, and the record of each recovery."""
    attempt_cfg, recoveries = cfg, []
    while True:
        attempt = _prepare(attempt_cfg, inputs, out_dir, tracker, inject_oom_at, first=not recoveries)
        report = _train(attempt, out_dir / f"oom-postmortem-{len(recoveries) + 1}.json")
        if report is None:
            return attempt, recoveries
        freed = _free(attempt)
        report |= freed
        attempt_cfg, recovery = next_attempt(attempt_cfg, report, len(recoveries), attempt.packed, inputs.longest, attempt.plan,
                                             last_checkpoint(out_dir / "checkpoints"), freed)
        recoveries.append(recovery)
        print(describe_recovery(report, recovery))


def _prepare(cfg: RunConfig, inputs: Inputs, out_dir: Path, tracker: Tracker, inject_oom_at: int | None, *,
             first: bool) -> Attempt:
    """Micro-batches, model, fit and Trainer of one attempt, resuming from the last checkpoint if there is one;
    the test hook and the memory snapshot only in the `first`."""
    settings = kernels.settings(cfg, inputs.longest)   # once per attempt: the recovery changes the config
    dataset, plan = batches.dataset(cfg, inputs.rows, settings.packing, inputs.world, inputs.lengths)
    collator = (batches.PackedCollator(varlen=settings.packed_attention == "varlen") if settings.packing
                else batches.Collator(inputs.tokenizer.pad_token_id))
    print(f"train: {plan.describe()}")
    model = build_model(cfg, inputs.longest, settings)
    fit = choose_fit(cfg, model, inputs.rows, collator, out_dir, inputs.lengths, settings)
    resume = last_checkpoint(out_dir / "checkpoints")
    hooks = [InjectOOM(inject_oom_at)] if inject_oom_at and first else []
    if cfg.training.memory_snapshot_steps and torch.cuda.is_available() and first:
        hooks.append(MemorySnapshot(cfg.training.memory_snapshot_steps, out_dir / "memory_snapshot.pickle"))
    hooks += tracker.callbacks(step_of(resume) if resume else 0)
    trainer = make_trainer(cfg, model, dataset, collator, out_dir, callbacks=hooks, eval_rows=inputs.held_out,
                           memory_sinks=(tracker.memory,), settings=settings)
    if resume:
        print(f"train: resuming from {resume}")
    return Attempt(cfg, settings, plan, collator, model, fit, resume, trainer)


def _train(attempt: Attempt, postmortem_path: Path) -> dict | None:
    """Run the attempt's Trainer: None when it trained to the end, its post-mortem when CUDA ran out of memory."""
    resume = attempt.resume
    t0 = time.perf_counter()
    try:
        attempt.trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    except torch.OutOfMemoryError as e:
        report = postmortem(e, attempt.cfg, attempt.trainer, attempt.model, attempt.collator, postmortem_path)
        # The traceback keeps every frame of the failed step alive (the Trainer's loop with its model,
        # optimizer and batches; the forward's activations), and a frame that re-raised holds the
        # exception in a cycle only the collector breaks: their locals go now, before the rebuild.
        traceback.clear_frames(e.__traceback__)
        return report
    except RuntimeError as e:
        if is_dataloader_shm_error(e):
            raise RuntimeError(
                f"not a GPU out-of-memory: a DataLoader worker ran out of shared memory (/dev/shm) ({e}); "
                "keep dataloader workers at 0 or give the container more /dev/shm (docker --shm-size)"
            ) from e
        raise
    attempt.wall_s = time.perf_counter() - t0
    return None


def _free(attempt: Attempt) -> dict:
    """Let go of a failed attempt's model and Trainer (the exception is gone by now) and return what that left."""
    failed = [weakref.ref(x) for x in (attempt.model, attempt.trainer.optimizer) if x is not None]
    release(attempt.trainer)
    attempt.trainer = attempt.model = None
    memory.free_gpu()
    freed = {"previous_attempt_freed": all(r() is None for r in failed)} | {
        k: round(v, 4) for k, v in memory.stats().items() if k in ("alloc_gib", "reserved_gib")}
    if not freed["previous_attempt_freed"]:
        print(f"train: WARNING: the failed attempt is still reachable ({_holders(failed)}); the rebuild may run out too")
    return freed


def _holders(refs: list) -> str:
    """What still refers to a failed attempt's objects (for the warning that says the rebuild may not fit)."""
    import gc

    alive = [r() for r in refs if r() is not None]
    return "; ".join(f"{type(x).__name__} held by " + ", ".join(sorted({type(h).__name__ for h in gc.get_referrers(x)})[:6]) for x in alive)


def _save_adapter(final: Attempt, whole: dict | None, out_dir: Path) -> int:
    """Process 0 writes the adapter (`whole`: gathered from FSDP shards); every process lets go of the model.
    Its trainable parameters (a shard counts its whole tensor)."""
    release(final.trainer)
    if final.trainer.is_world_process_zero():
        final.model.save_pretrained(out_dir / "adapter", safe_serialization=True, **({"state_dict": whole} if whole else {}))
    trainable = sum(p.numel() for p in final.model.parameters() if p.requires_grad)
    # Trainer and model hold each other through cycles (callbacks, hooks, Liger's bound forward):
    # collected here, inside the stage, or the next stage would start with this model still allocated.
    final.model = None
    memory.free_gpu()
    return trainable


def _memory_extra(cfg: RunConfig, final: Attempt, recoveries: list[dict], ranks: list[dict] | None, world: int) -> dict:
    """The train stage's figures in memory.json beside the peaks."""
    extra = {"steps_this_process": final.trainer.state.global_step - (step_of(final.resume) if final.resume else 0),
             "oom_recoveries": recoveries, "fit": memory.jsonable(final.fit)}
    if ranks:  # each process's own peak: with fsdp, what one GPU holds of the sharded model
        extra |= {"per_rank": ranks,
                  "distributed": {"kind": cfg.training.distributed, "processes": world, "machines": cfg.training.num_machines}}
    return extra


def _result(cfg: RunConfig, final: Attempt, recoveries: list[dict], trainable: int, report: MemoryReport,
            out_dir: Path) -> TrainResult:
    """Process 0's result: losses and evals from the Trainer's state, the plots, the memory report."""
    trainer = final.trainer
    losses = [e for e in trainer.state.log_history if "loss" in e]
    evals = evaluation(trainer, cfg)
    tokens = final.collator.tokens(trainer.micro_batches) * trainer.args.world_size  # each DDP rank trains its own share
    return TrainResult(
        adapter_dir=out_dir / "adapter",
        steps=trainer.state.global_step,
        first_loss=losses[0]["loss"] if losses else float("nan"),
        final_loss=losses[-1]["loss"] if losses else float("nan"),
        train_tokens=tokens,
        tokens_per_s=round(tokens / final.wall_s, 1) if final.wall_s > 0 else 0.0,
        trainable_params=trainable,
        resumed_from=str(final.resume) if final.resume else None,
        loss_png=plot_loss(losses, out_dir, evals["eval_curve"]),
        memory=report,
        oom_recoveries=recoveries,
        memory_png=plot_memory(out_dir, _budget_gib(cfg)),
        fit=memory.jsonable(final.fit),
        batches=asdict(final.plan),
        **evals,
    )


def _track(tracker: Tracker, result: TrainResult, out_dir: Path, done: Path) -> None:
    """The plots, the eval record and the result file to the trackers (process 0; after the others have the result)."""
    tracker.finish(result.steps, [result.loss_png, result.memory_png, out_dir / "eval_loss.jsonl", done],
                   {k: getattr(result, k) for k in ("final_loss", "tokens_per_s", "best_step", "best_eval_loss", "stopped_early", "adapter_step")})


def _on_every_process(result: TrainResult | None, cfg: RunConfig, out_dir: Path) -> TrainResult:
    """Process 0's result (None in the others), as it saved it, in every process. Every process must call it.
    A machine other than 0 keeps a copy for its launcher, which may not see machine 0's files."""
    record = sharding.from_process_zero(result_files.load(out_dir, "train") if result is not None else None)
    if result is not None:
        return result
    if cfg.training.machine_rank > 0 and os.environ.get("LOCAL_RANK") == "0":
        launch.machine_result(out_dir, cfg.training.machine_rank).write_text(json.dumps(record, indent=2))
    return TrainResult.from_record(record, skipped=False)


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


def choose_fit(cfg: RunConfig, model, train_rows, collator, out_dir: Path, lengths: list[int] | None = None,
               settings: kernels.Settings | None = None) -> autofit.FitChoice:
    """Checkpoint every layer, or (fit: speed) as few as the budget allows, measured on the heaviest micro-batch."""
    settings = settings or kernels.settings(cfg)
    packed = isinstance(collator, batches.PackedCollator)
    worst = batches.worst(train_rows, collator, batches.token_budget(cfg) if packed else None, cfg.training.per_device_train_batch_size, lengths,
                          batches.samples_per_step(cfg) if cfg.training.packed_step == "samples" else None)
    batch = {k: v.to(device()) if torch.is_tensor(v) else v for k, v in worst.items()}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fit = autofit.choose(cfg, model, batch, trainable, settings.optim, settings.offload_activations)
    fit.attention = attention_kernel(model)
    print(f"train: {fit.checkpointed_layers}/{fit.total_layers} layers checkpointed; {fit.reason}; attention: {fit.attention}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fit.json").write_text(json.dumps(memory.jsonable(fit), indent=2))
    return fit


def _budget_gib(cfg: RunConfig) -> float | None:
    if cfg.preflight.gpu_memory_gib:
        return cfg.preflight.gpu_memory_gib
    return torch.cuda.get_device_properties(0).total_memory / memory.GIB if torch.cuda.is_available() else None


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
    cfg = inputs.load(a.config, a.set)
    from stages.paths import RunPaths

    out = a.out or RunPaths.for_run(cfg).stage("train")
    r = run(cfg, out)
    if int(os.environ.get("RANK", "0")) > 0 or cfg.training.machine_rank > 0:  # said once, by process 0 of machine 0
        return
    print(f"adapter: {r.adapter_dir}  steps {r.steps}  loss {r.first_loss:.3f} -> {r.final_loss:.3f}  {r.tokens_per_s:.0f} tok/s")
