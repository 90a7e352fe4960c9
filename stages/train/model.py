"""The model training trains: frozen base (16-bit or NF4) + LoRA adapter, in train mode, with
checkpointing, kernels and offloads set up in the order that works. Training and the
preflight's probe build it here, the same way."""

from __future__ import annotations

from stages.config import RunConfig
from stages.model import architecture
from stages.model.experts import lora as expert_lora
from stages.model.experts import structure
from stages.model.load import device, load_base
from stages.train import chunked_loss, fused_lora, kernels, sharding
from stages.train.attention import avoid_cudnn_sdpa, use_packed_attention
from stages.train.offload import embeddings_to_host


def build_model(cfg: RunConfig, longest: int | None = None, settings: kernels.Settings | None = None):
    """Frozen base + LoRA adapter, in train mode, checkpointing set up the way that works.

    Args:
        longest: the data's longest sample (sizes the widest micro-batch, which decides the tiled
            MLP); None assumes data.max_length.
        settings: the run's resolved settings (kernels.settings); None resolves them here.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed

    arch = architecture.of_model(cfg.model)
    targets = architecture.resolve_targets(cfg.lora.target_modules, arch) if arch else None  # before any weights load
    model = load_base(cfg.model, cfg.quantization, sharded=sharding.active(cfg))
    if targets is None:  # a model transformers could not build on the meta device: its loaded modules decide
        targets = architecture.resolve_targets(cfg.lora.target_modules, architecture.describe(model))
    lora = architecture.lora_kwargs(cfg.lora, targets, arch.model_class if arch else "this model")
    for note in targets.notes + architecture.dropout_note(cfg.lora, lora):
        print(f"train: {note}")
    avoid_cudnn_sdpa()
    s = settings or kernels.settings(cfg, longest)
    if s.packing:
        use_packed_attention(model, s.packed_attention)
    kernels.use_liger(model, loss=s.cross_entropy == "chunked", kernels=s.fused_kernels,
                      forced=cfg.training.cross_entropy == "chunked" or cfg.training.fused_kernels == "on")
    if s.cross_entropy == "chunked-torch":
        chunked_loss.use(model, s.loss_chunk_logits)
        print("train: loss: the project's chunked cross-entropy (no tokens x vocab logits; Liger's fused one is not "
              "there for this family or machine)")
    expert_lora.use_nf4_stacks(model)   # Liger binds its fused MoE forward to the experts, which reads 16-bit stacks only
    if sharding.active(cfg) and s.cross_entropy == "chunked":
        sharding.gather_lm_head_for_fused_loss(model)
    if s.tiled_mlp:
        kernels.tile_mlp(model)
    if s.offload_embeddings:
        embeddings_to_host(model)
    model.config.use_cache = False  # the KV cache is useless in training and costs memory
    model.train()  # from_pretrained returns eval mode; checkpointing is a no-op there
    if cfg.training.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    # The adapter's random init draws from the global RNG: seed it here, not only in the
    # Trainer (created later), or two runs of one config start from different adapters.
    set_seed(cfg.training.seed)
    with structure.peft_targets_as_given():
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    if targets.stacks and expert_lora.use_grouped_lora(model):
        print("train: LoRA on the routed experts computed on the tokens routed to each expert (grouped matmuls)")
    check_only_lora_trains(model)
    check_adapted(model, targets, cfg.lora.r)
    keep_adapter_inputs_16bit(model)
    if s.fused_lora and (n := fused_lora.use(model)):
        print(f"train: {n} adapted linear layers compute the adapter inside the base matmul (stages/train/fused_lora.py)")
    return model


def keep_adapter_inputs_16bit(model) -> None:
    """peft casts each adapted module's 16-bit input to its fp32 adapter's dtype before the dropout: a 4-byte copy,
    and an fp32 dropout output, of every adapted input, although autocast casts them back to 16 bits for the
    matmul. On down_proj's tokens x intermediate input that was 0.5 GiB of a 5.2 GiB peak (SmolLM2-1.7B shapes,
    bf16, 2 x 4096; docs/benchmarks.md: gpu_figure). Training always runs under autocast (the Trainer, eval, the probe), so
    the adapter gets the same 16-bit operands without the copies."""
    from peft.tuners.lora import LoraLayer

    if device().type != "cuda":
        return
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.cast_input_dtype_enabled = False


def check_adapted(model, targets: architecture.Targets, r: int) -> None:
    """The adapter holds what the estimate counted: every resolved module, r x (in + out) each."""
    trainable = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
    if trainable != targets.params(r):
        raise RuntimeError(f"the adapter has {trainable} parameters where {targets.summary(r)} were resolved; "
                           "peft adapted other modules than the preflight counted")


def checkpoint_only(model, n: int) -> None:
    """Checkpoint the first `n` decoder layers, keep the activations of the others (faster)."""
    for i, layer in enumerate(architecture.decoder_layers(model)):
        layer.gradient_checkpointing = i < n


def checkpointed_layers(model) -> tuple[int, int]:
    """(checkpointed, total) decoder layers."""
    layers = architecture.decoder_layers(model)
    return sum(bool(m.gradient_checkpointing) for m in layers), len(layers)


def check_only_lora_trains(model) -> None:
    """Frozen means frozen: a base weight with requires_grad would add grads and optimizer state."""
    leaked = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    if leaked:
        raise RuntimeError(f"{len(leaked)} non-LoRA parameters require grad (e.g. {leaked[:3]}); only adapters may train")
