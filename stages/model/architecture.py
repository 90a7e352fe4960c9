"""What a base model is made of, read from its config.json alone: the model built on the meta device
(no memory, no weights, well under a second for a 70B), its linear modules and their shapes, and the
LoRA targets resolved against them.

The preflight's estimate counts exactly the modules LoRA will adapt, the weights check compares the
tensors the architecture expects with those the safetensors files hold, and training hands peft the
same resolved target list, so what is estimated, checked and trained is one thing.

    arch = architecture.of_model(cfg.model)            # None where the config cannot be built
    targets = architecture.resolve_targets(cfg.lora.target_modules, arch)
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from stages.model.experts import structure
from stages.model.experts.structure import ExpertStack, MoeParts

# Fused projections: one module computes what Llama-style models split in several. LoRA on the fused
# module adapts all of its parts (its lora_B has a block for each).
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),          # Phi-3, Phi-4
    "query_key_value": ("q_proj", "k_proj", "v_proj"),   # GPT-NeoX, Falcon, Bloom
    "c_attn": ("q_proj", "k_proj", "v_proj"),            # GPT-2, StarCoder
    "Wqkv": ("q_proj", "k_proj", "v_proj"),              # MPT, ModernBERT
    "W_pack": ("q_proj", "k_proj", "v_proj"),            # Baichuan
    "gate_up_proj": ("gate_proj", "up_proj"),            # Phi-3, Phi-4
}
LINEAR_TYPES = ("Linear", "Linear4bit", "Linear8bitLt", "Conv1D")  # what peft's LoRA adapts as a linear layer
# Names a LoRA config written for per-expert nn.Linear MLPs (transformers 4, Mixtral's w1/w2/w3) gives the
# projections the fused expert stacks now hold
EXPERT_ALIASES = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "w1": "gate_up_proj", "w3": "gate_up_proj",
                  "w2": "down_proj"}


@dataclass(frozen=True)
class Linear:
    """Every instance of one linear module name (a leaf name such as q_proj) in the model."""

    name: str
    shapes: tuple[tuple[int, int], ...]   # (in_features, out_features) of each instance

    @property
    def numel(self) -> int:
        return sum(i * o for i, o in self.shapes)


@dataclass(frozen=True)
class Attention:
    """What a model's attention computes beyond causal softmax(QK^T / sqrt(d)) V, and the kernels transformers has for it.
    SDPA and the packed varlen kernel compute none of the extras: on a model that has them they would train another
    model than the one merged, exported and served."""

    extras: tuple[str, ...] = ()          # logit soft-capping (Gemma-2), attention sinks (GPT-OSS)
    sliding_window: int | None = None     # the window of its sliding-window layers, where it has some
    sdpa: bool = True                     # transformers has an SDPA path for the class
    flex: bool = False                    # ... and a flex_attention one

    def varlen_misses(self, longest: int) -> list[str]:
        """What the packed varlen kernel would leave out on samples of up to `longest` tokens."""
        window = self.sliding_window is not None and longest > self.sliding_window
        return list(self.extras) + ([f"a {self.sliding_window}-token sliding window (samples up to {longest} tokens)"] if window else [])


@dataclass
class Architecture:
    model_class: str
    model_type: str
    linears: dict[str, Linear]            # adaptable linear modules by leaf name (the output layer excluded, as peft does)
    total_params: int                     # every parameter, a tied table counted once
    layers: int                           # decoder layers
    qk_norm: bool                         # attention normalises queries and keys (Qwen3, OLMo2, Gemma3)
    tied: bool
    output_layer: str | None = None       # lm_head's leaf name: never a LoRA target under all-linear
    parameters: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)  # name -> shape: what the weights must hold
    experts: MoeParts = field(default_factory=MoeParts)  # routed expert stacks (3-D parameters), routers, shared experts
    attention: Attention = field(default_factory=Attention)
    declared_experts: int = 0             # routed experts per layer, as config.json declares them
    output_plain: bool = True             # the output layer is a plain nn.Linear (what a chunked loss reads)

    @property
    def linear_params(self) -> int:
        return sum(m.numel for m in self.linears.values())


@dataclass
class Targets:
    """LoRA targets as peft gets them, and what they adapt."""

    modules: list[str]                    # leaf names, in the model's order
    notes: list[str]                      # one line per requested name mapped onto a fused module
    linears: list[Linear]
    stacks: list[ExpertStack] = field(default_factory=list)   # routed expert stacks, adapted per expert
    parameters: list[str] = field(default_factory=list)       # peft's target_parameters naming exactly `stacks`
    experts: MoeParts = field(default_factory=MoeParts)       # what the model has, adapted or not

    def linear_params(self, r: int) -> int:
        """LoRA parameters on the linear modules: r x (in + out) per adapted instance (lora_A and lora_B)."""
        return sum(r * (i + o) for m in self.linears for i, o in m.shapes)

    def expert_params(self, r: int) -> int:
        """LoRA parameters on the expert stacks: one rank-r adapter per expert."""
        return sum(s.lora_params(r) for s in self.stacks)

    def params(self, r: int) -> int:
        return self.linear_params(r) + self.expert_params(r)

    def summary(self, r: int) -> str:
        linears = ", ".join(f"{m.name} x{len(m.shapes)}" for m in self.linears)
        out = f"{linears}: {self.linear_params(r) / 1e6:.2f} M LoRA parameters at r={r}" if linears else ""
        if self.experts.stacks:
            if self.stacks:
                leaves = {}
                for s in self.stacks:
                    leaves.setdefault(s.leaf, []).append(s)
                counts = sorted({s.experts for s in self.stacks})
                out += ("; " if out else "") + (
                    "routed experts: " + ", ".join(f"{leaf} x{len(ss)}" for leaf, ss in leaves.items())
                    + f" ({'/'.join(map(str, counts))} experts each, rank {r} per expert): "
                    f"{self.expert_params(r) / 1e6:.2f} M LoRA parameters")
            else:
                frozen = sum(s.numel for s in self.experts.stacks)
                out += f"; routed experts NOT adapted ({len(self.experts.stacks)} stacks, {frozen / 1e9:.2f} B weights frozen)"
            out += "; routers frozen"
        return out


def of_model(model) -> Architecture | None:
    """The architecture of the base model a config's `model` section names (config.json only)."""
    from stages.model.directory import config_text, resolve_model_dir

    model_dir = resolve_model_dir(model.name_or_path)
    return from_config_text(config_text(model_dir), model.trust_remote_code, str(model_dir))


def from_config(config: dict, trust_remote_code: bool = False, model_dir: str | None = None) -> Architecture | None:
    return from_config_text(json.dumps(config, sort_keys=True), trust_remote_code, model_dir)


@functools.lru_cache(maxsize=32)
def from_config_text(text: str, trust_remote_code: bool = False, model_dir: str | None = None) -> Architecture | None:
    """Build the model on the meta device and read its modules; None when transformers cannot build it
    from this config (an unknown model_type, code it would have to run without trust_remote_code)."""
    import logging

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(text)
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        if model_dir and trust_remote_code:
            config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
        else:
            config = AutoConfig.for_model(**raw) if "model_type" in raw else None
        if config is None:
            return None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # not buildable here: the callers fall back to config.json's shapes and say so
        return None
    finally:
        quiet.setLevel(level)
    return describe(model)


def describe(model) -> Architecture:
    """An Architecture from a built model (meta device or real)."""
    from torch import nn

    out = model.get_output_embeddings()
    out_name = next((n for n, m in model.named_modules() if m is out), None) if out is not None else None
    by_leaf: dict[str, list[tuple[int, int]]] = {}
    qk_norm = False
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
            qk_norm = True
        if name == out_name or not (isinstance(module, nn.Linear) or type(module).__name__ in LINEAR_TYPES):
            continue   # a subclass is a linear module to peft too (Falcon's FalconLinear)
        w = module.weight
        # torch Linear stores (out, in); GPT-2's Conv1D (in, out)
        i, o = (w.shape[0], w.shape[1]) if type(module).__name__ == "Conv1D" else (module.in_features, module.out_features)
        by_leaf.setdefault(leaf, []).append((int(i), int(o)))
    seen, total = set(), 0
    params = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params[name] = tuple(p.shape)
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    emb = model.get_input_embeddings()
    tied = out is not None and emb is not None and getattr(out, "weight", None) is getattr(emb, "weight", None)
    layers = getattr(model.config.get_text_config(), "num_hidden_layers", 0) or 0
    return Architecture(type(model).__name__, model.config.model_type, {k: Linear(k, tuple(v)) for k, v in by_leaf.items()},
                        total, layers, qk_norm, tied, out_name.rsplit(".", 1)[-1] if out_name else None, params,
                        structure.fused_experts(model), _attention(model, params), _declared_experts(model.config.get_text_config()),
                        type(out) is nn.Linear)


def _declared_experts(c) -> int:
    n = next((getattr(c, k) for k in ("num_local_experts", "num_experts", "n_routed_experts") if getattr(c, k, None)), None)
    n = n or getattr(getattr(c, "ffn_config", None), "moe_num_experts", None)   # DBRX
    return int(max(n) if isinstance(n, list | tuple) else n or 0)


def _attention(model, params: dict) -> Attention:
    c = model.config.get_text_config()
    window, types = getattr(c, "sliding_window", None), getattr(c, "layer_types", None)
    if types is not None and "sliding_attention" not in types or types is None and getattr(c, "use_sliding_window", True) is False:
        window = None   # Qwen2/3 carry a window they do not use
    extras = [x for x, on in (("logit soft-capping", getattr(c, "attn_logit_softcapping", None)),
                              ("attention sinks", any(n.endswith("self_attn.sinks") for n in params))) if on]
    return Attention(tuple(extras), window, bool(getattr(type(model), "_supports_sdpa", True)),
                     bool(getattr(type(model), "_supports_flex_attn", False)))


def attention_implementation(requested: str, arch: Architecture | None, cuda: bool) -> str:
    """model.attn_implementation for this model on this device. auto: sdpa where it computes the model's attention,
    else flex_attention on a CUDA GPU (soft-capping, sinks and windows in its score and mask functions) and eager
    elsewhere. sdpa asked of a class transformers has no SDPA path for is a ConfigError; asked of a model whose
    soft-capping it skips, it is the user's trade (sdpa_skips says what is skipped)."""
    from stages.errors import ConfigError

    a = arch.attention if arch else Attention()
    if requested == "auto":
        if a.sdpa and not a.extras:
            return "sdpa"
        return "flex_attention" if cuda and a.flex else "eager"
    if requested == "sdpa" and not a.sdpa:
        raise ConfigError(f"model.attn_implementation: sdpa: transformers has no SDPA path for {arch.model_class} "
                          f"({' and '.join(a.extras) or 'its attention'}); set it to auto (flex_attention on a GPU, eager elsewhere) or eager")
    return requested


def sdpa_skips(requested: str, arch: Architecture | None) -> list[str]:
    """What of the model's attention an explicit `sdpa` leaves out (the preflight says it)."""
    return list(arch.attention.extras) if requested == "sdpa" and arch else []


def decoder_layers(model) -> list:
    """The repeated blocks transformers can checkpoint, in order (the layers training checkpoints and FSDP wraps)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def resolve_targets(requested: list[str] | str, arch: Architecture) -> Targets:
    """`lora.target_modules` against the model's linear modules and its routed expert stacks.

    all-linear: every linear module but the output layer and the routers, and every expert stack. A name the
    model has is kept (a linear module, an expert stack such as gate_up_proj / down_proj, or `experts` for all
    of them); q_proj/k_proj/v_proj/gate_proj/up_proj on a model that fuses them map to the fused module or
    stack (qkv_proj, gate_up_proj, c_attn, ...), one note each; anything else is a ConfigError naming what the
    model has.
    """
    from stages.errors import ConfigError

    parts = arch.experts
    by_leaf: dict[str, list[ExpertStack]] = {}
    for st in parts.stacks:
        by_leaf.setdefault(st.leaf, []).append(st)
    routers = {n.rsplit(".", 1)[-1] for n in parts.router_linears}
    have = list(arch.linears)
    if requested == "all-linear":
        if arch.declared_experts > 1 and not parts.stacks:
            raise ConfigError(
                f"lora.target_modules: all-linear would leave the {arch.declared_experts} routed experts of {arch.model_class} "
                "untrained (they are not the fused 3-D stacks, or the nn.Linear modules, LoRA adapts here) and adapt its "
                f"attention alone; to train that, name the modules in lora.target_modules (its linear modules: {have})")
        modules = [n for n in have if n not in routers]  # a router trained by accident reroutes every token
        if not modules and not parts.stacks:
            raise ConfigError(f"lora.target_modules: all-linear finds no linear module or expert stack in {arch.model_class} that "
                              "LoRA can adapt; name its modules in lora.target_modules")
        return _targets(arch, modules, [], list(parts.stacks))
    chosen, stacks, notes, unknown = [], [], [], []
    for name in requested:
        hit = False
        if name in arch.linears:
            chosen.append(name)
            hit = True
        if name == "experts":
            stacks += parts.stacks
            hit = True
        elif name in by_leaf:
            stacks += by_leaf[name]
            hit = True
        elif EXPERT_ALIASES.get(name) in by_leaf:
            fused = EXPERT_ALIASES[name]
            stacks += by_leaf[fused]
            notes.append(f"lora.target_modules: {name} is the routed experts' {fused} in {arch.model_class} (fused 3-D "
                         f"weights): adapting {fused} of every expert")
            hit = True
        if hit:
            continue
        fused = next((f for f, fparts in FUSED.items() if name in fparts and f in arch.linears), None)
        if fused is None:
            unknown.append(name)
            continue
        chosen.append(fused)
    for fused in dict.fromkeys(c for c in chosen if c in FUSED and c not in requested):
        fparts = [p for p in FUSED[fused] if p in requested]
        others = [p for p in FUSED[fused] if p not in requested]
        notes.append(f"lora.target_modules: {', '.join(fparts)} {'is' if len(fparts) == 1 else 'are'} fused into {fused} in "
                     f"{arch.model_class}: adapting {fused}" + (f" (its adapter also covers {', '.join(others)})" if others else ""))
    if unknown:
        expert_names = f" and its routed experts' stacks {sorted(by_leaf)} (or `experts` for all)" if by_leaf else ""
        router = (f"; {', '.join(sorted(set(unknown) & set(structure.ROUTER_NAMES)))} is the router, a weight LoRA does not adapt here"
                  if set(unknown) & set(structure.ROUTER_NAMES) and by_leaf else "")
        raise ConfigError(
            f"lora.target_modules {unknown} match no linear module of {arch.model_class}; its linear modules are "
            f"{have}{expert_names}{router}: set lora.target_modules to some of them (or to all-linear)")
    order = [n for n in have if n in set(chosen)]
    return _targets(arch, order, notes, list(dict.fromkeys(stacks)))


def _targets(arch: Architecture, modules: list[str], notes: list[str], stacks: list[ExpertStack]) -> Targets:
    return Targets(modules, notes, [arch.linears[n] for n in modules], stacks,
                   structure.target_parameters([s.name for s in stacks], list(arch.parameters)), arch.experts)


def lora_kwargs(lora, targets: Targets, model_class: str = "this model") -> dict:
    """peft.LoraConfig's keywords: the config's lora section with the resolved targets. peft adapts fused expert
    weights without dropout (lora.ParamWrapper refuses any): where experts are adapted, the default dropout
    becomes 0, a dropout the config asks for is a ConfigError."""
    from stages.errors import ConfigError

    kw = lora.model_dump() | {"target_modules": targets.modules or None, "target_parameters": targets.parameters or None}
    if targets.stacks and lora.lora_dropout > 0:
        if "lora_dropout" in lora.model_fields_set:
            raise ConfigError(
                f"lora.lora_dropout is {lora.lora_dropout}, but the routed experts of {model_class} are adapted and peft has "
                "no dropout on fused expert weights (lora.ParamWrapper); set lora.lora_dropout: 0, or leave the experts "
                "out of lora.target_modules (e.g. [q_proj, k_proj, v_proj, o_proj])")
        kw["lora_dropout"] = 0.0
    return kw


def dropout_note(lora, kwargs: dict) -> list[str]:
    """The line that says the dropout lora_kwargs set to 0 (the experts adapted, the dropout the default)."""
    if kwargs["lora_dropout"] == lora.lora_dropout:
        return []
    return [f"lora.lora_dropout: 0, not the default {lora.lora_dropout}: peft has no dropout on the fused expert weights "
            "of the routed experts"]
