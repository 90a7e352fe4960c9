"""Mixture-of-experts weights LoRA can adapt, found in the model itself, and what adapting them costs.

transformers 5.x keeps the routed experts of a MoE layer as fused 3-D parameters on one module, not as
nn.Linear modules: `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] (Qwen2/3-MoE,
OLMoE, Mixtral, DeepSeek-V2/V3, GLM-4-MoE, ERNIE-4.5-MoE, ...; Granite-MoE under `block_sparse_moe`;
Nemotron-H has `up_proj` only). GPT-OSS stores them transposed, [E, H, 2I] and [E, I, H] (`is_transposed`),
gate and up interleaved, with 2-D biases `gate_up_proj_bias` / `down_proj_bias` beside them. Per-expert
checkpoints (`experts.N.w1.weight`, ...) are fused at load and split again by save_pretrained
(save_original_format). `target_modules="all-linear"` adapts nn.Linear modules only, so without
`target_parameters` the experts -- most of a MoE model's weights -- silently stay untrained (Granite-MoE,
GPT-OSS, Qwen2-MoE, ...; for the families peft rewrites, below, all-linear trains them and the router).

peft 0.21 adapts a 3-D parameter with lora.ParamWrapper:
  * naming: a `target_parameters` entry matches the key `<module path>.<parameter>` exactly or as a
    dot-bounded suffix, so `experts.gate_up_proj` names every layer's stack (and not `gate_up_proj_bias`);
  * shapes: one rank-r adapter per expert. lora_A is Linear(in, r*E) and lora_B Linear(r*E, out), where in/out
    are H/2I for [E, 2I, H] and taken as stored when the module says `is_transposed`. A's rows are expert-major
    (expert e owns rows e*r .. e*r+r-1); B's columns are rank-major (expert e owns columns e, e+E, e+2E, ...).
    So a stack costs E * r * (in + out) parameters, E times a single linear of that shape;
  * refused: lora_dropout != 0, use_dora, lora_bias, fan_in_fan_out (ValueError at get_peft_model);
  * forward: while the wrapped module runs, the parameter is swapped (torch parametrize) for
    W + scaling * lhs @ rhs, one baddbmm over the whole stack. The factors are not multiplied out alone, but
    W' itself is a fresh tensor the size of the stack, for every expert whether tokens reach it or not, and the
    experts' grouped_mm saves it for backward: each adapted layer holds a full copy of its expert weights
    until backward, and its cost grows with E, not with the tokens routed.

peft also rewrites LoraConfig in place (utils/transformers_weight_conversion.py) for the model types transformers
converts with its mixtral / qwen2_moe rules (Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V2/V3, GLM-4-MoE, ERNIE-4.5-MoE,
...; not qwen2_moe itself, nor Granite-MoE or GPT-OSS): target_modules `gate_proj`/`up_proj` (`w1`/`w3`) become
target_parameters `gate_up_proj` at rank 2r and alpha 2*alpha, `down_proj` (`w2`) becomes `down_proj`, `gate`
becomes the router's `gate.weight`, and "all-linear" expands to all of them. The nn.Linear MLPs of those names
(dense layers, shared experts) then get no adapter. Hence expert stacks are named here as `experts.<param>`
and passed as target_parameters, with target_modules free of those names for such models.

Routers (`gate` / `router`: a TopKRouter module with an [E, H] `weight`, some with an `e_score_correction_bias`)
are not nn.Linear in most families, so the expert targets and a target_modules list without `gate` leave them
frozen. Some are or hold an nn.Linear that all-linear adapts: Jamba's and PhiMoE's `router`, AFMoE's
`router.gate`, Gemma-4's `router.proj` (`router_linears`); Qwen2-MoE / Qwen3-Next's `shared_expert_gate` is an
nn.Linear(H, 1). Shared experts (`shared_expert` / `shared_experts`) are ordinary MLPs of nn.Linear and take LoRA through
target_modules like any dense MLP.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

ROUTER_NAMES = ("gate", "router")   # the MoE block's child that scores the experts, in every family in transformers 5.17


@dataclass(frozen=True)
class ExpertStack:
    """One fused 3-D expert parameter: E experts' weights of one projection in one layer."""

    name: str            # full dotted name, e.g. model.layers.3.mlp.experts.gate_up_proj
    experts: int
    in_features: int
    out_features: int
    transposed: bool     # stored [E, in, out] (GPT-OSS) rather than [E, out, in]

    @property
    def numel(self) -> int:
        """The stack's base weights: E experts of in x out."""
        return self.experts * self.in_features * self.out_features

    @property
    def leaf(self) -> str:
        return self.name.rpartition(".")[2]

    def lora_matrices(self, r: int) -> tuple[int, int]:
        """The sizes of its lora_A and lora_B: one rank-r pair per expert."""
        return self.experts * r * self.in_features, self.experts * r * self.out_features

    def lora_params(self, r: int) -> int:
        return sum(self.lora_matrices(r))


@dataclass
class MoeParts:
    """A model's routed experts, its routers and its shared experts, by name."""

    stacks: list[ExpertStack] = field(default_factory=list)
    target_parameters: list[str] = field(default_factory=list)  # what LoraConfig(target_parameters=...) gets
    routers: list[str] = field(default_factory=list)            # parameter names: stay frozen
    router_linears: list[str] = field(default_factory=list)     # nn.Linear modules inside a router: all-linear adapts them
    shared_linears: list[str] = field(default_factory=list)     # nn.Linear modules of shared experts

    def lora_params(self, r: int) -> int:
        return sum(s.lora_params(r) for s in self.stacks)

    def summary(self, r: int) -> list[str]:
        """One line per projection, e.g. 'experts: gate_up_proj x 48 (128 experts, rank 8 each) 50.33 M params'."""
        groups: dict[tuple[str, int], list[ExpertStack]] = {}
        for s in self.stacks:
            groups.setdefault((s.leaf, s.experts), []).append(s)
        return [f"experts: {leaf} x {len(ss)} ({e} experts, rank {r} each) "
                f"{sum(s.lora_params(r) for s in ss) / 1e6:.2f} M params" for (leaf, e), ss in groups.items()]


def _stack(name: str, module: nn.Module, param: torch.Tensor) -> ExpertStack | None:
    # Conv1d weights (Mamba, gated-delta-net mixers) are 3-D too; they are torch's own modules, experts never are
    state = getattr(param, "quant_state", None)   # an NF4 stack (stages.model.experts.nf4) packs its 3-D shape away
    shape = torch.Size(state.shape) if state is not None else param.shape
    if len(shape) != 3 or type(module).__module__.startswith("torch."):
        return None
    experts = shape[0]
    if getattr(module, "num_experts", experts) != experts:
        return None
    # the same rule peft's ParamWrapper applies, so the count matches what it builds
    transposed = bool(getattr(module, "is_transposed", False))
    inner, outer = (shape[1], shape[2]) if transposed else (shape[2], shape[1])
    return ExpertStack(name, experts, inner, outer, transposed)


def computable(experts: nn.Module) -> bool:
    """An experts module of transformers' own kind (use_experts_implementation): its layout flags and gate are
    what grouped_lora_forward reads."""
    return all(hasattr(experts, a) for a in ("num_experts", "has_gate", "has_bias", "is_transposed")) \
        and hasattr(experts, "_apply_gate" if experts.has_gate else "act_fn")   # GPT-OSS's gate is its own, no act_fn


def target_parameters(names: list[str], every: list[str]) -> list[str]:
    """The shortest `<module>.<parameter>` suffixes that match exactly `names` among `every` parameter name, else
    the names themselves: peft matches a target against a key's dot-bounded suffix."""
    chosen = set(names)
    short = sorted({".".join(n.split(".")[-2:]) for n in names})
    if all(n in chosen for n in every if any(n == s or n.endswith("." + s) for s in short)):
        return short
    return sorted(chosen)


def fused_experts(model: nn.Module) -> MoeParts:
    """Every fused expert stack of `model` (a transformers model, real or on the meta device), with the
    `target_parameters` that adapt exactly those, and the router and shared-expert names around them."""
    parts = MoeParts()
    blocks: dict[str, int] = {}   # MoE block (the experts module's parent) -> its experts
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if s := _stack(f"{name}.{pname}", module, param):
                parts.stacks.append(s)
                blocks[name.rpartition(".")[0]] = s.experts
    every = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    parts.target_parameters = target_parameters([s.name for s in parts.stacks], every)
    experts_modules = {s.name.rpartition(".")[0] for s in parts.stacks}

    for block_name, experts in blocks.items():
        block = model.get_submodule(block_name)
        for pname, param in block.named_parameters(recurse=False):   # e.g. AFMoE's expert_bias [E]
            if experts in param.shape:
                parts.routers.append(f"{block_name}.{pname}")
        for child_name, child in block.named_children():
            full = f"{block_name}.{child_name}"
            if full in experts_modules:
                continue
            linears = [f"{full}.{n}".rstrip(".") for n, m in child.named_modules() if isinstance(m, nn.Linear)]
            # Names, not shapes: every transformers family calls them gate / router and shared_expert(s) /
            # shared_expert_gate, while an E-wide axis alone also matches e.g. Gemma-4's per_layer_input_gate
            # (the experts' parent there is the decoder layer)
            if "shared" in child_name:
                parts.shared_linears += linears
            elif child_name in ROUTER_NAMES:
                parts.routers += [f"{full}.{n}" for n, _ in child.named_parameters()]
                parts.router_linears += linears
    return parts


@contextlib.contextmanager
def peft_targets_as_given():
    """peft 0.21 rewrites a LoRA config for the MoE families whose checkpoints transformers 5 fuses (Qwen3-MoE,
    OLMoE, Mixtral, DeepSeek, ...), to load adapters trained on transformers 4: gate_proj/up_proj become the
    experts' gate_up_proj at rank 2r, `gate` the router, and the shared experts' and dense layers' MLPs of those
    names lose their adapters. The targets resolved in stages.model.architecture already name the fused experts and
    the linear modules apart: peft takes them as given here, when it builds the adapter and when it loads it."""
    from peft.utils import transformers_weight_conversion as conversion

    saved = conversion.convert_peft_config_for_transformers, conversion.convert_peft_adapter_state_dict_for_transformers
    conversion.convert_peft_config_for_transformers = lambda peft_config, model, conversions: None
    conversion.convert_peft_adapter_state_dict_for_transformers = (
        lambda model, peft_config, adapter_state_dict, adapter_name="default": adapter_state_dict)
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers, conversion.convert_peft_adapter_state_dict_for_transformers = saved
