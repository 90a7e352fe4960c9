"""A LoRA layer's forward and backward in one autograd function: the adapter's product added inside the base matmul.

peft computes an adapted layer as `base(x).clone() + lora_B(lora_A(dropout(x))) * scaling`: besides the two matmuls,
four passes over an output-sized tensor (the clone, lora_B's output, the scaling, the sum) in the forward, the
recompute and again in the backward. On an MLP projection of a 7B at 8,192 tokens each pass is 235 MB. Here the base
output is written once and the adapter's rank-r product is accumulated into it by the matmul itself
(`addmm_(x A^T, B^T, alpha=scaling)`); the backward does the same for the input gradient and keeps only the base
layer's input and the tokens x r product, as peft's autograd does. The 4-bit base is dequantized in the forward and
again in the backward (bitsandbytes' own matmul does the same), never kept.

Used where it computes exactly what peft does: a plain LoRA (no DoRA or other variant, no bias on lora_B), one active
adapter, not merged, on an `nn.Linear` or a bitsandbytes `Linear4bit`. Anything else keeps peft's forward.
"""

from __future__ import annotations

import types

import torch


def _weight(base: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The base layer's [out, in] weight in `dtype`: dequantized from NF4/FP4 for a bitsandbytes 4-bit layer."""
    w = base.weight
    state = getattr(w, "quant_state", None)
    if state is not None:
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(w.data, state).to(dtype)
    return w.to(dtype)


def _outer(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """g @ w; for a layer of one output (a gate: Qwen-MoE's shared_expert_gate) the broadcast product: a matmul over an
    inner dimension of 1 is an outer product, one elementwise pass, which cuBLAS would run as an unaligned GEMM."""
    return g * w if w.shape[0] == 1 else g @ w


class LoRALinear(torch.autograd.Function):
    """y = x W^T + b + scaling * dropout(x) A^T B^T, with W the frozen base weight."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, base, scaling: float, p: float, dtype: torch.dtype):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dtype)
        a, b = lora_a.to(dtype), lora_b.to(dtype)
        bias = base.bias
        w = _weight(base, dtype)
        out = torch.addmm(bias.to(dtype), x2, w.t()) if bias is not None else x2 @ w.t()
        del w
        mask = None
        xd = x2
        if p > 0:
            xd, mask = torch.native_dropout(x2, p, True)
        xa = xd @ a.t()
        out.addmm_(xa, b.t(), alpha=scaling)
        ctx.save_for_backward(x2 if p == 0 else xd, xa, mask, lora_a, lora_b)
        ctx.base, ctx.scaling, ctx.p, ctx.dtype, ctx.x_dtype, ctx.shape = base, scaling, p, dtype, x.dtype, shape
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        xd, xa, mask, lora_a, lora_b = ctx.saved_tensors
        dtype, s = ctx.dtype, ctx.scaling
        g = grad.reshape(-1, grad.shape[-1]).to(dtype)
        a, b = lora_a.to(dtype), lora_b.to(dtype)
        gxa = _outer(g, b).mul_(s)                   # d loss / d (x A^T), tokens x r
        grad_a = (gxa.t() @ xd).to(lora_a.dtype) if ctx.needs_input_grad[1] else None
        grad_b = (g.t() @ xa).mul_(s).to(lora_b.dtype) if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = _weight(ctx.base, dtype)
            grad_x = _outer(g, w)
            del w
            if mask is None:
                grad_x.addmm_(gxa, a)
            else:  # through the dropout: its kept elements scaled by 1 / (1 - p)
                grad_x.add_((gxa @ a).mul_(mask).mul_(1.0 / (1.0 - ctx.p)))
            grad_x = grad_x.view(ctx.shape).to(ctx.x_dtype)
        return grad_x, grad_a, grad_b, None, None, None, None


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft LoraLayer.forward, through LoRALinear where the call is a plain one (else peft's own)."""
    name = self.active_adapters[0] if len(self.active_adapters) == 1 else None
    if (args or kwargs or self.disable_adapters or self.merged or name is None or name not in self.lora_A
            or name in self.lora_variant):
        return type(self).forward(self, x, *args, **kwargs)
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    dropout = self.lora_dropout[name]
    p = dropout.p if isinstance(dropout, torch.nn.Dropout) and self.training else 0.0
    with torch.autocast(device, enabled=False):
        return LoRALinear.apply(x, self.lora_A[name].weight, self.lora_B[name].weight, self.get_base_layer(),
                                float(self.scaling[name]), float(p), dtype)


def fusable(module) -> bool:
    """A peft LoRA layer whose every adapter LoRALinear computes as peft does."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer) or not isinstance(module, torch.nn.Module):
        return False
    base = module.get_base_layer()
    plain = type(base) is torch.nn.Linear or type(base).__name__ == "Linear4bit"
    return (plain and not getattr(module, "fan_in_fan_out", False) and not module.lora_variant
            and all(isinstance(module.lora_A[k], torch.nn.Linear) and module.lora_B[k].bias is None for k in module.lora_A)
            and all(isinstance(d, torch.nn.Dropout | torch.nn.Identity) for d in module.lora_dropout.values()))


def use(model) -> int:
    """Route every fusable LoRA layer of `model` through LoRALinear; returns how many."""
    n = 0
    for module in model.modules():
        if fusable(module):
            module.forward = types.MethodType(_fused_forward, module)
            n += 1
    return n
