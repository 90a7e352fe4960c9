"""Tokenized rows into micro-batches, padded or packed, and the dataset the Trainer reads.

Padded (`training.packing: off`): `per_device_train_batch_size` rows per micro-batch, each
padded to the longest; the micro-batch holding the longest sample is the worst step.
Packed (on): micro-batches of up to `max_tokens_per_batch` tokens, no padding
(stages/packing.py); the worst step is a full budget of the longest samples.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from stages import data, packing
from stages.config import RunConfig


@dataclass
class Plan:
    """How a run's rows become micro-batches; the figures go to train_result.json."""

    packed: bool
    tokens_per_micro_batch: int     # packed: the budget; padded: micro-batch x longest sample
    micro_batches_per_epoch: int
    samples_per_micro_batch: float  # mean
    efficiency: float               # tokens trained on / tokens the micro-batches hold (padding, unfilled budget)


def dataset(cfg: RunConfig, train_rows, packed: bool, world_size: int = 1, lengths: list[int] | None = None):
    """What the Trainer iterates: the rows themselves (padded), or the packing plan's
    micro-batches for the whole run, in order (packed), and the plan's figures.

    `train_rows` is a list of rows or a memory-mapped table (data.TrainingSet.rows), whose
    `lengths` should then be given rather than read row by row."""
    lengths = lengths if lengths is not None else [len(r["input_ids"]) for r in train_rows]
    t = cfg.training
    if not packed:
        eff = packing.padded_efficiency(lengths, t.per_device_train_batch_size, t.seed)
        n = -(-len(lengths) // t.per_device_train_batch_size)
        return train_rows, Plan(False, t.per_device_train_batch_size * max(lengths), n, len(lengths) / n, round(eff, 4))
    size = cfg.token_budget()
    if max(lengths) > size:
        from stages.config import ConfigError

        raise ConfigError(f"training.max_tokens_per_batch is {size}, shorter than the longest sample ({max(lengths)} tokens); "
                          f"set it to at least {max(lengths)} (or at least data.max_length, {cfg.data.max_length})")
    epochs = packing.plan(lengths, size, t.seed, t.max_steps * t.gradient_accumulation_steps * world_size)
    first = epochs[0]
    return (packing.PackedRows(train_rows, [b for e in epochs for b in e]),
            Plan(True, size, len(first), len(lengths) / len(first), round(packing.efficiency(lengths, first, size), 4)))


def worst(train_rows, collator: Collator, packed_budget: int | None, micro_batch: int, lengths: list[int] | None = None) -> dict:
    """The heaviest micro-batch this data can make, collated like `collator` does (but not counted
    by it): padded, the `micro_batch` longest rows; packed, the longest rows that fit one budget."""
    lengths = lengths if lengths is not None else [len(r["input_ids"]) for r in train_rows]
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)[:max(micro_batch, packed_budget or 0)]
    longest = [train_rows[i] for i in order]
    if packed_budget is None:
        return Collator(collator.pad_id)(longest[:micro_batch])
    picked, room = [], packed_budget
    for r in longest:
        if len(r["input_ids"]) <= room:
            picked.append(r)
            room -= len(r["input_ids"])
    return PackedCollator(collator.varlen)([picked])


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
        (packed,) = batch  # the Trainer reads one packed micro-batch at a time
        n = sum(len(r["input_ids"]) for r in packed)
        self.recent.append((len(self.batch_tokens), {"shape": [1, n], "ids": [r.get("id") for r in packed]}))
        self.batch_tokens.append(n)
        return packing.collate(packed, varlen=self.varlen)
