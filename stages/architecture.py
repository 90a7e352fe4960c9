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


@dataclass(frozen=True)
class Linear:
    """Every instance of one linear module name (a leaf name such as q_proj) in the model."""

    name: str
    shapes: tuple[tuple[int, int], ...]   # (in_features, out_features) of each instance

    @property
    def numel(self) -> int:
        return sum(i * o for i, o in self.shapes)


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

    @property
    def linear_params(self) -> int:
        return sum(m.numel for m in self.linears.values())


@dataclass
class Targets:
    """LoRA targets as peft gets them, and what they adapt."""

    modules: list[str]                    # leaf names, in the model's order
    notes: list[str]                      # one line per requested name mapped onto a fused module
    linears: list[Linear]

    def params(self, r: int) -> int:
        """LoRA parameters: r x (in + out) per adapted instance (lora_A and lora_B)."""
        return sum(r * (i + o) for m in self.linears for i, o in m.shapes)

    def summary(self, r: int) -> str:
        return (", ".join(f"{m.name} x{len(m.shapes)}" for m in self.linears)
                + f": {self.params(r) / 1e6:.2f} M LoRA parameters at r={r}")


def of_model(model) -> Architecture | None:
    """The architecture of the base model a config's `model` section names (config.json only)."""
    from stages.modelio import resolve_model_dir

    path = resolve_model_dir(model.name_or_path) / "config.json"
    return from_config_text(path.read_text(encoding="utf-8"), model.trust_remote_code, str(path.parent))


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
    out = model.get_output_embeddings()
    out_name = next((n for n, m in model.named_modules() if m is out), None) if out is not None else None
    by_leaf: dict[str, list[tuple[int, int]]] = {}
    qk_norm = False
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
            qk_norm = True
        if name == out_name or type(module).__name__ not in LINEAR_TYPES:
            continue
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
                        total, layers, qk_norm, tied, out_name.rsplit(".", 1)[-1] if out_name else None, params)


def decoder_layers(model) -> list:
    """The repeated blocks transformers can checkpoint, in order (the layers training checkpoints and FSDP wraps)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def resolve_targets(requested: list[str] | str, arch: Architecture) -> Targets:
    """`lora.target_modules` against the model's linear modules.

    A name the model has is kept; q_proj/k_proj/v_proj/gate_proj/up_proj on a model that fuses them
    map to the fused module (qkv_proj, gate_up_proj, c_attn, query_key_value, ...), one note each;
    anything else is a ConfigError naming the model's own linear modules.
    """
    from stages.errors import ConfigError

    have = list(arch.linears)
    if requested == "all-linear":
        return Targets(have, [], [arch.linears[n] for n in have])
    chosen, notes, unknown = [], [], []
    for name in requested:
        if name in arch.linears:
            chosen.append(name)
            continue
        fused = next((f for f, parts in FUSED.items() if name in parts and f in arch.linears), None)
        if fused is None:
            unknown.append(name)
            continue
        chosen.append(fused)
    for fused in dict.fromkeys(c for c in chosen if c in FUSED and c not in requested):
        parts = [p for p in FUSED[fused] if p in requested]
        others = [p for p in FUSED[fused] if p not in requested]
        notes.append(f"lora.target_modules: {', '.join(parts)} {'is' if len(parts) == 1 else 'are'} fused into {fused} in "
                     f"{arch.model_class}: adapting {fused}" + (f" (its adapter also covers {', '.join(others)})" if others else ""))
    if unknown:
        raise ConfigError(
            f"lora.target_modules {unknown} match no linear module of {arch.model_class}; its linear modules are "
            f"{have}: set lora.target_modules to some of them (or to all-linear)")
    order = [n for n in have if n in set(chosen)]
    return Targets(order, notes, [arch.linears[n] for n in order])
