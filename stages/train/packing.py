"""Padding-free packing: samples laid end to end into micro-batches of at most a token budget, one row each.

A padded micro-batch pays for every row up to its longest sample; on long-tailed chat data
(median 512, p99 4k tokens) half of a micro-batch of 4 is padding, and a few short samples
leave a GPU idle. Here a micro-batch is a set of samples whose lengths sum to at most
`training.max_tokens_per_batch`, laid end to end with no padding:

    input_ids     a1 a2 a3 b1 b2 c1 c2 c3 c4          one row, no pad token
    position_ids  0  1  2  0  1  0  1  2  3           restart per sample: RoPE sees each sample alone
    labels        -  a2 a3 -  b2 -  c2 c3 c4          the first token of each sample carries no loss,
                                                      so b1 is never a target of a3 (as unpacked)

Sample boundaries reach attention as `cu_seq_lens` (the varlen kernel) or, from the
restarting position ids, as transformers' block-diagonal causal mask (SDPA, eager, flex):
no token attends across samples. The loss is the same as unpacked: the Trainer sums the
token losses of an optimizer step and divides by that step's loss-carrying tokens, packed
or not (`num_items_in_batch`).

What an optimizer step trains (`training.packed_step`): `samples` (the default) keeps a padded run's
step, per_device_train_batch_size x gradient_accumulation_steps samples per process, packed into as few
micro-batches of the budget as hold them (plan_steps); `tokens` makes every micro-batch a full budget
and a step gradient_accumulation_steps of them (plan), which holds many more samples than padded.

The plan is deterministic: each epoch shuffles the samples with (seed, epoch), then packs
each window of WINDOW samples first-fit-decreasing and shuffles that window's micro-batches.
Epochs differ, a run resumed from a checkpoint replays exactly the same micro-batches, and
the longest samples do not all land at the start.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

WINDOW = 2048  # samples packed together: larger fills better, smaller keeps more of the shuffle


class PackingError(ValueError):
    pass


def plan_epoch(lengths: Sequence[int], budget: int, seed: int, epoch: int, window: int = WINDOW) -> list[list[int]]:
    """Micro-batches (lists of sample indices) of one epoch, each holding at most `budget` tokens."""
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if too_long:
        raise PackingError(f"{len(too_long)} sample(s) are longer than the token budget {budget} (longest "
                           f"{max(lengths[i] for i in too_long)}); training.max_tokens_per_batch must be at least data.max_length")
    rng = random.Random(f"{seed}/{epoch}")  # a str seed is hashed with sha512: the same on every machine and run
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        packed = _first_fit_decreasing(order[start:start + window], lengths, budget)
        rng.shuffle(packed)
        batches += packed
    return batches


def _first_fit_decreasing(indices: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(indices, key=lambda i: -lengths[i]):  # stable: ties keep the shuffled order
        n = lengths[i]
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(budget - n)
    return bins


def plan(lengths: Sequence[int], budget: int, seed: int, micro_batches: int) -> list[list[list[int]]]:
    """As many epochs as hold at least `micro_batches` micro-batches in all (at least one).

    The Trainer reads them concatenated, in order (one packed row per micro-batch): its resume
    skips exactly the micro-batches already trained on.
    """
    epochs = [plan_epoch(lengths, budget, seed, 0)]
    while sum(map(len, epochs)) < micro_batches:
        epochs.append(plan_epoch(lengths, budget, seed, len(epochs)))
    return epochs


def plan_steps(lengths: Sequence[int], budget: int, samples: int, seed: int, steps: int, world: int = 1) -> list[list[list[int]]]:
    """Optimizer steps that train `samples` samples per process, as a padded run's do, each packed into as
    few micro-batches of at most `budget` tokens as hold them, the same number on every process (DDP and
    FSDP run their collectives once per micro-batch).

    Returns one item per (step, process) in the order the Trainer deals them out, process after process:
    the micro-batches (lists of sample indices) that process trains in that step. Epochs shuffle with
    (seed, epoch), as many as `steps` steps need; the last step of an epoch takes what is left, split
    evenly. The grouping of samples into steps does not depend on `budget`, so a run resumed with a smaller
    budget (after an out-of-memory error) trains the same samples in each step.
    """
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if too_long:
        raise PackingError(f"{len(too_long)} sample(s) are longer than the token budget {budget} (longest "
                           f"{max(lengths[i] for i in too_long)}); training.max_tokens_per_batch must be at least data.max_length")
    items: list[list[list[int]]] = []
    epoch = 0
    while len(items) < steps * world:
        rng = random.Random(f"{seed}/{epoch}")
        order = list(range(len(lengths)))
        rng.shuffle(order)
        per_step = samples * world
        for start in range(0, len(order), per_step):
            chunk = order[start:start + per_step]
            if len(chunk) < world:  # too few left to give every process one: the next epoch starts instead
                break
            groups = [chunk[r::world] for r in range(world)]
            k = max(1, max(-(-sum(lengths[i] for i in g) // budget) for g in groups))
            while (parts := [_balanced(g, lengths, budget, k) for g in groups]) and any(p is None for p in parts):
                k += 1
            if k > min(map(len, groups)):  # an epoch's last, short step that cannot give every process k micro-batches
                break
            items += parts
        epoch += 1
    return items[: steps * world]


def _balanced(group: list[int], lengths: Sequence[int], budget: int, k: int) -> list[list[int]] | None:
    """`group` in k micro-batches of at most `budget` tokens, each sample into the emptiest (longest first): the
    micro-batches come out even, so the step's heaviest is as light as k allows. None where k do not hold them."""
    bins: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for i in sorted(group, key=lambda i: -lengths[i]):  # stable: ties keep the shuffled order
        b = min(range(k), key=load.__getitem__)
        if load[b] + lengths[i] > budget:
            return None
        bins[b].append(i)
        load[b] += lengths[i]
    return bins


def efficiency(lengths: Sequence[int], batches: list[list[int]], budget: int) -> float:
    """Tokens trained on / tokens the micro-batches could hold."""
    return sum(lengths[i] for b in batches for i in b) / (budget * len(batches)) if batches else 0.0


def padded_efficiency(lengths: Sequence[int], micro_batch: int, seed: int = 0) -> float:
    """The same for dynamic padding in random order: tokens / (rows x longest row), per micro-batch."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    real = padded = 0
    for s in range(0, len(order), micro_batch):
        group = [lengths[i] for i in order[s:s + micro_batch]]
        real, padded = real + sum(group), padded + len(group) * max(group)
    return real / padded if padded else 0.0


def collate(rows: list[dict], *, varlen: bool) -> dict:
    """One packed micro-batch as model inputs: a single row, position ids restarting per sample.

    With `varlen` the cumulative sample boundaries go along too (cu_seq_lens_q/k, max_length_q/k:
    transformers' names for flash-attention kwargs), for the varlen attention kernel.
    """
    ids, labels, pos, bounds = [], [], [], [0]
    for r in rows:
        n = len(r["input_ids"])
        ids += r["input_ids"]
        labels += [-100] + list(r["labels"][1:])  # never a target across the boundary (unpacked, token 0 is never one)
        pos += range(n)
        bounds.append(bounds[-1] + n)
    batch = {
        "input_ids": torch.tensor([ids]),
        "labels": torch.tensor([labels]),
        "position_ids": torch.tensor([pos]),
    }
    if varlen:
        cu = torch.tensor(bounds, dtype=torch.int32)
        longest = max(len(r["input_ids"]) for r in rows)
        batch |= {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    return batch


class PackedSteps(torch.utils.data.Dataset):
    """Item k of a plan_steps plan: one process's micro-batches of one optimizer step, each the rows it packs."""

    def __init__(self, rows: list[dict], steps: list[list[list[int]]]) -> None:
        self.rows, self.steps = rows, steps

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, k: int) -> Step:
        return Step([self.rows[i] for i in b] for b in self.steps[k])


class Step(list):
    """The micro-batches of one optimizer step (a PackedSteps item), as the collator receives it."""


class PackedRows(torch.utils.data.Dataset):
    """Micro-batch k of the plan: the rows it packs (the collator flattens them)."""

    def __init__(self, rows: list[dict], batches: list[list[int]]) -> None:
        self.rows, self.batches = rows, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> list[dict]:
        return [self.rows[i] for i in self.batches[k]]


def worst_rows(lengths: Sequence[int], budget: int, max_samples: int | None = None) -> list[int]:
    """Row lengths of the heaviest packed micro-batch: the longest samples, then the next ones that
    still fit, topped up to exactly `budget` tokens (what the preflight probes); with `max_samples` (a step
    of that many samples) no more rows than that, and no top-up beyond them."""
    picked, room = [], budget
    for n in sorted(lengths, reverse=True):
        if max_samples is not None and len(picked) == max_samples:
            return picked
        if n <= room:
            picked.append(n)
            room -= n
        if room == 0:
            break
    if room and (max_samples is None or len(picked) < max_samples):
        picked.append(room)
    return picked
