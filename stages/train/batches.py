"""Tokenized rows into micro-batches, padded or packed, and the dataset the Trainer reads.

Padded (`training.packing: off`): `per_device_train_batch_size` rows per micro-batch, each
padded to the longest; the micro-batch holding the longest sample is the worst step.
Packed (on): the samples of a step (packed_step: samples, as many as padded) or micro-batches filled
to `max_tokens_per_batch` tokens (packed_step: tokens), no padding (stages/train/packing.py); the worst
micro-batch is a budget of the longest samples, at most a step's worth.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from stages import data
from stages.config import RunConfig
from stages.train import packing

# Micro-batches of this many tokens or more get the tiled MLP (training.tiled_mlp: auto).
TILE_FROM_TOKENS = 32768
# The default packed budget stops here (where data.max_length allows): on the 7B QLoRA benchmark (R7, docs/benchmarks.md), steps of 32 samples, 16384- and
# 24576-token micro-batches trained within noise of each other (8,311-8,866 and 8,171-8,768 loss tokens/s over two
# calls), 32768 (the tiled MLP on) 6,173-6,227 (docs/benchmarks.md: packing_speed). The smaller of the fast two.
PACKED_BUDGET_DEFAULT_MAX = 16384


def token_budget(cfg: RunConfig) -> int:
    """Tokens per packed micro-batch: training.max_tokens_per_batch, or by default the padded run's worst
    micro-batch (micro-batch x data.max_length), which the preflight fits, cut to stay under the tiled MLP's
    switch where data.max_length allows: tiling pays one more MLP forward per layer, and a step packed into
    more, smaller micro-batches trains the same samples (packed_step: samples)."""
    t = cfg.training
    if t.max_tokens_per_batch:
        return t.max_tokens_per_batch
    if t._card_budget:  # widened (or kept) for this card: stages/train/widen.py
        return t._card_budget
    padded = t.per_device_train_batch_size * cfg.data.max_length
    if padded <= PACKED_BUDGET_DEFAULT_MAX or t.tiled_mlp == "on":
        return padded
    return max(cfg.data.max_length, PACKED_BUDGET_DEFAULT_MAX // cfg.data.max_length * cfg.data.max_length)


def token_budget_reason(cfg: RunConfig) -> str:
    """Why token_budget is what it is, for the preflight report and the train log."""
    t, budget = cfg.training, token_budget(cfg)
    if t.max_tokens_per_batch:
        return "training.max_tokens_per_batch"
    if t._card_reason:
        return t._card_reason
    padded = t.per_device_train_batch_size * cfg.data.max_length
    if budget == padded:
        return f"per_device_train_batch_size x data.max_length ({t.per_device_train_batch_size} x {cfg.data.max_length})"
    return (f"the widest multiple of data.max_length up to {PACKED_BUDGET_DEFAULT_MAX} tokens, among the fastest measured: the padded "
            f"worst case, {padded}, packs fewer, longer micro-batches" + (", and switches the tiled MLP on"
                                                                         if padded >= TILE_FROM_TOKENS else ""))


def with_card_budget(cfg: RunConfig, tokens: int | None, why: str) -> RunConfig:
    """`cfg` whose default packed budget is `tokens` on this card (None: the config's own), for the reason `why`
    (stages/train/widen.py); the YAML's own fields, and so the config's fingerprint, unchanged."""
    t = cfg.training.model_copy()
    t._card_budget, t._card_reason = tokens, why
    return cfg.model_copy(update={"training": t})


def samples_per_step(cfg: RunConfig) -> int:
    """Samples one optimizer step trains per process, padded or packed by samples (packed_step: samples)."""
    return cfg.training.per_device_train_batch_size * cfg.training.gradient_accumulation_steps


def widest_packed(cfg: RunConfig, longest: int) -> int:
    """Tokens in the heaviest packed micro-batch data whose longest sample has `longest` tokens can make: the
    budget, or (packed_step: samples) at most a step's samples, every one of them the longest."""
    if cfg.training.packed_step == "tokens":
        return token_budget(cfg)
    return min(token_budget(cfg), samples_per_step(cfg) * longest)



@dataclass
class Plan:
    """How a run's rows become micro-batches and optimizer steps; the figures go to train_result.json and the log."""

    packed: bool
    tokens_per_micro_batch: int     # packed: the budget; padded: micro-batch x longest sample
    micro_batches_per_epoch: int
    samples_per_micro_batch: float  # mean
    efficiency: float               # tokens trained on / tokens the micro-batches hold (padding; by tokens, unfilled budget)
    step: str = "samples"           # what a step is: samples (as padded) or tokens (packed_step: tokens)
    samples_per_step: float = 0.0   # mean, all processes
    tokens_per_step: float = 0.0    # mean sample tokens per optimizer step, all processes
    steps_per_epoch: float = 0.0
    epochs: float = 0.0             # what max_steps covers
    budget_reason: str = ""         # packed: why the micro-batches hold at most tokens_per_micro_batch tokens

    def describe(self) -> str:
        how = (f"packed, micro-batches of at most {self.tokens_per_micro_batch} tokens"
               + (f" ({self.budget_reason})" if self.budget_reason else "") if self.packed
               else f"padded (widest micro-batch {self.tokens_per_micro_batch} tokens)")
        return (f"{how}; an optimizer step trains {self.samples_per_step:.1f} samples, {self.tokens_per_step:,.0f} tokens "
                f"({'as many samples as padded' if self.step == 'samples' else 'a token budget: more samples than padded'}); "
                f"{self.steps_per_epoch:.1f} steps per epoch, so training.max_steps covers {self.epochs:.2f} epochs; "
                f"{self.efficiency:.0%} of the micro-batches' tokens are samples")


def halved(cfg: RunConfig, packed: bool, longest: int) -> dict[str, int] | None:
    """The training settings (`--set` keys) that halve the micro-batch and keep what a step trains: packed, half the
    widest micro-batch's tokens, never below the longest sample (by tokens, twice the accumulation: a step then needs
    twice as many micro-batches; by samples a step keeps its samples in more of them); padded, half the samples and
    twice the accumulation. None when it cannot get smaller. The OOM recovery retries with it, the preflight
    suggests it."""
    t = cfg.training
    if packed:
        tokens = min(token_budget(cfg), widest_packed(cfg, longest)) // 2
        if tokens < longest:
            return None
        return {"training.max_tokens_per_batch": tokens} | (
            {} if t.packed_step == "samples" else {"training.gradient_accumulation_steps": 2 * t.gradient_accumulation_steps})
    if t.per_device_train_batch_size == 1:
        return None
    b = t.per_device_train_batch_size // 2
    return {"training.per_device_train_batch_size": b,
            "training.gradient_accumulation_steps": t.gradient_accumulation_steps * t.per_device_train_batch_size // b}


def with_training(cfg: RunConfig, change: dict) -> RunConfig:
    """`cfg` with `change`'s training.* settings (halved's keys)."""
    update = {k.removeprefix("training."): v for k, v in change.items()}
    return cfg.model_copy(update={"training": cfg.training.model_copy(update=update)})


def dataset(cfg: RunConfig, train_rows, packed: bool, world_size: int = 1, lengths: list[int] | None = None):
    """What the Trainer iterates: the rows themselves (padded), or the packing plan's
    micro-batches for the whole run, in order (packed), and the plan's figures.

    `train_rows` is a list of rows or a memory-mapped table (data.TrainingSet.rows), whose
    `lengths` should then be given rather than read row by row."""
    lengths = lengths if lengths is not None else [len(r["input_ids"]) for r in train_rows]
    t = cfg.training
    total = sum(lengths)
    if not packed:
        eff = packing.padded_efficiency(lengths, t.per_device_train_batch_size, t.seed)
        n = -(-len(lengths) // t.per_device_train_batch_size)
        per_step = min(len(lengths), samples_per_step(cfg) * world_size)
        return train_rows, _figures(Plan(False, t.per_device_train_batch_size * max(lengths), n, len(lengths) / n, round(eff, 4)),
                                    cfg, len(lengths), total, per_step)
    size = token_budget(cfg)
    if max(lengths) > size:
        from stages.config import ConfigError

        raise ConfigError(f"training.max_tokens_per_batch is {size}, shorter than the longest sample ({max(lengths)} tokens); "
                          f"set it to at least {max(lengths)} (or at least data.max_length, {cfg.data.max_length})")
    if t.packed_step == "samples":
        steps = packing.plan_steps(lengths, size, samples_per_step(cfg), t.seed, t.max_steps, world_size)
        epoch_steps = packing.plan_steps(lengths, size, samples_per_step(cfg), t.seed, -(-len(lengths) // (samples_per_step(cfg) * world_size)),
                                         world_size)  # the first epoch's, for its figures
        first = [b for s in epoch_steps for b in s]
        per_step = min(len(lengths), samples_per_step(cfg) * world_size)  # an epoch's last step may hold fewer
        return (packing.PackedSteps(train_rows, steps),
                _figures(Plan(True, size, len(first), len(lengths) / len(first), 1.0),  # no padding, no budget to fill
                         cfg, len(lengths), total, per_step))
    epochs = packing.plan(lengths, size, t.seed, t.max_steps * t.gradient_accumulation_steps * world_size)
    first = epochs[0]
    per_step = len(lengths) / len(first) * t.gradient_accumulation_steps * world_size
    return (packing.PackedRows(train_rows, [b for e in epochs for b in e]),
            _figures(Plan(True, size, len(first), len(lengths) / len(first), round(packing.efficiency(lengths, first, size), 4), step="tokens"),
                     cfg, len(lengths), total, per_step))


def heaviest(cfg: RunConfig, lengths: list[int], world_size: int = 1, planned=None) -> list[int]:
    """Sample indices of the heaviest packed micro-batch this run will train. The plan is a function of the
    lengths, the budget, the seed and max_steps, so this is the run's own worst step, not the worst the data could
    make: the preflight sizes and probes exactly it.

    planned: what `dataset` returned for this run (packed), when the caller has it; None plans it here."""
    planned = planned if planned is not None else dataset(cfg, None, True, world_size, lengths)[0]
    if isinstance(planned, packing.PackedSteps):
        micro = [b for step in planned.steps for b in step]
    else:  # packed_step: tokens: whole epochs are planned, the Trainer reads max_steps' worth of them
        micro = planned.batches[: cfg.training.max_steps * cfg.training.gradient_accumulation_steps * world_size]
    return max(micro, key=lambda b: sum(lengths[i] for i in b))


def _figures(plan: Plan, cfg: RunConfig, samples: int, tokens: int, per_step: float) -> Plan:
    """Samples and tokens per optimizer step, steps per epoch and the epochs max_steps covers."""
    plan.samples_per_step = round(per_step, 2)
    plan.tokens_per_step = round(per_step * tokens / samples, 1)
    plan.steps_per_epoch = round(samples / per_step, 2)
    plan.epochs = round(cfg.training.max_steps / plan.steps_per_epoch, 3)
    if plan.packed:
        plan.budget_reason = token_budget_reason(cfg)
    return plan


def worst(train_rows, collator: Collator, packed_budget: int | None, micro_batch: int, lengths: list[int] | None = None,
          max_samples: int | None = None) -> dict:
    """The heaviest micro-batch this data can make, collated like `collator` does (but not counted
    by it): padded, the `micro_batch` longest rows; packed, the longest rows that fit one budget (and,
    a step of `max_samples` samples, no more of them)."""
    lengths = lengths if lengths is not None else [len(r["input_ids"]) for r in train_rows]
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)[:max(micro_batch, packed_budget or 0)]
    longest = [train_rows[i] for i in order]
    if packed_budget is None:
        return Collator(collator.pad_id)(longest[:micro_batch])
    picked, room = [], packed_budget
    for r in longest:
        if max_samples is not None and len(picked) == max_samples:
            break
        if len(r["input_ids"]) <= room:
            picked.append(r)
            room -= len(r["input_ids"])
    return PackedCollator(collator.varlen).one(picked)


def rows(tok: data.Tokenized) -> list[dict]:
    """In-memory rows of a small tokenized set (tests, held-out data); training reads data.TrainingSet.rows."""
    return [{"input_ids": i, "labels": l, "id": sid} for i, l, sid in zip(tok.input_ids, tok.labels, tok.ids, strict=True)]


class Collator:
    """Dynamic padding to the longest row (the batch holding the longest sample is the worst
    step); remembers recent batches' shapes and sample ids for an OOM post-mortem.

    The Trainer collates ahead of training (a whole optimizer step's micro-batches, plus one
    that accelerate prefetches), so the i-th micro-batch trained on is the i-th collated one,
    but the latest collated one is not the one running.
    """

    RECENT = 64  # more than one optimizer step's micro-batches plus the prefetched one

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id
        self.batch_tokens: list[int] = []  # non-padding tokens per micro-batch, counted on the host (no GPU sync)
        self.recent: collections.deque = collections.deque(maxlen=self.RECENT)  # (index, shape and ids)

    def tokens(self, consumed: int) -> int:
        """Tokens in the first `consumed` micro-batches."""
        return sum(self.batch_tokens[:consumed])

    def batch(self, index: int) -> dict:
        """Shape and sample ids of the `index`-th micro-batch (0-based), or the latest one known."""
        return next((b for i, b in self.recent if i == index), self.recent[-1][1] if self.recent else {})

    def __call__(self, batch: list[dict]) -> dict:
        width = max(len(r["input_ids"]) for r in batch)
        pad = [width - len(r["input_ids"]) for r in batch]
        self.recent.append((len(self.batch_tokens), {"shape": [len(batch), width], "ids": [r.get("id") for r in batch]}))
        self.batch_tokens.append(sum(len(r["input_ids"]) for r in batch))
        return {
            "input_ids": torch.tensor([r["input_ids"] + [self.pad_id] * n for r, n in zip(batch, pad, strict=True)]),
            "labels": torch.tensor([r["labels"] + [-100] * n for r, n in zip(batch, pad, strict=True)]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * n for r, n in zip(batch, pad, strict=True)]),
        }


class PackedCollator(Collator):
    """One packed micro-batch per Trainer item: its rows flattened (stages/packing.collate), with
    the same bookkeeping as the padded collator."""

    def __init__(self, varlen: bool) -> None:
        super().__init__(pad_id=0)
        self.varlen = varlen

    def __call__(self, batch: list[list[dict]]) -> dict:
        (item,) = batch  # the Trainer reads one item at a time: a packed micro-batch, or a step's (packed_step: samples)
        if isinstance(item, packing.Step):
            return {"micro_batches": [self._counted(rows) for rows in item]}
        return self._counted(item)

    def _counted(self, packed: list[dict]) -> dict:
        n = sum(len(r["input_ids"]) for r in packed)
        self.recent.append((len(self.batch_tokens), {"shape": [1, n], "ids": [r.get("id") for r in packed]}))
        self.batch_tokens.append(n)
        return self.one(packed)

    def one(self, packed: list[dict]) -> dict:
        """One packed micro-batch as model inputs, not counted."""
        return packing.collate(packed, varlen=self.varlen)
