"""LoRA on fused MoE experts computed on the routed tokens only (see stages/model/experts/structure.py for where the experts are).

A grouped LoRA over routed tokens (`grouped_lora_forward`) computes, per expert e and only on the tokens
routed to it, x_e @ W_e^T + scaling * (x_e @ A_e^T) @ B_e^T with three grouped matmuls over the tokens sorted
by expert (torch.nn.functional.grouped_mm, torch >= 2.10; torch._grouped_mm before), never forming W + delta:
the work added is S * r * (in + out) for S routed token slots, and what backward keeps is the [S, r]
intermediate beside the inputs the base matmul keeps anyway. `use_grouped_lora` points each peft ParamWrapper's
forward at it with the adapter's own factors, so peft's parameters, save, load and merge are unchanged.
torch 2.13 (CPU) has torch.nn.functional.grouped_mm(mat_a, mat_b, *, offs, bias, out_dtype) over
torch._grouped_mm: 2-D x 3-D computes mat_a[rows of g] @ mat_b[g], offs int32 cumulative ends, fp32/bf16 with
16-byte-aligned strides, differentiable in both operands; `_gmm` loops per expert where a shape is not aligned
(rank 2 in fp32, rank 4 in bf16).
"""

from __future__ import annotations

import torch
from torch import nn

from stages.model.experts import nf4, structure

Factors = tuple[torch.Tensor, torch.Tensor, float]   # A [E, r, in], B [E, out, r], scaling


def peft_factors(wrapper: nn.Module, adapter: str = "default") -> Factors:
    """One ParamWrapper's adapter as per-expert factors: delta W_e (out x in) = scaling * B[e] @ A[e].
    Views and copies of lora_A / lora_B, so gradients reach peft's own parameters."""
    experts = wrapper.num_experts
    a = wrapper.lora_A[adapter].weight                     # [E*r, in], expert-major rows
    b = wrapper.lora_B[adapter].weight                     # [out, r*E], rank-major columns
    r = a.shape[0] // experts
    a = a.view(experts, r, a.shape[1])
    b = b.view(b.shape[0], r, experts).permute(2, 0, 1).contiguous()
    return a, b, wrapper.scaling[adapter]


def unwrap(module: nn.Module, adapter: str = "default") -> tuple[nn.Module, dict[str, Factors]]:
    """peft's nested ParamWrappers around one experts module: the module itself and its factors by parameter name."""
    factors: dict[str, Factors] = {}
    while hasattr(module, "parameter_name") and hasattr(module, "lora_A"):   # a ParamWrapper, peft not imported
        factors[module.parameter_name] = peft_factors(module, adapter)
        module = module.base_layer
    return module, factors


def _aligned(x: torch.Tensor, w: torch.Tensor) -> bool:
    # grouped_mm wants 16-byte aligned pointers and rows, in the forward and in the gradients backward makes
    # ([S, n], [G, k, n]): torch 2.13 on CPU refuses rank 2 in fp32 or rank 4 in bf16 in one or the other
    rows = (x.shape[-1], w.shape[-2], w.shape[-1])
    return all(t.data_ptr() % 16 == 0 for t in (x, w)) and all(n * x.element_size() % 16 == 0 for n in rows)


def _gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [S, k] sorted by group, w [G, k, n], offs the groups' cumulative ends: row block g of x times w[g]."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if grouped is not None and _aligned(x, w):
        return grouped(x, w, offs=offs)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    return torch.cat([x[s:e] @ w[g] for g, (s, e) in enumerate(zip(starts, ends, strict=True)) if e > s]
                     or [x.new_zeros(0, w.shape[-1])])


def _recomputing() -> bool:
    # a forward run while autograd executes a backward graph is gradient checkpointing's recompute: the backward
    # of the same layer follows at once, so what it saves lives one layer long
    return torch._C._current_graph_task_id() != -1


def _placeholder(w: torch.Tensor) -> torch.Tensor:
    # w's shape, dtype and device (what checkpoint compares between a forward and its recompute) in one element
    return w.new_zeros(()).expand(w.shape)


def _is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 1 and not any(t.stride())


class _NF4GroupedMM(torch.autograd.Function):
    """x @ W_g^T per group for an NF4 stack (the base weight is frozen, so only x gets a gradient). A first
    forward saves no 16-bit copy of the stack, only a one-element placeholder of its shape: backward dequantizes
    it again. A checkpoint recompute, which runs inside backward, saves the copy itself in the placeholder's
    slot, and the layer's backward that follows uses it: a checkpointed step dequantizes each stack twice, not
    three times, and holds one layer's stacks at a time."""

    @staticmethod
    def forward(ctx, x, param, offs, transposed: bool):
        w = nf4.dequantize(param).to(x.dtype)
        ctx.save_for_backward(offs, w if _recomputing() else _placeholder(w))
        ctx.param, ctx.transposed = param, transposed
        return _gmm(x, w if transposed else w.transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx, grad):
        offs, w = ctx.saved_tensors
        if _is_placeholder(w):
            w = nf4.dequantize(ctx.param).to(grad.dtype)
        return _gmm(grad.contiguous(), w.transpose(-2, -1) if ctx.transposed else w, offs), None, None, None


def offsets(groups: torch.Tensor, experts: int) -> torch.Tensor:
    """The cumulative ends of each expert's rows in `groups` (sorted): int32, as grouped_mm's offs. A search of
    the sorted groups, not torch.bincount: bincount on CUDA reads its input's maximum back to the host to size
    its output, a sync per experts module that leaves the GPU idle while the host catches up."""
    ends = torch.arange(experts, device=groups.device, dtype=groups.dtype)
    return torch.searchsorted(groups, ends, right=True).to(torch.int32)


def _project(experts: nn.Module, name: str, x: torch.Tensor, offs: torch.Tensor, groups: torch.Tensor,
             factors: dict[str, Factors]) -> torch.Tensor:
    """x @ W_e^T (+ LoRA, + bias) per expert group, an NF4 stack dequantized on the fly."""
    w = getattr(experts, name)
    if nf4.is_nf4(w):
        y = _NF4GroupedMM.apply(x, w, offs, bool(experts.is_transposed))
    else:
        y = _gmm(x, w if experts.is_transposed else w.transpose(-2, -1), offs)
    if name in factors:
        a, b, scaling = factors[name]
        # the scaling goes on A ([E, r, in]), not on the [S, out] product: two passes over the routed rows fewer
        # (forward and backward); peft keeps adapters in fp32 over a bf16 model, grouped_mm takes one dtype
        a, b = (a * scaling).to(x.dtype), b.to(x.dtype)
        # only the S routed rows meet the adapter: S x r x (in + out), no [E, out, in] tensor
        y = y + _gmm(_gmm(x, a.transpose(-2, -1), offs), b.transpose(-2, -1), offs)
    if experts.has_bias:
        y = y + getattr(experts, f"{name}_bias")[groups]
    return y


class _Dispatch(torch.autograd.Function):
    """hidden [T, H] -> its rows in slot order, [S = T * k, H] (slot i holds token order[i] // k). Backward sums
    each token's k slot gradients through the inverse permutation, a gather and a sum: indexing's own backward is an
    accumulating scatter (index_put with accumulate, which sorts the indices on CUDA)."""

    @staticmethod
    def forward(ctx, hidden, order, inverse, top_k: int):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return hidden.index_select(0, order // top_k)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse).view(-1, ctx.top_k, grad.shape[-1]).sum(1), None, None, None


class _Combine(torch.autograd.Function):
    """y [S, out] in slot order -> token-major [T, k, out], a permutation: backward gathers with `order`
    (index_select's own backward is an index_add)."""

    @staticmethod
    def forward(ctx, y, order, inverse, top_k: int):
        ctx.save_for_backward(order)
        return y.index_select(0, inverse).view(-1, top_k, y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad.reshape(-1, grad.shape[-1]).index_select(0, order), None, None, None


def routed(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, factors: dict[str, Factors] | None = None):
    """The routed slots sorted by expert: (groups, order, offs, x, h): each slot's expert, its position in the
    flattened top-k, the groups' cumulative ends, its input row and its gated activation (the down projection's
    input), with LoRA `factors` on the up projection."""
    groups, order, _, offs, x, h = _routed(experts, hidden_states, top_k_index, factors or {})
    return groups, order, offs, x, h


def _routed(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, factors: dict[str, Factors]):
    top_k = top_k_index.shape[-1]
    groups, order = torch.sort(top_k_index.reshape(-1))
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    offs = offsets(groups, experts.num_experts)
    x = _Dispatch.apply(hidden_states, order, inverse, top_k)
    h = _project(experts, "gate_up_proj" if experts.has_gate else "up_proj", x, offs, groups, factors)
    h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)
    return groups, order, inverse, offs, x, h


def grouped_lora_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, factors: dict[str, Factors]) -> torch.Tensor:
    """A transformers experts module's forward (grouped_mm path, no expert parallelism) with LoRA `factors`
    by parameter name added on the routed tokens only. `experts` is the unwrapped module."""
    groups, order, inverse, offs, _, h = _routed(experts, hidden_states, top_k_index, factors)
    y = _project(experts, "down_proj", h, offs, groups, factors)
    top_k = top_k_index.shape[-1]
    y = _Combine.apply(y, order, inverse, top_k)
    # each token's top-k outputs weighted and summed in one batched matmul: [T, 1, k] @ [T, k, out]
    return torch.bmm(top_k_weights.reshape(-1, 1, top_k).to(y.dtype), y).squeeze(1).to(hidden_states.dtype)


def grouped_forward(experts: nn.Module, hidden_states, top_k_index, top_k_weights):
    """An unadapted experts module's forward through the grouped path (its stacks in NF4: stages.model.experts.nf4)."""
    return grouped_lora_forward(experts, hidden_states, top_k_index, top_k_weights, {})


def use_nf4_stacks(model: nn.Module) -> int:
    """Every experts module holding NF4 stacks (stages.model.experts.nf4) computes through the grouped path, which
    dequantizes them on the fly; transformers' own experts forward would read the packed bytes. Returns how many."""
    found = nf4.stacks(model)
    for name in found:
        module = model.get_submodule(name)
        module.forward = grouped_forward.__get__(module)
    return len(found)


def _nf4_inside(wrapper: nn.Module) -> bool:
    inner = unwrap(wrapper)[0]
    return any(nf4.is_nf4(p) for p in inner.parameters(recurse=False))


def _grouped_forward(wrapper: nn.Module, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    if wrapper.disable_adapters and _nf4_inside(wrapper):   # peft's path would add its delta to packed bytes
        return grouped_forward(unwrap(wrapper)[0], hidden_states, top_k_index, top_k_weights)
    # peft's own path wherever it differs from one active, unmerged adapter: disabled (the base's outputs), merged
    if wrapper.disable_adapters or wrapper.merged or len(wrapper.active_adapters) != 1 or args or kwargs:
        return type(wrapper).forward(wrapper, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    inner, factors = unwrap(wrapper, wrapper.active_adapters[0])
    return grouped_lora_forward(inner, hidden_states, top_k_index, top_k_weights, factors)


def use_grouped_lora(model: nn.Module, on: bool = True) -> int:
    """Every peft-adapted experts module computes its LoRA on the tokens routed to each expert (grouped_lora_forward)
    instead of through peft's W + delta over the whole stack (`on`), or through peft's again; returns how many
    modules changed. The adapter's parameters, and so saving, loading and merging, stay peft's."""
    from peft.tuners.lora.layer import ParamWrapper

    n = 0
    for parent in model.modules():
        if isinstance(parent, ParamWrapper):
            continue
        for child in parent.children():
            if not (isinstance(child, ParamWrapper) and structure.computable(unwrap(child)[0])):
                continue
            if not on and _nf4_inside(child):
                raise ValueError("peft's ParamWrapper forward cannot run on NF4 expert stacks: they compute through "
                                 "stages.model.experts.lora only")
            if on:
                child.forward = _grouped_forward.__get__(child)
            else:
                child.__dict__.pop("forward", None)
            n += 1
    return n
