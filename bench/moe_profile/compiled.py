"""A trial of the host-overhead lever (bench only, not the product's path): the grouped expert LoRA's routed math,
Qwen3-MoE's experts (gate_up [E, 2I, H] then SiLU-gated, down [E, H, I], not transposed), as one torch.compile'd
function of tensors only, so the 48 layers share one compiled graph (forward and backward) instead of ~25 eager
kernels and their Python dispatch per layer and pass. NF4 stacks are dequantized eagerly and passed in: the
compiled graph saves them for its backward, which under checkpointing holds only the recomputed layer's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.model.experts import lora as expert_lora
from stages.model.experts import nf4 as expert_nf4

_gmm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def _math(hidden, top_k_index, top_k_weights, w_up, w_down, a_up, b_up, a_dn, b_dn, s_up: float, s_dn: float):
    experts, top_k = w_up.shape[0], top_k_index.shape[-1]
    groups, order = torch.sort(top_k_index.reshape(-1))
    x = hidden[order // top_k]
    ends = torch.arange(experts, device=groups.device, dtype=groups.dtype)
    offs = torch.searchsorted(groups, ends, right=True).to(torch.int32)

    def project(x, w, a, b, s):
        y = _gmm(x, w.transpose(-2, -1), offs=offs)
        t = _gmm(x, a.to(x.dtype).transpose(-2, -1).contiguous(), offs=offs)
        return y + s * _gmm(t, b.to(x.dtype).transpose(-2, -1).contiguous(), offs=offs)

    gate, up = project(x, w_up, a_up, b_up, s_up).chunk(2, dim=-1)
    y = project(F.silu(gate) * up, w_down, a_dn, b_dn, s_dn)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    y = y.index_select(0, inverse).view(-1, top_k, y.shape[-1])
    return torch.bmm(top_k_weights.reshape(-1, 1, top_k).to(y.dtype), y).squeeze(1).to(hidden.dtype)


_compiled = torch.compile(_math, dynamic=False)


def _weight(p, dtype):
    return expert_nf4.dequantize(p).to(dtype) if expert_nf4.is_nf4(p) else p


def forward(experts, hidden_states, top_k_index, top_k_weights, factors):
    """expert_lora.grouped_lora_forward's signature (qwen3_moe experts, both stacks adapted)."""
    (a_up, b_up, s_up), (a_dn, b_dn, s_dn) = factors["gate_up_proj"], factors["down_proj"]
    dtype = hidden_states.dtype if not torch.is_autocast_enabled() else torch.get_autocast_dtype("cuda")
    return _compiled(hidden_states.to(dtype), top_k_index, top_k_weights, _weight(experts.gate_up_proj, dtype),
                     _weight(experts.down_proj, dtype), a_up, b_up, a_dn, b_dn, float(s_up), float(s_dn))


def use() -> object:
    """Points stages.model.experts.lora's adapted path at the compiled math; returns what to put back."""
    saved = expert_lora.grouped_lora_forward
    expert_lora.grouped_lora_forward = forward
    return saved
