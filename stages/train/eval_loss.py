"""Eval loss during training: the held-out samples' loss every `training.eval_steps` optimizer steps.

The eval samples (data.eval_file, else data.eval_split of the training data, stages/data.eval_samples)
are tokenized exactly like the training ones (data.tokenize: same chat template, max_length and
long_sample_policy) and batched the way training batches them: padded micro-batches of
per_device_train_batch_size rows (sorted by length, so little padding), or, with packing on, packed
to the same token budget. Packed, no eval batch holds more tokens than the budget, but it can hold more
than every micro-batch a short training plan trains (preflight.eval_worst); padded, an eval batch is as
wide as its longest sample. Either way the preflight sizes the worst step by the eval batch where it is
the heavier (preflight.widen_for_eval, preflight.eval_worst). An OOM recovery that halves the
micro-batch halves the eval batches too.

The loss is normalised per loss-carrying token over the whole eval set:

    eval_loss = sum over batches (mean token loss of the batch x its loss-carrying tokens)
                / loss-carrying tokens of the eval set

the mean next-token cross-entropy over every assistant token, however the samples are batched:
padded and packed give the same number (packed, each sample's first label is masked; unpacked it
is never a target either). It is the training loss's normalisation too (the Trainer divides an
optimizer step's summed token losses by its loss-carrying tokens), so both curves share an axis.
The Trainer's own evaluation_loop averages per-batch means weighted by rows, which moves with the
batching; hence `measure` here and the Trainer's `evaluate` in stages/train/hf_trainer.py.

Memory: no gradients and nothing saved for backward, so an eval batch costs about one forward of
a training micro-batch, less than the step itself. The exception is the logits: in eval mode
Liger's patched forward materialises the vocab x tokens logits (its `skip_logits` defaults to
`self.training and labels is not None`), and the stock loss upcasts them to fp32 and takes a
log-softmax of the same size: ~10 bytes x tokens x vocab, 12 GiB for 8 x 1024 tokens of a 152k
vocabulary, more than a whole QLoRA training step of a 7B. `forward_kwargs` passes
`skip_logits=True` wherever the forward takes it, so eval uses the same chunked loss as training.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch

from stages import data
from stages.config import ConfigError, RunConfig
from stages.train import batches, packing


def eval_steps(cfg: RunConfig, has_eval: bool) -> int | None:
    """Optimizer steps between evals: training.eval_steps, null meaning save_steps; None without eval data.

    Raises:
        ConfigError: with training.load_best, save_steps is not a multiple of eval_steps (the adapter
            kept is a saved checkpoint, so every checkpoint needs an eval loss).
    """
    if not has_eval:
        return None
    t = cfg.training
    every = t.eval_steps or t.save_steps
    if t.load_best and t.save_steps % every:
        near = " or ".join(str(n) for n in sorted({every * max(1, t.save_steps // every), every * (t.save_steps // every + 1)}))
        raise ConfigError(
            f"training.save_steps ({t.save_steps}) is not a multiple of training.eval_steps ({every}): with training.load_best "
            f"the adapter kept is the saved checkpoint with the lowest eval loss, so every checkpoint needs one; set "
            f"training.save_steps to a multiple of eval_steps (e.g. {near}), or training.load_best: false"
        )
    return every


def rows(cfg: RunConfig, tokenizer) -> list[dict]:
    """The eval samples tokenized exactly like the training ones; rows left with no loss-carrying
    token (a truncated sample can lose its whole answer) are left out."""
    samples = data.eval_samples(cfg)
    if not samples:
        return []
    tok = data.tokenize(samples, tokenizer, cfg.data.max_length, cfg.data.long_sample_policy)
    return [r for r in batches.rows(tok) if any(label != -100 for label in r["labels"][1:])]


def micro_batches(cfg: RunConfig, rows: list[dict], packed: bool) -> list[list[dict]]:
    """The eval rows in micro-batches shaped like training's: padded, per_device_train_batch_size rows
    of similar length; packed, samples laid end to end up to the token budget (a fixed plan)."""
    if not rows:
        return []
    if packed:
        plan = packing.plan_epoch([len(r["input_ids"]) for r in rows], batches.token_budget(cfg), cfg.training.seed, 0)
        return [[rows[i] for i in b] for b in plan]
    by_length = sorted(rows, key=lambda r: len(r["input_ids"]))
    size = cfg.training.per_device_train_batch_size
    return [by_length[i:i + size] for i in range(0, len(by_length), size)]


def collate_like(collator: batches.Collator) -> Callable[[list[dict]], dict]:
    """One eval micro-batch (a list of rows) as model inputs, collated like training's. A collator
    of its own: the training one counts the micro-batches trained on (tokens/s, the post-mortem)."""
    if isinstance(collator, batches.PackedCollator):
        packed = batches.PackedCollator(collator.varlen)
        return lambda rows: packed([rows])
    return batches.Collator(collator.pad_id)


def loss_tokens(batch: dict) -> int:
    """Tokens that carry a loss: labels not -100 after the one-token shift (counted on the host, no sync)."""
    return int((batch["labels"][..., 1:] != -100).sum())


def forward_kwargs(model) -> dict:
    """skip_logits=True where the forward is Liger's (it takes the argument): the eval loss then never
    materialises the logits. The stock forward would pass an unknown keyword on to attention, so
    it gets nothing."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"skip_logits": True} if "skip_logits" in inspect.signature(base.forward).parameters else {}


def measure(model, items: list, collate: Callable[[list], dict], device: torch.device,
            autocast: Callable | None = None, *, counted: int | None = None, every_forward: bool = False) -> tuple[torch.Tensor, int]:
    """(summed token loss on `device`, loss-carrying tokens) over `items`, one collated micro-batch each.

    `autocast` makes the mixed-precision context training runs in (the Trainer's accelerator.autocast).
    Only the first `counted` items (default all) count; with `every_forward` every item runs through
    the model, even one without loss tokens: FSDP's forward is collective, so each process must run as
    many as the others.

    The model is in eval mode meanwhile (dropout off; transformers skips checkpointing there) and goes
    back to the mode it was in. The sum stays on the device: one sync at the end, not one per batch.
    """
    was_training = model.training
    extra = forward_kwargs(model)
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    model.eval()
    try:
        with torch.no_grad():
            for index, item in enumerate(items):
                batch = collate(item)
                n = loss_tokens(batch) if counted is None or index < counted else 0
                if n == 0 and not every_forward:  # a truncated sample can lose every assistant token: its mean loss would be NaN
                    continue
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                with (autocast or contextlib.nullcontext)():
                    loss = model(**batch, **extra).loss
                if n:
                    total += loss.double() * n
                    tokens += n
    finally:
        model.train(was_training)
    return total, tokens

