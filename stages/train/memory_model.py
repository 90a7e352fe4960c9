"""The analytic memory model: what one optimizer step of the train stage needs on a GPU (or CPU),
itemised, from config.json shapes and the resolved training settings. The preflight, the
autofit and the benches read it; nothing here loads a model.

The coefficients are fitted to runs measured on an H200 (docs/benchmarks.md: gpu_figure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from stages.config import ConfigError, RunConfig
from stages.memory import GIB
from stages.model import architecture
from stages.model.architecture import Architecture, Linear, Targets
from stages.model.load import compute_dtype
from stages.train import chunked_loss
from stages.train.kernels import OPTIM_BYTES, cross_entropy, resolve_auto

KNOWN_MODEL_TYPES = {"llama", "qwen2", "mistral", "qwen3", "phi3", "olmo2"}  # measured (docs/benchmarks.md: gpu_figure)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NF4_BYTES = {True: 0.5 + 1 / 64 + 4 / (64 * 256), False: 0.5 + 4 / 64}  # 4-bit + absmax (double-quant or fp32)
CUBLAS_WORKSPACE = 64 * 2**20  # cuBLAS's workspaces in torch's allocator: what stays allocated after a freed model (H200)
LOSS_H = 3  # hidden-sized tensors around Liger's loss: the final hidden states, their norm, the input gradient it computes in forward
# Fitted to the default-settings memory grid (docs/benchmarks.md: gpu_figure).
COEF = dict(
    layer_h=5.765,      # x T*H*act: hidden-sized tensors and grads of the layer being back-propagated (beyond its input)
    layer_kv=2.0,       # x T*KV*act: its key/value-sized ones
    layer_i=3.081,      # x T*I*act: its intermediate-sized ones, untiled (SwiGLU's gate and up, the product's grad)
    tiled_h=4.63,       # x T*H*act: with the tiled MLP instead: its saved input and the input grad it accumulates
    tile_i=0.175,       # x shard*I*act: one tiled-MLP shard recomputed and back-propagated
    nf4_i=0.894,        # x T*I*act: QLoRA, untiled: one more intermediate-sized tensor than 16-bit LoRA (measured, not traced)
    nf4_tiled_h=-1.436, # x T*H*act: QLoRA, tiled: hidden-sized difference to 16-bit LoRA (measured)
    qk_norm=1.0,        # x T*(Q+KV)*act: the query/key norms' tensors (Qwen3, OLMo2)
    fused_mlp=2.0,      # x T*I*act: a fused gate_up_proj's (Phi-3)
    packed_qkv=1.0,     # x T*(Q+KV)*act: packed, the query/key/value laid out token-major for the varlen kernel
    mask=4.519,         # bytes per element of the batch x seq x seq padding mask
    slack_gib=0.06,     # allocator: what a capped run cannot give back (partly used pages, the small-block pool); these three
                        # are what 32 of 32 capped runs completed under (docs/benchmarks.md: gpu_figure); a lower slack
                        # completed 18 of 18 but was never run on six rows it may be under
    slack=0.065,        # allocator: as a fraction of the allocation
    slack_nf4_gib=0.05,   # allocator: more with NF4 weights
    logits=14.07,       # bytes per logit element, plain cross-entropy (bf16 logits, fp32 upcast, fp32 grad; earlier grid)
    frag_logits=0.005,  # reserved - allocated, per plain-CE logit element (earlier grid)
    routed_i=12.0,      # x S*I_e*act, S = tokens x top-k routed slots: one MoE layer's expert tensors and grads in recompute +
    routed_h=12.0,      # x S*H*act  backward (gathered inputs, gate/up, products, outputs; counted from autograd's saved
                        # tensors on CPU, tiny Qwen3-MoE; not fitted on a GPU grid)
)


@dataclass
class Shapes:
    """What the estimate needs from config.json; `unknown` says what could not be read."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    experts: int = 1
    top_k: int = 1                    # experts each token is routed to
    unknown: list[str] = field(default_factory=list)
    arch: Architecture | None = None  # the model built on the meta device: its real modules, where transformers can build it

    @classmethod
    def of_run(cls, cfg: RunConfig) -> Shapes:
        """The run's base model, read from its config.json (a local directory or the HF cache), no weights."""
        from stages.model.directory import config_json, resolve_model_dir

        model_dir = resolve_model_dir(cfg.model.name_or_path)
        return cls.from_config(config_json(model_dir), cfg.model.trust_remote_code, str(model_dir))

    @classmethod
    def from_config(cls, cfg: dict, trust_remote_code: bool = False, model_dir: str | None = None) -> Shapes:
        """Reads Llama/Qwen/Mistral-style names, with GPT-style fallbacks; never raises on a missing key.
        The linear modules and parameter count come from the model built on the meta device where it builds."""
        arch = architecture.from_config(cfg, trust_remote_code, model_dir)
        cfg = cfg.get("text_config", cfg)
        unknown = []

        def get(*names, default=0):
            for n in names:
                if cfg.get(n) is not None:
                    return cfg[n]
            unknown.append(f"{names[0]} (config.json has none of {', '.join(names)})")
            return default

        hidden = get("hidden_size", "n_embd", "d_model")
        heads = get("num_attention_heads", "n_head", "num_heads", default=1)
        shapes = cls(
            vocab=get("vocab_size"), hidden=hidden, intermediate=get("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
            layers=get("num_hidden_layers", "n_layer", "num_layers"), heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or (hidden // heads if heads else 0),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            experts=_widest(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
                            or (cfg.get("ffn_config") or {}).get("moe_num_experts") or 1),
            top_k=_widest(cfg.get("num_experts_per_tok") or cfg.get("moe_topk") or cfg.get("top_k") or 1), unknown=unknown, arch=arch,
        )
        name = (cfg.get("architectures") or ["?"])[0]
        if arch is None:
            shapes.unknown.append(
                f"{name} (model_type {cfg.get('model_type')!r}) cannot be built here from config.json alone: its linear modules "
                "are assumed Llama-style (q/k/v/o, gate/up/down); trust the GPU probe over the estimate")
        if cfg.get("model_type") not in KNOWN_MODEL_TYPES:
            shapes.unknown.append(
                f"architecture {name} (model_type {cfg.get('model_type')!r}) is not one the estimate was calibrated on "
                f"({', '.join(sorted(KNOWN_MODEL_TYPES))}): weights are counted from its modules, activations assume a "
                "Llama-style decoder; trust the GPU probe over the estimate"
            )
        if shapes.experts > 1 and not shapes.stacks():
            shapes.unknown.append(f"{shapes.experts} experts: every expert's MLP weights are counted, activations as if dense")
        return shapes

    def linears(self) -> dict[str, Linear]:
        """Every adaptable linear module of the model by leaf name, each instance's (in, out) features: the built
        model's where it builds, else a Llama-style decoder's from config.json."""
        if self.arch is not None:
            return self.arch.linears
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        per_layer = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                     "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        mlp = {"gate_proj", "up_proj", "down_proj"}
        return {m: Linear(m, (io,) * self.layers * (self.experts if m in mlp else 1)) for m, io in per_layer.items()}

    def stacks(self) -> list:
        """The routed experts' fused stacks (stages.model.experts.structure.ExpertStack) of the model built on the meta device."""
        return self.arch.experts.stacks if self.arch is not None else []

    def targets(self, requested: list[str] | str) -> Targets:
        """lora.target_modules resolved against the model (fused projections mapped; unknown names refused)."""
        return architecture.resolve_targets(requested, self.arch or _llama_style(self))

    def other_params(self) -> int:
        """Parameters outside the linear modules, the input table and lm_head excluded (norms, biases, ...)."""
        if self.arch is not None:
            tables = self.vocab * self.hidden * (1 if self.tied else 2)
            return max(0, self.arch.total_params - self.arch.linear_params - tables)
        return (2 * self.layers + 1) * self.hidden


@dataclass
class Estimate:
    items_gib: dict[str, float]
    total_gib: float
    items_bytes: dict[str, float] = field(default_factory=dict, repr=False)


def estimate(cfg: RunConfig, s: Shapes, longest: int, on_gpu: bool, coef: dict | None = None,
             packed_tokens: int | None = None) -> Estimate:
    """Memory one optimizer step on the heaviest micro-batch needs: on a GPU, the smallest cap under
    which it runs (its peak allocated plus the allocator's slack; docs/benchmarks.md: gpu_figure).

    The heaviest micro-batch, for data whose longest sample has `longest` tokens: padded, the
    micro-batch padded to `longest`; packed, one row of `packed_tokens` (the run's heaviest planned
    micro-batch; None: the full token budget) (sample boundaries cost no memory with varlen or flex
    attention; a tokens x tokens mask with `mask`).

    Counted from what each piece of the training stage keeps, with the settings it resolves
    (`kernels.resolve_auto`: host embeddings, offloaded layer inputs, Liger kernels, 8-bit
    paged AdamW, the tiled MLP):
      persistent  base weights (16-bit, or NF4 + 16-bit embeddings/lm_head/norms for QLoRA;
                  the input table in host memory when untied and offloaded), fp32 adapters
                  and their grads, optimizer states as bitsandbytes places them (a paged
                  state lives in CUDA managed memory, outside torch's allocator), cuBLAS's
                  workspaces
      kept        what autograd holds between forward and backward: each checkpointed
                  layer's input (two of them on the GPU when offloaded: in use, prefetched),
                  or every layer's saved tensors without checkpointing
      peak moment the larger of
                  layer: one layer recomputed and back-propagated: its hidden-, KV- and
                  (untiled) intermediate-sized tensors and grads, one tile of the tiled MLP,
                  the dropout copy and mask of every adapted module's input, and for QLoRA
                  the largest weight dequantized for its input gradient
                  loss: the final hidden states and, chunked (Liger's fused linear
                  cross-entropy, or stages/train/chunked_loss.py on half its chunk),
                  one chunk of logits; plain, the whole tokens x vocab logits in 16 and 32 bits
      mask        the 4-D padding mask of a padded micro-batch (batch x seq x seq)
      allocator   the slack a capped run cannot give back (partly used pages, the small-block
                  pool); what an uncapped run reserves beyond that is returned under a cap
    Coefficients (COEF) are fitted to the measured grid (docs/benchmarks.md: gpu_figure), one per
    mechanism, not per shape.
    """
    step = _step(cfg, s, longest, on_gpu, COEF | (coef or {}), packed_tokens)
    weights = _base_weights(step)
    adapters = _adapters_and_optimizer_states(step)
    workspace = CUBLAS_WORKSPACE if on_gpu else 0
    kept = _kept_for_backward(step)
    phase, peak = _peak_moment(step)
    mask = _mask_and_attention_scores(step)
    overhead = _allocator_slack(step, weights + adapters + workspace + kept + peak + mask)
    items = {
        _weights_label(step): weights,
        _adapters_label(step): adapters,
        "cuBLAS workspaces": workspace,
        _kept_label(step): kept,
        _peak_label(step, phase): peak,
        "padding mask / attention scores": mask,
        "allocator overhead (reserved - allocated)": overhead,
    }
    gib = {key: round(v / GIB, 4) for key, v in items.items()}
    return Estimate(gib, round(sum(items.values()) / GIB, 4), items)


@dataclass(frozen=True)
class _Step:
    """One optimizer step as the estimate counts it: the config, the model's shapes, the settings the train
    stage resolves on this machine and the heaviest micro-batch (b rows of seq tokens)."""

    cfg: RunConfig
    s: Shapes
    k: dict                 # COEF with the caller's candidates (the grid's fit tries them)
    gpu: dict               # kernels.resolve_auto's settings
    on_gpu: bool
    act: int                # bytes per element of the compute dtype
    b: int
    seq: int
    targets: Targets
    matrices: list[int]     # the numel of every lora_A and lora_B
    loss: str               # kernels.cross_entropy: plain, chunked (Liger's) or chunked-torch (the project's)

    @property
    def tokens(self) -> int:
        return self.b * self.seq

    @property
    def chunked(self) -> bool:  # a chunked cross-entropy (Liger's or the project's), not the whole logits
        return self.loss != "plain"

    @property
    def kv(self) -> int:
        return self.s.kv_heads * self.s.head_dim

    @property
    def shards(self) -> int:  # distributed: fsdp shards the base, adapters and states over n processes; 1 otherwise
        return self.cfg.training.shards

    @property
    def fsdp(self) -> bool:
        return self.cfg.training.distributed == "fsdp"

    @property
    def nf4(self) -> bool:
        return self.cfg.quantization.load_in_4bit

    @property
    def nf4_experts(self) -> bool:  # QLoRA stores the routed experts in NF4 too (stages.model.experts.nf4), except sharded: FSDP keeps them 16-bit
        return self.nf4 and not self.fsdp

    @property
    def host_embeddings(self) -> bool:  # a table tied to lm_head stays on the GPU
        return self.gpu["offload_embeddings"] and not self.s.tied


def _step(cfg: RunConfig, s: Shapes, longest: int, on_gpu: bool, k: dict, packed_tokens: int | None) -> _Step:
    gpu = resolve_auto(cfg, on_gpu=on_gpu, longest=longest)  # the settings as the train stage resolves them there
    act = compute_dtype(cfg.model.torch_dtype, cuda=on_gpu).itemsize
    # packed: the run's heaviest planned micro-batch where the caller knows it (the preflight), else the widest the data can make
    b, seq = (1, packed_tokens or gpu["widest_micro_batch"]) if gpu["packing"] else (cfg.training.per_device_train_batch_size, longest)
    targets = s.targets(cfg.lora.target_modules)
    r = cfg.lora.r
    matrices = [n for m in targets.linears for a, o in m.shapes for n in (r * a, r * o)]
    matrices += [n for stack in targets.stacks for n in stack.lora_matrices(r)]
    return _Step(cfg, s, k, gpu, on_gpu, act, b, seq, targets, matrices, loss_mode(cfg, on_gpu))


def _base_weights(step: _Step) -> float:
    s, act, n = step.s, step.act, step.shards
    linear_params = sum(m.numel for m in s.linears().values())
    table = s.vocab * s.hidden
    stack_params = sum(stack.numel for stack in s.stacks())
    other_params = (0 if step.host_embeddings else table) + (0 if s.tied else table) + s.other_params() - stack_params
    double_quant = step.cfg.quantization.bnb_4bit_use_double_quant
    # NF4 with FSDP: the packed 4-bit data is sharded, its quantisation constants (absmax) stay whole on every process
    nf4_local = 0.5 / n + NF4_BYTES[double_quant] - 0.5
    linear_bytes = linear_params * (nf4_local if step.nf4 else act / n)
    return linear_bytes + stack_params * (NF4_BYTES[double_quant] if step.nf4_experts else act / n) \
        + other_params * act / n


def _adapters_and_optimizer_states(step: _Step) -> float:
    states = sum(_state_bytes(step.gpu["optim"], n, step.on_gpu) for n in step.matrices)
    return (sum(step.matrices) * 8 + states) / step.shards  # peft keeps adapters in fp32 (autocast_adapter_dtype): weight 4 + grad 4


def _kept_for_backward(step: _Step) -> float:
    s = step.s
    if step.cfg.training.gradient_checkpointing:  # each layer's input
        return (2 if step.gpu["offload_activations"] else s.layers) * step.tokens * s.hidden * step.act
    return s.layers * (_layer_tensors(step, step.k["layer_i"] * s.intermediate) + _dropout(step) + _routed(step))


def _layer_tensors(step: _Step, mlp: float) -> float:
    """A layer's hidden- and KV-sized tensors and grads in backward, and `mlp` per token for its MLP's."""
    k = step.k
    return step.tokens * step.act * (k["layer_h"] * step.s.hidden + k["layer_kv"] * step.kv + mlp)


def _dropout(step: _Step) -> float:
    """A copy + mask of each adapted module's input, one layer's worth."""
    targets = step.targets
    if step.cfg.lora.lora_dropout > 0 and not targets.stacks:  # peft has no dropout on experts: none anywhere then
        return step.tokens * sum(a for m in targets.linears for a, _ in m.shapes) / max(1, step.s.layers) * (step.act + 1)
    return 0


def _routed(step: _Step) -> float:
    # A MoE layer's routed tensors are [S, .] for S = tokens x top-k slots, whichever experts the router picks: a
    # trained router's imbalance moves rows between experts, not the total (the grouped path, stages.model.experts.lora)
    s, k, stacks = step.s, step.k, step.s.stacks()
    expert_i = max((stack.in_features for stack in stacks if stack.leaf == "down_proj"), default=0)
    return step.tokens * s.top_k * step.act * (k["routed_i"] * expert_i + k["routed_h"] * s.hidden) if stacks else 0.0


def _peak_moment(step: _Step) -> tuple[str, float]:
    """The larger of one layer's recompute + backward and the loss, each with the weights FSDP has gathered for it."""
    gathered_layer, gathered_tail, prefetched = _fsdp_gathered(step)
    # chunked: the lm_head stays gathered through the backward (sharding.gather_lm_head_for_fused_loss)
    layer_total = _layer_backward(step) + gathered_layer + prefetched + (gathered_tail if step.chunked else 0.0)
    loss_total = _loss(step) + gathered_tail + gathered_layer
    return ("loss", loss_total) if loss_total >= layer_total else ("layer recompute + backward", layer_total)


def _fsdp_gathered(step: _Step) -> tuple[float, float, float]:
    """FSDP2 all-gathers a layer's weights while it computes and prefetches the next unit's: a layer's, [final
    norm, lm_head], the prefetched unit's (all 0 unsharded)."""
    if not step.fsdp:
        return 0.0, 0.0, 0.0
    s, act = step.s, step.act
    layers = max(1, s.layers)
    linear_params = sum(m.numel for m in s.linears().values())
    table = s.vocab * s.hidden
    # (NF4 stored in the compute dtype: 0.5 byte per weight; LoRA and norms gathered in the compute dtype)
    gathered_layer = linear_params / layers * (0.5 if step.nf4 else act) + (2 * s.hidden + sum(step.matrices) / layers) * act
    gathered_tail = table * act + s.hidden * act  # [final norm, lm_head] stay whole from the forward's end into backward
    # the last unit back-propagated, the input table (untied), is prefetched during the first layer's backward
    prefetched = max(gathered_layer, 0.0 if s.tied else table * act)
    return gathered_layer, gathered_tail, prefetched


def _layer_backward(step: _Step) -> float:
    """One checkpointed layer recomputed and back-propagated (0 without checkpointing: `kept` holds every layer's)."""
    if not step.cfg.training.gradient_checkpointing:
        return 0.0
    s, k, act, tokens = step.s, step.k, step.act, step.tokens
    if step.gpu["tiled_mlp"]:  # Liger's TiledMLP: shards of ceil(seq / hidden) per row, recomputed one at a time in backward
        shard = step.b * math.ceil(step.seq / math.ceil(step.seq / s.hidden))
        layer = (_layer_tensors(step, (k["tiled_h"] + step.nf4 * k["nf4_tiled_h"]) * s.hidden)
                 + k["tile_i"] * shard * s.intermediate * act)
    else:
        layer = _layer_tensors(step, (k["layer_i"] + step.nf4 * k["nf4_i"]) * s.intermediate)
    layer += _dropout(step) + _architecture_tensors(step) + _routed(step)
    if step.gpu["packing"] and step.gpu["packed_attention"] == "varlen":
        layer += k["packed_qkv"] * tokens * act * (s.heads * s.head_dim + step.kv)
    if step.nf4:  # bitsandbytes dequantizes the weight to compute the input gradient (a whole stack for NF4 experts)
        layer += max([a * o for m in s.linears().values() for a, o in m.shapes]
                     + [stack.numel for stack in s.stacks() if step.nf4_experts]) * act
    return layer


def _architecture_tensors(step: _Step) -> float:
    s, k, act, tokens = step.s, step.k, step.act, step.tokens
    # normalised queries and keys (Qwen3, OLMo2): the norms' inputs and outputs, query- and key-sized
    extra = k["qk_norm"] * tokens * act * (s.heads * s.head_dim + step.kv) if s.arch is not None and s.arch.qk_norm else 0.0
    # a fused gate_up_proj (Phi-3) makes one tokens x 2I output and its grad, split into strided halves the kernel copies
    extra += k["fused_mlp"] * tokens * act * s.intermediate if "gate_up_proj" in s.linears() and not step.gpu["tiled_mlp"] else 0.0
    return extra


def _loss(step: _Step) -> float:
    s, act, tokens = step.s, step.act, step.tokens
    # Liger: chunks of next_pow2(tokens / ceil(vocab / hidden)) rows of logits, computed and consumed in turn; the
    # project's loss takes half that chunk (or more, chunked_loss.chunk_rows) at up to 6 bytes a logit
    if step.chunked:
        chunk = 1 << max(0, math.ceil(math.log2(math.ceil(tokens / math.ceil(s.vocab / s.hidden)))))
        logits = 2 * min(chunk, tokens) * s.vocab * act
        if step.loss == "chunked-torch":
            rows = chunked_loss.chunk_rows(tokens, s.vocab, s.hidden, step.gpu["loss_chunk_logits"])
            logits = max(logits, 6 * min(rows, tokens) * s.vocab)
        return LOSS_H * tokens * s.hidden * act + logits
    return LOSS_H * tokens * s.hidden * act + step.k["logits"] * tokens * s.vocab


def _mask_and_attention_scores(step: _Step) -> float:
    b, seq = step.b, step.seq
    # a padded micro-batch's padding mask; a packed one's block-diagonal mask (with `mask` attention)
    mask = step.k["mask"] * b * seq * seq if b > 1 or step.gpu["packed_attention"] == "mask" else 0.0
    eager = architecture.attention_implementation(step.cfg.model.attn_implementation, step.s.arch, step.on_gpu) == "eager"
    if eager:  # the seq x seq scores, per head, saved per layer
        mask += b * step.s.heads * seq * seq * step.act * (2 if step.cfg.training.gradient_checkpointing else 2 * step.s.layers)
    return mask


def _allocator_slack(step: _Step, allocated: float) -> float:
    # With expandable segments the allocator unmaps free pages inside its segment and maps them where a request
    # needs them once the process reaches its cap: the 4-21% more an uncapped run reserves is given back, and a
    # run capped a few % above its peak allocated completes (docs/benchmarks.md: gpu_figure). What stays is slack.
    # What a run capped at its peak allocated still lacks: the pages its live blocks leave partly used, more for
    # NF4's many small quantization-state blocks (0.04-0.29 GiB, 1.03-1.07x the allocation; docs/benchmarks.md: gpu_figure).
    if not step.on_gpu:
        return 0.0
    k = step.k
    return (k["slack_gib"] * GIB + k["slack"] * allocated + (k["slack_nf4_gib"] * GIB if step.nf4 else 0.0)
            + (0.0 if step.chunked else k["frag_logits"] * step.tokens * step.s.vocab))


def _shard_label(step: _Step) -> str:
    return f", this process's 1/{step.shards} shard" if step.fsdp else ""


def _weights_label(step: _Step) -> str:
    stacks = step.s.stacks()
    experts = ", experts NF4" if stacks and step.nf4_experts else ", experts 16-bit" if stacks else ""
    return ("base weights" + (" (NF4" + experts + " + 16-bit embeddings)" if step.nf4 else "") + _shard_label(step)
            + (", input embedding in host memory" if step.host_embeddings else ""))


def _adapters_label(step: _Step) -> str:
    paged = sum(_state_bytes(step.gpu["optim"], n, step.on_gpu, paged=True) for n in step.matrices)
    return (f"LoRA weights+grads+{step.gpu['optim']} states ({sum(step.matrices) / 1e6:.1f} M params{_shard_label(step)})"
            + (f"; {paged / GIB:.2f} GiB more states paged outside torch" if paged else ""))


def _kept_label(step: _Step) -> str:
    if not step.cfg.training.gradient_checkpointing:
        return "activations kept for backward (all layers)"
    return "activations kept for backward (layer inputs, checkpointed" + (", offloaded to host)" if step.gpu["offload_activations"] else ")")


def _peak_label(step: _Step, phase: str) -> str:
    return (f"peak moment: {phase}" + (" (chunked cross-entropy)" if step.chunked and phase == "loss" else "")
            + (" (tiled MLP)" if step.gpu["tiled_mlp"] and phase != "loss" else "")
            + (" + the layers (and lm_head) FSDP has gathered for it" if step.fsdp else ""))


def _llama_style(s: Shapes) -> Architecture:
    return Architecture("a Llama-style decoder", "?", s.linears(), 0, s.layers, False, s.tied)


def _state_bytes(optim: str, numel: int, on_gpu: bool, paged: bool = False) -> float:
    """Optimizer-state bytes of one adapter matrix in torch's allocator (or, paged=True, in managed memory).

    bitsandbytes keeps 8-bit states (2 x 1 byte + a 4-byte absmax per 256-block) for tensors of
    at least 4096 elements and 32-bit ones below; its paged variants put states of 1e5 elements
    and more in CUDA managed memory, which torch does not count and the driver can evict.
    """
    eight_bit = optim in ("paged_adamw_8bit", "adamw_8bit")
    in_managed = optim.startswith("paged_") and on_gpu and numel >= 1e5
    if paged:
        return (2 + 8 / 256 if eight_bit else 8) * numel if in_managed else 0.0
    if in_managed:
        return 0.0
    if eight_bit:
        return (2 + 8 / 256) * numel if numel >= 4096 else 8 * numel
    return OPTIM_BYTES[optim] * numel


def loss_mode(cfg: RunConfig, on_gpu: bool) -> str:
    """The loss the train stage computes there (kernels.cross_entropy): plain, chunked (Liger's) or chunked-torch."""
    try:
        return cross_entropy(cfg, on_gpu=on_gpu)
    except ConfigError:   # chunked asked where no chunked loss covers the model: the settings refuse it, with the fix
        return "plain"


def _widest(value) -> int:
    """A per-model setting some releases give per layer (Hunyuan-A13B's moe_topk): the largest."""
    return int(max(value) if isinstance(value, list | tuple) else value)
