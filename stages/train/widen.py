"""The packed micro-batch's default width on this card: as wide as a step's samples fill, where the memory allows.

A packed step (packed_step: samples) trains the same samples however they are cut into micro-batches, so its width is
a matter of speed and memory only. On a GPU a micro-batch of a few thousand tokens is bound by the host launching its
kernels (about 22,000 per micro-batch at 48 MoE layers), not by the GPU: a step of 16 x 2048 tokens trained 2.1x
faster in two 16,384-token micro-batches than in eight of 4,096 (bench/train_speed/results/moe_widen/; the profiles, of
bench/moe_stage_speed in git history: docs/evidence/2026-12-08-moe-benches-folded.md).
So where training.max_tokens_per_batch is left null, the preflight and the train stage both widen the default budget
(batches.token_budget) to the widest of: a step's samples laid end to end, the cap the dense 7B measured fastest
(batches.PACKED_BUDGET_DEFAULT_MAX), halvings of it; the first whose analytic estimate (stages/train/memory_model.py, never
under what a run needs on the capped grids) fits the usable memory. Both compute it from the same config, data and card,
so the probe measures the very micro-batches training runs: the GPU figure is the figure of the chosen width.
"""

from __future__ import annotations

from stages.config import RunConfig
from stages.train import batches
from stages.train.kernels import resolve_auto
from stages.train.memory_model import Shapes, estimate


def on_card(cfg: RunConfig, shapes: Shapes, longest: int, usable_gib: float, on_gpu: bool) -> RunConfig:
    """`cfg` planned for this card: fit: auto decided (fit_on_card), then its packed budget widened (budget_on_card)."""
    cfg = fit_on_card(cfg, shapes, longest, usable_gib, on_gpu)
    return budget_on_card(cfg, shapes, longest, usable_gib, on_gpu)


def fit_on_card(cfg: RunConfig, shapes: Shapes, longest: int, usable_gib: float, on_gpu: bool) -> RunConfig:
    """`cfg` with fit: auto decided for this card (training.planned_fit, the reason in training._fit_reason): speed, the
    fastest plan, where its estimate with every layer checkpointed fits the usable memory (the train stage then
    measures how many layers can keep their activations, and the preflight's probe measures that floor); memory where
    it does not, on CPU and with FSDP. An explicit fit, or one already decided, is left as it is."""
    t = cfg.training
    if t.fit != "auto" or t._card_fit:
        return cfg
    if not on_gpu:
        return _with_fit(cfg, "memory", "fit: auto is memory here: no CUDA device")
    if t.distributed == "fsdp":
        return _with_fit(cfg, "memory", "fit: auto is memory with distributed: fsdp (fit: speed measures the unsharded model)")
    need = estimate(_with_fit(cfg, "speed", ""), shapes, longest, on_gpu=on_gpu).total_gib
    if need <= usable_gib:
        return _with_fit(cfg, "speed", f"fit: auto is speed on this card: its estimate with every layer checkpointed, "
                                       f"{need:.2f} GiB, fits the {usable_gib:.2f} usable; no offloads, fused AdamW, and as many "
                                       "layers keep their activations as the card holds (measured at the start of training)")
    return _with_fit(cfg, "memory", f"fit: auto is memory on this card: fit: speed would need {need:.2f} GiB with every layer "
                                    f"checkpointed (estimate), over the {usable_gib:.2f} usable; every layer checkpointed, its "
                                    "inputs and the embeddings offloaded to CPU, 8-bit AdamW")


def _with_fit(cfg: RunConfig, fit: str, why: str) -> RunConfig:
    t = cfg.training.model_copy()
    t._card_fit, t._fit_reason = fit, why
    return cfg.model_copy(update={"training": t})


def budget_on_card(cfg: RunConfig, shapes: Shapes, longest: int, usable_gib: float, on_gpu: bool) -> RunConfig:
    """`cfg` with its packed budget widened for this card (the reason in batches.token_budget_reason), or `cfg` itself
    where there is nothing to widen: an explicit training.max_tokens_per_batch, a budget already chosen, padded
    batches, packed_step: tokens (the budget is then what a step trains), the tiled MLP forced on, no CUDA (no launch
    overhead to save), several processes without preflight.gpu_memory_gib, or a step whose samples already fill one
    micro-batch.

    Args:
        longest: the data's longest sample after data.long_sample_policy (the preflight's scan, the training set's).
        usable_gib: the card's budget less the CUDA context and preflight.margin (memory.usable_gib).
    """
    t = cfg.training
    # Processes training together must plan the same micro-batches (their collectives run once per micro-batch): on
    # cards of different sizes each would widen to its own, so there only a budget the config states is widened to.
    mixed = t.world_size > 1 and cfg.preflight.gpu_memory_gib is None
    if (t.max_tokens_per_batch or t._card_budget or t.packed_step != "samples" or t.tiled_mlp == "on" or not on_gpu or mixed
            or not resolve_auto(cfg, on_gpu=on_gpu, longest=longest)["packing"]):
        return cfg
    base = batches.token_budget(cfg)
    widest = min(batches.samples_per_step(cfg) * longest, max(base, batches.PACKED_BUDGET_DEFAULT_MAX))
    tried = []
    for width in _widths(base, widest):
        wide = batches.with_card_budget(cfg, width, "")
        need = estimate(wide, shapes, longest, on_gpu=on_gpu).total_gib
        if need <= usable_gib:
            why = (f"widened on this card from {base} ({batches.token_budget_reason(cfg)}): a step's samples in fewer "
                   f"micro-batches, fewer kernel launches per token; estimate for a full budget of the longest samples {need:.2f} GiB of "
                   f"{usable_gib:.2f} usable"
                   + (f", {tried[-1][0]} tokens would need {tried[-1][1]:.2f}" if tried else ""))
            return batches.with_card_budget(cfg, width, why)
        tried.append((width, need))
    if not tried:
        return cfg
    return batches.with_card_budget(cfg, base, f"{batches.token_budget_reason(cfg)}; not widened on this card: {tried[-1][0]} "
                                               f"tokens would need {tried[-1][1]:.2f} GiB (estimate), over the {usable_gib:.2f} usable")


def _widths(base: int, widest: int) -> list[int]:
    """The candidate budgets, widest first: `widest`, then halvings of it, each wider than `base`."""
    out, width = [], widest
    while width > base:
        out.append(width)
        width //= 2
    return out


def in_training(cfg: RunConfig, longest: int, preflight: dict | None = None) -> RunConfig:
    """on_card as the train stage calls it: the model's config.json, this process's card and preflight.gpu_memory_gib.

    preflight: this run's preflight result, where there is one: its probe measured the budget it chose, so training
    never goes wider than that (a flow retried on a bigger card after its preflight was kept), only narrower where this
    card has less room."""
    from stages import memory
    from stages.model.load import device

    here = device()
    if here.type != "cuda":  # nothing to widen: spare the meta build
        return cfg
    shapes = Shapes.of_run(cfg)
    _, budget = memory.card(cfg.preflight.gpu_memory_gib, here.index or 0)
    chosen = on_card(cfg, shapes, longest, memory.usable_gib(budget, cfg.preflight.margin, on_gpu=True), on_gpu=True)
    return no_wider_than_measured(cfg, chosen, preflight)


def no_wider_than_measured(cfg: RunConfig, chosen: RunConfig, preflight: dict | None) -> RunConfig:
    """`chosen` (cfg widened on this card), or the budget this run's `preflight` result planned and probed where that
    is narrower: the GPU figure is the figure of the micro-batches it measured."""
    steps = (preflight or {}).get("steps") or {}
    measured = steps.get("tokens_per_micro_batch") if steps.get("packed") else None
    if not chosen.training._card_budget or not measured or measured >= batches.token_budget(chosen):
        return chosen
    return batches.with_card_budget(cfg, max(measured, batches.token_budget(cfg)),
                                    f"the {measured} tokens this run's preflight measured (this card would widen to "
                                    f"{batches.token_budget(chosen)})")
