"""bitsandbytes' 8-bit optimizers with one wait for the GPU per step instead of one per parameter.

`Optimizer8bit.step` (bitsandbytes 0.50) calls torch.cuda.synchronize() after every parameter's update: on a MoE
with attention and expert LoRA that is ~600 waits a step (963 cudaDeviceSynchronize per step on Qwen3-30B-A3B
shapes, bench/moe_stage_speed), each one idling the GPU while the host launches the next update. The updates run
on one stream in order and the host reads no state between them, so the same updates in the same order need only
the last wait, kept because the host may read the (paged) states after a step: a checkpoint's save.
"""

from __future__ import annotations

import inspect
import types

import torch


def one_sync_per_step(optimizer) -> bool:
    """Make a bitsandbytes 8-bit optimizer (not a subclass with a step of its own) wait once per step; returns
    whether it did. Call before an LR scheduler wraps `optimizer.step`."""
    try:
        from bitsandbytes.optim.optimizer import Optimizer8bit
    except ImportError:
        return False
    # torch.optim.Optimizer wraps each class's step in a profiling hook: compare what is underneath
    if not isinstance(optimizer, Optimizer8bit) or inspect.unwrap(type(optimizer).step) is not inspect.unwrap(Optimizer8bit.step):
        return False
    # through torch's own wrapper: step pre/post hooks and the profiler's "Optimizer.step" range as before
    optimizer.step = types.MethodType(torch.optim.Optimizer.profile_hook_step(_step), optimizer)
    return True


@torch.no_grad()
def _step(self, closure=None):
    # Optimizer8bit.step of bitsandbytes 0.50 without its per-parameter sync_gpu
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    if not self.initialized:
        self.check_overrides()
        self.to_gpu()
        self.initialized = True
    for gindex, group in enumerate(self.param_groups):
        for pindex, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if len(self.state[p]) == 0:
                self.init_state(group, p, gindex, pindex)
            self.prefetch_state(p)
            self.update_step(group, p, gindex, pindex)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return loss
