"""How many decoder layers to checkpoint: every one (fit: memory) or as few as the budget allows (fit: speed).

A layer that is not checkpointed keeps its activations (about 1.2 GiB per layer for a 7B at
2 x 4096 tokens) and skips its recompute in backward (a third of its compute). The cost per
layer is measured here on the real model and the worst micro-batch, not estimated: one
forward + backward with every layer checkpointed, one with `PROBE_LAYERS` fewer; the
difference per layer sizes the choice, and one more pass verifies it.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field

import torch

from stages.config import RunConfig
from stages.memory import GIB
from stages.model.load import compute_dtype, device

PROBE_LAYERS = 2
MAX_PROBES = 6  # one forward + backward each


@dataclass
class FitChoice:
    fit: str
    checkpointed_layers: int
    total_layers: int
    offload_activations: bool
    offload_embeddings: bool = False
    budget_gib: float | None = None
    usable_gib: float | None = None
    per_layer_gib: float | None = None
    measured: list[dict] = field(default_factory=list)  # {"checkpointed": n, "peak_reserved_gib": x}
    reason: str = ""
    attention: str = ""  # the SDPA kernel the model's shapes get here


def choose(cfg: RunConfig, model, worst_batch: dict, trainable_params: int, optim: str, offload_activations: bool) -> FitChoice:
    """Set the model's checkpointed layers for `cfg.training.fit` and say why.

    Args:
        worst_batch: a collated micro-batch of the longest rows.
        trainable_params, optim: size the optimizer states, allocated only at the first step.
        offload_activations: whether the run offloads saved activations (kernels.Settings).
    """
    from stages.train.model import checkpointed_layers
    from stages.train.offload import HostEmbedding

    n, total = checkpointed_layers(model)
    on_host = isinstance(model.get_input_embeddings(), HostEmbedding)  # not when tied to lm_head
    fit = cfg.training.planned_fit
    choice = FitChoice(fit, n, total, offload_activations, on_host)
    if fit == "memory" or not cfg.training.gradient_checkpointing or not torch.cuda.is_available() or total == 0:
        choice.reason = (_plan_reason(cfg) + "fit: memory: every layer checkpointed"
                         + (", saved activations offloaded to CPU" if choice.offload_activations else "")
                         if fit == "memory" else
                         "gradient_checkpointing is off: nothing to choose" if not cfg.training.gradient_checkpointing else
                         "no CUDA device: every layer checkpointed" if not torch.cuda.is_available() else
                         "the model has no checkpointable decoder layers")
        return choice
    with torch.cuda.device(device()):  # under DDP each rank measures its own GPU
        return _choose_speed(cfg, model, worst_batch, trainable_params, optim, choice, total)


def _choose_speed(cfg: RunConfig, model, worst_batch: dict, trainable_params: int, optim: str, choice: FitChoice, total: int) -> FitChoice:
    from stages import memory
    from stages.train.kernels import OPTIM_BYTES
    from stages.train.model import checkpoint_only

    _, budget = memory.card(cfg.preflight.gpu_memory_gib, device().index or 0)
    usable = memory.usable_gib(budget, cfg.preflight.margin, on_gpu=True)
    states = trainable_params * OPTIM_BYTES.get(optim, 8) / GIB
    choice.budget_gib, choice.usable_gib = round(budget, 3), round(usable, 3)

    def peak(checkpointed: int) -> float:
        checkpoint_only(model, checkpointed)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            with torch.autocast("cuda", dtype=compute_dtype(cfg.model.torch_dtype)):
                loss = model(**worst_batch).loss
            loss.backward()
            gib = torch.cuda.max_memory_reserved() / GIB + states
        except torch.OutOfMemoryError:
            gib = math.inf
        model.zero_grad(set_to_none=True)
        loss = None
        gc.collect()
        torch.cuda.empty_cache()
        choice.measured.append({"checkpointed": checkpointed, "peak_reserved_gib": round(gib, 3)})
        return gib

    k0 = min(PROBE_LAYERS, total)
    full, fewer = peak(total), peak(total - k0)
    if full > usable:
        checkpoint_only(model, total)
        choice.checkpointed_layers = total
        choice.reason = _plan_reason(cfg) + f"even with every layer checkpointed the worst micro-batch peaks at {full:.2f} GiB > {usable:.2f} GiB usable"
        return choice
    per_layer = max((fewer - full) / k0, 1e-3) if math.isfinite(fewer) else math.inf
    # Memory is not linear in the layers kept (the peak moves from a recompute to the end of
    # the forward), so the slope only proposes; a bisection on measured peaks decides.
    fits, fails = (k0 if fewer <= usable else 0), (total + 1 if fewer <= usable else k0)
    guess = min(total, int((usable - full) / per_layer)) if math.isfinite(per_layer) else 0
    for _ in range(MAX_PROBES):
        if fails - fits <= 1:
            break
        keep = guess if fits < guess < fails else (fits + fails) // 2
        if peak(total - keep) <= usable:
            fits = keep
        else:
            fails = keep
        guess = -1
    keep = fits
    at_choice = min((m["peak_reserved_gib"] for m in choice.measured if m["checkpointed"] == total - keep), default=full)
    if keep:
        per_layer = (at_choice - full) / keep
    checkpoint_only(model, total - keep)
    choice.checkpointed_layers, choice.per_layer_gib = total - keep, round(per_layer, 4)
    choice.reason = (_plan_reason(cfg) + f"fit: speed: {keep} of {total} layers keep their activations, measured peak {at_choice:.2f} GiB "
                     f"({per_layer:.2f} GiB per layer kept; every layer checkpointed: {full:.2f} GiB); "
                     f"usable {usable:.2f} GiB of {budget:.1f}")
    return choice


def _plan_reason(cfg: RunConfig) -> str:
    """Why fit: auto became what it is on this card (stages/train/widen.py), as a prefix; empty for an explicit fit."""
    return f"{cfg.training._fit_reason}; " if cfg.training.fit == "auto" and cfg.training._fit_reason else ""
