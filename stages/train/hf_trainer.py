"""The HF Trainer as training (and the preflight's probe) runs it, its callbacks, and how
a finished or failed one lets go of the model.

With eval rows, the Trainer evaluates every `training.eval_steps` (stages/train/eval_loss.py: loss per
loss-carrying token of the whole eval set), stops early after `training.early_stopping_patience`
evals without a lower eval loss (transformers' EarlyStoppingCallback), and with `training.load_best`
ends holding the checkpoint of the lowest eval loss (load_best_model_at_end on eval_loss).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
import weakref
from pathlib import Path

import torch
from transformers import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from stages import errors, memory
from stages.config import RunConfig
from stages.model.load import compute_dtype, device
from stages.train import eval_loss, kernels, optim_state, sharding
from stages.train.offload import OffloadActivations
from stages.train.packing import PackedRows, PackedSteps


class _NumericCheckpointOrder(logging.Filter):
    """The Trainer sorts checkpoints by mtime and, when two were saved within a second (short
    steps, coarse file systems), warns and sorts them by step number instead: what we want anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "mtime may not be reliable" not in record.getMessage()


logging.getLogger("transformers.trainer_utils").addFilter(_NumericCheckpointOrder())


def make_trainer(cfg: RunConfig, model, train_rows, collator, out_dir: Path,
                 callbacks: list | None = None, *, eval_rows: list[dict] | None = None,
                 memory_sinks: tuple = (), settings: kernels.Settings | None = None, **overrides) -> StageTrainer:
    """The HF Trainer exactly as training uses it; `overrides` change TrainingArguments (the probe's 2 steps).

    Args:
        train_rows: a list of rows (padded), a PackedSteps plan (packed by samples: the Trainer reads one
            optimizer step's micro-batches per item) or a PackedRows plan (packed by tokens: one packed
            micro-batch per item), in the plan's order, which is already shuffled and seeded.
        eval_rows: tokenized held-out rows (batches.rows); none or empty: no eval, and the eval
            settings (eval_steps, early_stopping_patience, load_best) do nothing.
        memory_sinks: callables given each per-step memory row as it is written (the trackers).
        settings: the run's resolved settings (kernels.settings); None resolves them here.
    """
    t, s = cfg.training, settings or kernels.settings(cfg)
    packed = isinstance(train_rows, (PackedRows, PackedSteps))
    eval_items = eval_loss.micro_batches(cfg, eval_rows or [], packed)  # shaped like the training micro-batches
    every = eval_loss.eval_steps(cfg, bool(eval_items))
    args = _training_arguments(cfg, model, out_dir, packed, by_step=isinstance(train_rows, PackedSteps), eval_every=every,
                               optim=s.optim, **overrides)
    stop_early = [EarlyStoppingCallback(t.early_stopping_patience)] if every and t.early_stopping_patience else []
    return StageTrainer(
        model=model, args=args, train_dataset=train_rows, eval_dataset=eval_items if every else None,
        data_collator=collator, offload_activations=s.offload_activations, eval_collate=eval_loss.collate_like(collator) if every else None,
        callbacks=[Interruptible(), MemoryCallback(out_dir / memory.STEPS_FILE, memory_sinks), *stop_early, *(callbacks or [])],
    )


def _training_arguments(cfg: RunConfig, model, out_dir: Path, packed: bool, *, by_step: bool, eval_every: int | None,
                        optim: str, **overrides) -> TrainingArguments:
    """The stage's TrainingArguments: the config's training section, eval every `eval_every` steps (None: no eval),
    FSDP in a launched process; `overrides` last.

    Args:
        packed: each item of the dataset is packed (one micro-batch, or with `by_step` one step's micro-batches).
    """
    kwargs = _train_kwargs(cfg, out_dir, packed, by_step, optim) | _eval_kwargs(cfg, eval_every)
    kwargs |= sharding.trainer_args(cfg, model)  # distributed: fsdp, in a launched process
    args = TrainingArguments(**(kwargs | overrides))
    if args.n_gpu > 1:
        # One process and several visible GPUs: the Trainer would wrap nn.DataParallel, which copies the
        # model to every GPU each step and puts Liger's loss terms on two devices. One process trains on
        # its own GPU; several GPUs are `launcher: accelerate` (DDP).
        args._n_gpu = 1
    return args


def _train_kwargs(cfg: RunConfig, out_dir: Path, packed: bool, by_step: bool, optim: str) -> dict:
    t = cfg.training
    on_gpu = device().type == "cuda"
    dtype = compute_dtype(cfg.model.torch_dtype)
    return dict(
        output_dir=str(out_dir / "checkpoints"),
        per_device_train_batch_size=1 if packed else t.per_device_train_batch_size,
        # by step, the Trainer reads a whole step as one item and training_step runs its micro-batches
        gradient_accumulation_steps=1 if by_step else t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        max_steps=t.max_steps,
        optim=optim,
        train_sampling_strategy="sequential" if packed else t.train_sampling_strategy,
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
        include_num_input_tokens_seen="no",  # its count calls .item() every micro-batch: the Collator counts instead
        report_to=[],
        ddp_find_unused_parameters=False,  # every adapter gets a gradient; the search would cost a pass
        disable_tqdm=False,
        logging_first_step=True,
    )


def _eval_kwargs(cfg: RunConfig, every: int | None) -> dict:
    if not every:
        return {}
    return dict(eval_strategy="steps", eval_steps=every, metric_for_best_model="eval_loss", greater_is_better=False,
                load_best_model_at_end=cfg.training.load_best,
                prediction_loss_only=True)  # any other eval path (predict) gathers no logits either


class StageTrainer(Trainer):
    """The forward runs with saved activations offloaded to pinned CPU memory (when on), the
    micro-batches trained on are counted (tokens/s, the OOM post-mortem's batch), and eval loss
    is per loss-carrying token of the whole eval set.

    Args:
        offload_activations: offload saved activations (kernels.offload_activations).
        eval_collate: collates an eval micro-batch (eval_loss.collate_like); None without eval.
    """

    def __init__(self, *a, offload_activations: bool = False, eval_collate=None, **kw):
        super().__init__(*a, **kw)
        self.offload = OffloadActivations(self.model) if offload_activations else None
        self.eval_collate = eval_collate
        self.micro_batches = 0  # trained on in this process (an epoch's last step can have fewer than the accumulation)
        self.evaluating = False  # stays True if an eval batch ran out of memory (the post-mortem says so)

    def create_accelerator_and_postprocess(self):
        # Kept: Trainer.__init__ reads is_fsdp_enabled right after this (model placement, then wrapping), so FSDP
        # on CPU must be switched on here, not after the Trainer is built.
        super().create_accelerator_and_postprocess()
        sharding.enable_on_cpu(self)  # FSDP on gloo as on GPUs (accelerate would run DDP there)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        """Eval loss on this process's share of the eval micro-batches, summed over processes, then
        logged and handed to the callbacks (early stopping, best checkpoint) as the Trainer's own is."""
        start = time.perf_counter()
        items = self.eval_dataset if eval_dataset is None else eval_dataset
        self.evaluating = True
        mine = list(items[self.args.process_index::self.args.world_size])
        counted = len(mine)
        if self.is_fsdp_enabled:  # a sharded forward is collective: every process runs as many, extras not counted
            mine += [items[0]] * (-(-len(items) // self.args.world_size) - counted)
        total, tokens = eval_loss.measure(self.model, mine, self.eval_collate, self.args.device, self.accelerator.autocast,
                                          counted=counted, every_forward=self.is_fsdp_enabled)
        self.evaluating = False
        summed = self.accelerator.reduce(torch.stack([total, torch.tensor(float(tokens), dtype=total.dtype, device=total.device)]),
                                         reduction="sum")
        total, tokens = summed.tolist()
        metrics = {f"{metric_key_prefix}_loss": total / tokens if tokens else float("nan"),
                   f"{metric_key_prefix}_tokens": int(tokens), f"{metric_key_prefix}_runtime": round(time.perf_counter() - start, 3)}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _save_checkpoint(self, model, trial):
        # Private override kept: the fix of the best-checkpoint record (sharding.agree_on_best_checkpoint) rewrites
        # state and the checkpoint's trainer_state.json, so it belongs here, before any callback's on_save reads them.
        super()._save_checkpoint(model, trial)
        if self.is_fsdp_enabled:
            sharding.agree_on_best_checkpoint(self)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Private override kept: the one place the Trainer reads a checkpoint's optimizer state into the optimizer it
        # built. A checkpoint of the other AdamW (the OOM fallback from fit: speed to fit: memory resumes the fused
        # AdamW's checkpoint with 8-bit AdamW) gets its moments carried over instead of a KeyError at the next step.
        inner = getattr(self.optimizer, "optimizer", self.optimizer)   # accelerate's wrapper holds the optimizer built
        saved = None if checkpoint is None or self.is_fsdp_enabled else optim_state.read_other(Path(checkpoint) / OPTIMIZER_NAME, inner)
        if saved is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        optim_state.adopt(inner, saved)
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_NAME, weights_only=True))
        optim = getattr(self.args.optim, "value", self.args.optim)
        print(f"train: {Path(checkpoint).name}'s AdamW moments carried over to {optim}", flush=True)

    def training_step(self, model, inputs, num_items_in_batch=None):
        parts = inputs.get("micro_batches") if isinstance(inputs, dict) else None
        if parts is None:
            self.micro_batches += 1
            return super().training_step(model, inputs, num_items_in_batch)
        # One optimizer step's micro-batches (packed_step: samples): gradients accumulate over them, synced
        # across processes on the last only; each loss is divided by the step's loss-carrying tokens.
        total = None
        for j, part in enumerate(parts):
            self.micro_batches += 1
            sync = contextlib.nullcontext() if j == len(parts) - 1 else self.accelerator.no_sync(model)
            with sync:
                loss = super().training_step(model, part, num_items_in_batch)
            total = loss if total is None else total + loss
        return total

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        # A step item (packed_step: samples) has no labels of its own: count the loss-carrying tokens of all its
        # micro-batches the Trainer's way (summed over processes). Public hook, private counter only called: if
        # transformers renames it this fails loudly, where an override of it would silently stop being called.
        if any("micro_batches" in b for b in batch_samples):
            flat = [p for b in batch_samples for p in (b["micro_batches"] if "micro_batches" in b else [b])]
            num_items = self._get_num_items_in_batch(flat, device)
        return batch_samples, num_items

    def floating_point_ops(self, inputs):
        return 0  # transformers' token count reads input_ids at the top of the batch, which a step item has not

    def compute_loss_context_manager(self):
        stack = super().compute_loss_context_manager()
        if self.offload is not None:
            self.offload.reset()  # the previous micro-batch's backward is done
            stack.enter_context(self.offload)
        return stack


def release(trainer) -> None:
    """Drop every reference a Trainer (finished or failed) holds to the model, its optimizer
    states and the offloaded activations, so that freeing the model returns all its memory.
    Keeps what the results need (state, args, the micro-batch count)."""
    if trainer.model is not None:
        forget_optimizer_overrides(trainer.model)
    if trainer.offload is not None:
        trainer.offload.reset()
        trainer.offload = None
    trainer.accelerator.free_memory()  # accelerate's lists of prepared models, optimizers and dataloaders
    trainer.model = trainer.model_wrapped = trainer.optimizer = trainer.lr_scheduler = None
    handler = trainer.callback_handler
    handler.model = handler.optimizer = handler.lr_scheduler = handler.train_dataloader = handler.eval_dataloader = None


def forget_optimizer_overrides(model) -> None:
    """Unregister the model's modules from bitsandbytes' process-wide GlobalOptimManager.

    With an 8-bit bitsandbytes optimizer the HF Trainer registers every nn.Embedding there for
    32-bit states, and nothing ever unregisters it: the table outlived its model, one more per
    build in a process (measured: +445 MiB per build of a tied Qwen2.5-1.5B; the probe's table
    was still allocated during training). A table in host memory (HostEmbedding) is no
    nn.Embedding, so only tied models, whose table stays on the GPU, leaked by default.
    """
    bnb_optim = sys.modules.get("bitsandbytes.optim")
    if bnb_optim is None:  # never imported: nothing registered
        return
    manager = bnb_optim.GlobalOptimManager.get_instance()
    mine = {id(m) for m in model.modules()}
    manager.module_weight_config_triple = [t for t in manager.module_weight_config_triple if id(t[0]) not in mine]


class Interruptible(TrainerCallback):
    """A Ctrl-C whose KeyboardInterrupt a finalizer swallowed still stops training, at the next micro-batch
    (stages/errors.py check_interrupted)."""

    def on_substep_end(self, args, state, control, **kwargs):
        errors.check_interrupted()

    def on_step_end(self, args, state, control, **kwargs):
        errors.check_interrupted()


class MemoryCallback(TrainerCallback):
    """Appends memory.stats() at every optimizer step to a JSON-lines file, and hands the same row
    to each of `sinks` (the trackers, stages/train/tracking.py).

    Only reads state; the CUDA figures come from the allocator's counters, not a sync.
    """

    def __init__(self, path: Path, sinks: tuple = ()) -> None:
        self.path, self.sinks = path, sinks
        path.parent.mkdir(parents=True, exist_ok=True)

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return control
        row = {"step": state.global_step, "time": round(time.time(), 3)} | {
            k: round(v, 4) for k, v in memory.stats().items()
        }
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for sink in self.sinks:
            sink(row)
        return control


def last_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint (trainer_state.json is written last)."""
    done = [p for p in ckpt_dir.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    return max(done, key=step_of, default=None)


def step_of(p: Path) -> int:
    return int(p.name.rsplit("-", 1)[1])


class MemorySnapshot(TrainerCallback):
    """Every CUDA allocation (with its stack) of the first `steps` optimizer steps, for PyTorch's memory viewer."""

    recording = False

    def __init__(self, steps: int, path: Path) -> None:
        self.steps, self.path = steps, path

    def on_train_begin(self, args, state, control, **kwargs):
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        MemorySnapshot.recording = True
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if MemorySnapshot.recording and state.global_step >= self.steps:
            torch.cuda.memory._dump_snapshot(str(self.path))
            torch.cuda.memory._record_memory_history(enabled=None)
            MemorySnapshot.recording = False
        return control


class InjectOOM(TrainerCallback):
    """Test hook: a CUDA out-of-memory error at the start of optimizer step `step`. `InjectOOM.failed` keeps weak
    references to what the failed attempt trained with (model, optimizer, dataloader), so a test can check that
    none of it is alive when the model is built again."""

    failed: dict = {}

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            InjectOOM.failed = {k: weakref.ref(kwargs[k]) for k in ("model", "optimizer", "train_dataloader") if kwargs.get(k) is not None}
            kwargs["model"].register_forward_pre_hook(self._raise)  # from inside the forward, as a real one comes
        return control

    def _raise(self, module, args):
        raise torch.OutOfMemoryError(f"injected CUDA out of memory at step {self.step} (test hook)")
