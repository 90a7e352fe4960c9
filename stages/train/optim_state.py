"""An AdamW checkpoint resumed by the other AdamW: torch's (exp_avg, exp_avg_sq) and bitsandbytes' 8-bit blockwise
(state1, state2 under per-block absmax) hold the same two moments in two layouts.

The run changes optimizer mid-run when the OOM policy falls back from fit: speed (fused AdamW, 32-bit moments) to
fit: memory (8-bit AdamW) and resumes from the speed plan's last checkpoint; a user who changes `training.optim`
and reruns does the same. Each optimizer reads only its own keys (bitsandbytes raised KeyError 'state1' at the
first step), so the moments are carried over, quantized or dequantized as bitsandbytes itself does, with the
step count and the learning rate the checkpoint had.
"""

from __future__ import annotations

from pathlib import Path

import torch

TORCH_KEYS, BNB_KEYS = ("exp_avg", "exp_avg_sq"), ("state1", "state2")
BLOCK = 256   # bitsandbytes' blockwise optimizer states: one absmax per 256 values (Optimizer2State.init_state)
WRAPPED = "__bnb_optimizer_quant_state__"   # where bitsandbytes' state_dict nests them (Optimizer8bit, for FSDP)


def layout(state_dict: dict) -> str | None:
    """'torch' or 'bnb': whose keys a saved optimizer state holds; None where it holds no moments yet."""
    for s in state_dict.get("state", {}).values():
        s = _flat(s)
        if all(k in s for k in TORCH_KEYS):
            return "torch"
        if all(k in s for k in BNB_KEYS):
            return "bnb"
    return None


def own_layout(optimizer) -> str:
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is not None:
        from bitsandbytes.optim.optimizer import Optimizer2State

        if isinstance(optimizer, Optimizer2State):
            return "bnb"
    return "torch"


def read_other(f: Path, optimizer) -> dict | None:
    """The optimizer state saved in `f` where it is of the other layout than `optimizer`, else None (the Trainer's own
    load then reads it). Memory-mapped: a look at the keys reads no moment."""
    if not f.is_file():
        return None
    saved = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    theirs = layout(saved)
    return saved if theirs is not None and theirs != own_layout(optimizer) else None


@torch.no_grad()
def adopt(optimizer, saved: dict) -> None:
    """Fill `optimizer` (bare, its state empty) with the moments, step counts and learning rates of `saved`, a
    state_dict of the other layout, parameter for parameter in group order, as load_state_dict would."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_ids = [i for g in saved["param_groups"] for i in g["params"]]
    if len(params) != len(saved_ids):
        raise ValueError(f"the checkpoint's optimizer holds {len(saved_ids)} parameters, this run trains {len(params)}")
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        for key in ("lr", "initial_lr"):
            if key in saved_group:
                group[key] = saved_group[key]
    carry = _to_bnb if own_layout(optimizer) == "bnb" else _to_torch
    ids = iter(saved_ids)
    for gindex, group in enumerate(optimizer.param_groups):
        for pindex, p in enumerate(group["params"]):
            if s := saved["state"].get(next(ids)):
                carry(optimizer, group, gindex, pindex, p, _flat(s))


def _flat(s: dict) -> dict:
    return {k: v for k, v in s.items() if k != WRAPPED} | s.get(WRAPPED, {})


def _to_bnb(optimizer, group, gindex, pindex, p, s: dict) -> None:
    import bitsandbytes.functional as F

    optimizer.init_state(group, p, gindex, pindex)
    state = optimizer.state[p]
    state["step"] = int(s["step"])
    for moment, key, n in ((s["exp_avg"], "state1", "1"), (s["exp_avg_sq"], "state2", "2")):
        m = moment.to(p.device, torch.float32)
        if state[key].dtype == torch.float32:   # a tensor under min_8bit_size keeps 32-bit states
            state[key].copy_(m)
        else:
            F.quantize_blockwise(m, code=state["qmap" + n], absmax=state["absmax" + n], out=state[key], blocksize=BLOCK)


def _to_torch(optimizer, group, gindex, pindex, p, s: dict) -> None:
    import bitsandbytes.functional as F

    def moment(n: str) -> torch.Tensor:
        q = s["state" + n].to(p.device)
        if q.dtype != torch.uint8:
            return q.to(torch.float32).clone()
        return F.dequantize_blockwise(q, absmax=s["absmax" + n].to(p.device), code=s["qmap" + n].to(p.device),
                                      blocksize=BLOCK).to(torch.float32)

    fused_or_capturable = group.get("fused") or group.get("capturable")
    step = torch.tensor(float(s["step"]), dtype=torch.float32, device=p.device if fused_or_capturable else "cpu")
    optimizer.state[p] = {"step": step, "exp_avg": moment("1").to(p.dtype), "exp_avg_sq": moment("2").to(p.dtype)}
