"""What the `auto` training settings resolve to, and the Liger kernels they switch on.

`resolve_auto` is the one place the settings are decided: training passes what this machine
has, the preflight estimate the device it estimates for. `settings` decides them once for a
run on this machine (a frozen `Settings`), and the pieces that build it (the model, the
Trainer, the fit) take that instead of resolving the config again.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import sys
import textwrap
from dataclasses import dataclass

import torch

from stages.config import ConfigError, RunConfig
from stages.model.load import device
from stages.train import batches, chunked_loss
from stages.train.batches import TILE_FROM_TOKENS


def resolve_auto(cfg: RunConfig, *, on_gpu: bool, liger: bool = True, bnb: bool = True, varlen: bool = True,
                 longest: int | None = None) -> dict:
    """What the `auto` training settings become on a GPU (`on_gpu`) or a CPU.

    Args:
        liger, bnb, varlen: whether liger-kernel, bitsandbytes and torch's varlen attention are there.
        longest: the longest sample the data holds after data.long_sample_policy (the preflight scan
            and training know it); None assumes data.max_length.
    """
    t = cfg.training
    memory_first = on_gpu and t.planned_fit == "memory"
    # Packing is on where it was measured faster (docs/benchmarks.md: packing_speed): CPU (1.92x plain peft) and a GPU with
    # torch's varlen flash kernel (R7 on the H200: 3.2-3.7x peft + Liger, less memory).
    packed = t.packing == "on" or (t.packing == "auto" and (not on_gpu or varlen))
    # The tiled MLP pays one more MLP forward per layer to keep the tokens x intermediate activations small:
    # worth it only when the widest micro-batch the data can make is long (padded: micro-batch x longest sample).
    widest = (batches.widest_packed(cfg, longest or cfg.data.max_length) if packed
              else t.per_device_train_batch_size * (longest or cfg.data.max_length))
    # varlen computes plain causal attention: a model that soft-caps, has sinks or a window shorter than its samples
    # gets its own attention over the packed mask (flex_attention on a GPU)
    missed = varlen_misses(cfg, longest or cfg.data.max_length) if packed else []
    if packed and t.packed_attention == "varlen" and missed:
        raise ConfigError(f"training.packed_attention: varlen computes plain causal attention, without this model's "
                          f"{', '.join(missed)}: it would train another model than the one exported; set it to auto "
                          "(flex_attention on a GPU, the model's own attention over the packed mask elsewhere) or mask")
    exact = varlen and not missed
    return {
        "packing": packed,
        "packed_attention": None if not packed else t.packed_attention if t.packed_attention != "auto"
        # on CPU the per-sample loop: 1.45x the mask's speed on long-tailed data (docs/benchmarks.md: packing_speed)
        else "varlen" if exact else "flex_attention" if on_gpu and _attention(cfg).flex else "mask",
        "widest_micro_batch": widest,
        "fused_kernels": t.fused_kernels == "on" or (t.fused_kernels == "auto" and on_gpu and liger),
        # FSDP2 gathers a layer's weights around its own forward and backward hooks, which this function's backward
        # reads past
        "fused_lora": t.fused_lora == "on" or (t.fused_lora == "auto" and t.distributed != "fsdp"),
        "offload_activations": t.offload_activations == "on"
        or (t.offload_activations == "auto" and memory_first and t.gradient_checkpointing),
        # FSDP shards the table across processes instead (a host table is no parameter FSDP can shard)
        "offload_embeddings": t.distributed != "fsdp" and (t.offload_embeddings == "on" or (t.offload_embeddings == "auto" and memory_first)),
        # memory-first only: a speed plan keeps the layers' activations where the card holds them, and the tiled MLP's
        # extra MLP forward per layer then costs more than it saves (Llama-3.1-8B at 1 x 32,768 tokens: 0.85x Unsloth with
        # it, docs/benchmarks.md: peers); fit: auto picks speed only where the untiled estimate fits
        "tiled_mlp": t.tiled_mlp == "on" or (t.tiled_mlp == "auto" and memory_first and liger and widest >= TILE_FROM_TOKENS),
        # 8-bit AdamW when memory comes first, fused AdamW when speed does (bitsandbytes' 8-bit states do not take
        # FSDP2's sharded parameters; sharded N ways, 32-bit states are small). Not paged: its states in managed memory
        # cost 57 ms a step on Qwen3-8B all-linear (504 matrices) for 0.08 GiB (docs/benchmarks.md: peers)
        "optim": t.optim if t.optim != "auto" else "adamw_torch" if t.distributed == "fsdp" else
        "adamw_8bit" if memory_first and bnb else "adamw_torch_fused" if on_gpu else "adamw_torch",
        # the project's chunked loss in chunks where the output layer's matmul is bound by compute, not by reading
        # the layer once per few dozen rows, where the plan has the card's room (stages/train/chunked_loss.py)
        "loss_chunk_logits": chunked_loss.WIDE_CHUNK_LOGITS if on_gpu and not memory_first else chunked_loss.MIN_CHUNK_LOGITS,
    }


def _architecture(cfg: RunConfig):
    """The base model's Architecture from its config.json, None where it cannot be read."""
    from stages.model import architecture

    try:
        return architecture.of_model(cfg.model)
    except Exception:  # noqa: BLE001 - a model that cannot be read is reported by the model checks, with the fix
        return None


def _attention(cfg: RunConfig):
    from stages.model import architecture

    arch = _architecture(cfg)
    return arch.attention if arch else architecture.Attention()


def varlen_misses(cfg: RunConfig, longest: int) -> list[str]:
    """What the packed varlen kernel would not compute of this model's attention on samples of up to `longest` tokens
    (beyond what an explicit model.attn_implementation: sdpa already gives up)."""
    a = _attention(cfg)
    missed = a.varlen_misses(longest)
    return missed[len(a.extras):] if cfg.model.attn_implementation == "sdpa" else missed


@dataclass(frozen=True)
class Settings:
    """The `auto` training settings as this machine and this data decide them: resolve_auto's answer, plus the loss."""
    packing: bool
    packed_attention: str | None   # varlen, flex_attention or mask when packing
    widest_micro_batch: int
    fused_kernels: bool
    fused_lora: bool
    offload_activations: bool
    offload_embeddings: bool
    tiled_mlp: bool
    optim: str
    loss_chunk_logits: int         # the least logits per chunk of the project's chunked loss
    cross_entropy: str             # plain, chunked (Liger's) or chunked-torch (stages/train/chunked_loss.py)


_NEEDS = {"fused_kernels": "a CUDA GPU and liger-kernel (`pip install -e .[gpu]`)",
          "tiled_mlp": "a CUDA GPU and liger-kernel (`pip install -e .[gpu]`)",
          "offload_activations": "a CUDA GPU (pinned host memory, copy streams)",
          "offload_embeddings": "a CUDA GPU (the table is already in host memory on CPU)"}


def _check_forced(cfg: RunConfig, on_gpu: bool, varlen: bool) -> None:
    """A setting forced to what this machine cannot do is one error naming it and the fix."""
    t = cfg.training
    if t.fused_lora == "on" and t.distributed == "fsdp":
        raise ConfigError("training.fused_lora: on reads each layer's base weight in its backward, which FSDP2 has resharded "
                          "by then; set it to auto or off with distributed: fsdp")
    for key, needs in _NEEDS.items():
        if getattr(t, key) == "on" and not (on_gpu and (_has_liger() or "liger" not in needs)):
            raise ConfigError(f"training.{key}: on needs {needs}; set it to auto or off")
    if t.packed_attention == "flex_attention" and not on_gpu:
        raise ConfigError("training.packed_attention: flex_attention needs a CUDA GPU (torch has no flex attention backward on "
                          "CPU); set it to auto, varlen or mask")
    if t.packed_attention == "varlen" and not varlen:
        raise ConfigError("training.packed_attention: varlen needs torch >= 2.10 (torch.nn.attention.varlen) and an Ampere or "
                          "newer GPU; set it to auto, flex_attention or mask")


def settings(cfg: RunConfig, longest: int | None = None) -> Settings:
    """The run's settings on this machine, decided once, every forced one checked against it.

    Args:
        longest: the data's longest sample (sizes the widest micro-batch, which decides the tiled MLP);
            None assumes data.max_length.
    """
    from stages.train.attention import varlen_available

    on_gpu, varlen = device().type == "cuda", varlen_available()
    _check_forced(cfg, on_gpu, varlen)
    resolved = resolve_auto(cfg, on_gpu=on_gpu, liger=_has_liger(), bnb=importlib.util.find_spec("bitsandbytes") is not None,
                            varlen=varlen, longest=longest)
    return Settings(**resolved, cross_entropy=cross_entropy(cfg))


# Optimizer state per trainable parameter, by optimizer: AdamW keeps two fp32 moments, the 8-bit ones two bytes.
OPTIM_BYTES = {"auto": 8, "adamw_torch": 8, "adamw_torch_fused": 8, "paged_adamw_8bit": 2, "adamw_8bit": 2, "sgd": 0}


def tile_mlp(model, on: bool = True) -> int:
    """Wrap (or unwrap) every decoder MLP in Liger's tiled MLP; returns how many are tiled.

    At 80k tokens one Qwen2-7B MLP's gate/up/product activations and their grads are
    ~7 x 2.9 GiB; in tiles of hidden_size tokens they are ~7 x 0.13 GiB.
    """
    from liger_kernel.ops.tiled_mlp import apply_tiled_mlp

    n = 0
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not hasattr(mlp, "down_proj"):
            continue
        if "_untiled_forward" in mlp.__dict__:
            mlp.forward = mlp.__dict__.pop("_untiled_forward")
        if on:
            inner = mlp.forward
            mlp._untiled_forward = inner
            mlp.forward = lambda x, _m=mlp, _f=inner: apply_tiled_mlp(fn=lambda m, xs: _f(xs), mlp_module=_m, x=x)
            n += 1
    return n


def cross_entropy(cfg: RunConfig, on_gpu: bool | None = None) -> str:
    """The loss the train stage computes: `plain` (the tokens x vocab logits), `chunked` (Liger's fused linear
    cross-entropy, on a GPU, for the families Liger has it for) or `chunked-torch` (stages/train/chunked_loss.py, on
    any device, for the families whose forward it can take). `auto` and `chunked` take the first chunked one that
    covers the family; `chunked` where neither does is one error naming both reasons.

    Args:
        on_gpu: the device estimated for (the preflight on a CPU machine estimating a GPU run); None: this machine,
            where Liger must also be installed.
    """
    choice = cfg.training.cross_entropy
    if choice == "plain":
        return "plain"
    here = on_gpu is None
    on_gpu = device().type == "cuda" if here else on_gpu
    family = model_type(cfg)
    if on_gpu and (_has_liger() or not here) and fused_loss_for(family):
        return "chunked"
    refusal = own_loss_refusal(cfg)
    if refusal is None:
        return "chunked-torch"
    if choice == "chunked":
        liger = ("liger-kernel has no fused linear cross-entropy for model_type " + repr(family) if on_gpu and _has_liger()
                 else "Liger's fused linear cross-entropy needs a CUDA GPU and liger-kernel (`pip install -e .[gpu]`)")
        raise ConfigError(f"training.cross_entropy: chunked: {liger}, and the project's own chunked loss cannot take this "
                          f"model: {refusal}; set training.cross_entropy: auto (the plain loss here) or plain")
    return "plain"


def own_loss_refusal(cfg: RunConfig) -> str | None:
    """Why stages/train/chunked_loss.py cannot compute this run's loss, or None where it can."""
    import transformers

    if cfg.training.distributed == "fsdp":
        return "distributed: fsdp shards the output layer it reads"
    arch = _architecture(cfg)
    cls = getattr(transformers, arch.model_class, None) if arch else None
    if cls is None:
        return "the model's class is not one transformers ships"
    if not arch.output_plain:
        return f"{arch.model_class}'s output layer is not a plain linear layer"
    targets = cfg.lora.target_modules
    if arch.output_layer and targets != "all-linear" and arch.output_layer in targets:
        return f"lora.target_modules adapts the output layer ({arch.output_layer})"
    try:
        from stages.model.directory import resolve_model_dir

        config = transformers.AutoConfig.from_pretrained(resolve_model_dir(cfg.model.name_or_path))
    except Exception:  # noqa: BLE001 - without it a block under `if self.config.<key> is not None:` is refused
        config = None
    return chunked_loss.unsupported(cls, config, arch.output_layer or "lm_head")


def model_type(cfg: RunConfig) -> str | None:
    """config.json's model_type of the base model, None where it cannot be read (the model checks say why)."""
    from stages.model.directory import config_json, resolve_model_dir

    try:
        return config_json(resolve_model_dir(cfg.model.name_or_path)).get("model_type")
    except Exception:  # noqa: BLE001 - a model that cannot be read is reported by the model checks, with the fix
        return None


def fused_loss_for(family: str | None) -> bool:
    """Whether Liger has its fused linear cross-entropy for this model family. Without liger-kernel installed
    (a CPU machine estimating for a GPU) it is assumed, as for the families it lists."""
    if not _has_liger():
        return True
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(family)
    return apply is not None and "fused_linear_cross_entropy" in inspect.signature(apply).parameters \
        and "fused_linear_cross_entropy" not in refused(apply)


@functools.cache
def refused(apply) -> frozenset[str]:
    """The options a Liger apply function raises NotImplementedError for (0.8.5: Granite's fused loss, its logits
    being scaled; GLM-4's and Qwen3.5's RoPE), read from its source: `if <option>: raise NotImplementedError(...)`.
    Read, not tried: trying patches the family's modules before it raises."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(apply)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(node.test.id for node in ast.walk(tree)
                     if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                     and any(isinstance(b, ast.Raise) and "NotImplementedError" in ast.unparse(b) for b in node.body))


def _has_liger() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def use_liger(model, *, loss: bool, kernels: bool, forced: bool = True) -> None:
    """Liger Kernel on this model instance: the fused linear cross-entropy never materialises
    the vocab x tokens logits; RMSNorm, SwiGLU and RoPE kernels save activations and time.

    The loss and the norm/MLP kernels are bound to this instance's modules; Liger also swaps
    the RoPE function and the RMSNorm/MLP classes in the model's transformers module, so a
    model of the same family built later in this process (merge) gets them too (same maths).
    """
    if not (loss or kernels):
        return
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model.config.model_type)
    if apply is None:
        if not forced:  # `auto`: Llama's kernels where the family computes Llama's maths, and the probe measures the rest
            same = llama_modules(model) if kernels else {}
            print(f"train: liger-kernel has no kernels for model_type {model.config.model_type!r}: "
                  + (f"Llama's kernels on the modules that compute Llama's maths ({', '.join(f'{n} {k}' for k, n in same.items() if n)})"
                     if any(same.values()) else "stock modules") + (", stock loss" if loss else ""))
            return
        raise ConfigError(
            f"liger-kernel has no kernels for model_type {model.config.model_type!r}; "
            "set training.cross_entropy and training.fused_kernels to auto (stock modules) or plain/off"
        )
    # Liger also swaps the family's experts class in its transformers module (LigerExperts, a fused MoE forward over
    # 16-bit stacks): a model built later in this process (an OOM rebuild, merge) would lose the grouped expert
    # LoRA and the NF4 stacks (stages.model.experts.lora). This instance keeps Liger's forward; the module keeps its class.
    modeling = sys.modules.get(type(model).__module__)
    experts_classes = {k: v for k, v in vars(modeling).items() if k.endswith("Experts")} if modeling else {}
    apply(model=model, **liger_options(apply, loss=loss, kernels=kernels))
    for k, v in experts_classes.items():
        setattr(modeling, k, v)


# The MLP kernel is named for the family's activation (Llama's swiglu, Gemma's geglu, Nemotron's relu_squared),
# and an apply function takes only the kernels its family has: passing swiglu to Gemma-2's is a TypeError.
_MODULE_KERNELS = ("rope", "rms_norm", "swiglu", "geglu", "relu_squared")


def liger_options(apply, *, loss: bool, kernels: bool) -> dict:
    """The keyword arguments `apply` (a Liger apply_liger_kernel_to_* function) accepts, for this choice."""
    accepted = set(inspect.signature(apply).parameters) - refused(apply)
    options = {"fused_linear_cross_entropy": loss, "cross_entropy": False} | {k: kernels for k in _MODULE_KERNELS}
    return {k: v for k, v in options.items() if k in accepted} | {k: False for k in refused(apply)}


def llama_modules(model) -> dict[str, int]:
    """Liger's Llama kernels on the modules of `model` whose family computes exactly Llama's maths, for a family
    Liger has no apply function for (Qwen2-MoE, OLMoE: their RMSNorm, RoPE and dense SwiGLU MLP are Llama's
    line for line, a generated copy): the RMSNorm and MLP modules of this instance, and the family's RoPE function on
    CUDA tensors. Same source text as Llama's forward decides, not the class name; the MLP's activation must be SiLU.
    Returns how many of each changed."""
    from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module, _patch_swiglu_module
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    norms, mlps, rope = llama_like(model)
    for module in norms:
        _patch_rms_norm_module(module)
    for module in mlps:
        _patch_swiglu_module(module, LigerSwiGLUMLP)
    if rope:
        family = sys.modules[type(model).__module__]
        family.apply_rotary_pos_emb = _cuda_rope(family.apply_rotary_pos_emb)
    return {"rms_norm": len(norms), "swiglu": len(mlps), "rope": int(rope)}


def _silu_classes() -> tuple[type, ...]:
    from transformers import activations

    return (torch.nn.SiLU,) + tuple(c for c in (getattr(activations, "SiLUActivation", None),) if c is not None)


def llama_like(model) -> tuple[list, list, bool]:
    """The RMSNorm and SwiGLU MLP modules of `model` whose forward is Llama's line for line (a SiLU activation), and
    whether its family's RoPE function is Llama's and not yet replaced."""
    from transformers.models.llama import modeling_llama as llama

    silu = _silu_classes()
    norms = [m for m in model.modules() if _same_forward(type(m), llama.LlamaRMSNorm)]
    mlps = [m for m in model.modules() if _same_forward(type(m), llama.LlamaMLP) and isinstance(getattr(m, "act_fn", None), silu)]
    stock = getattr(sys.modules.get(type(model).__module__), "apply_rotary_pos_emb", None)
    return norms, mlps, stock is not None and not getattr(stock, "liger", False) and _same_source(stock, llama.apply_rotary_pos_emb)


def _cuda_rope(stock):
    """Liger's RoPE on CUDA tensors, the family's own elsewhere (a CPU merge later in this process)."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    @functools.wraps(stock)
    def rope(q, k, cos, sin, *args, **kwargs):
        return (liger_rotary_pos_emb if q.is_cuda else stock)(q, k, cos, sin, *args, **kwargs)

    rope.liger = True
    return rope


def _same_forward(cls: type, reference: type) -> bool:
    return cls is not reference and "forward" in vars(cls) and _same_source(cls.forward, reference.forward)


@functools.cache
def _same_source(fn, reference) -> bool:
    try:
        return inspect.getsource(fn) == inspect.getsource(reference)
    except (OSError, TypeError):
        return False
