"""FSDP2 (`training.distributed: fsdp`): how the train stage's processes shard one model.

accelerate does the sharding, as the HF Trainer drives it: `fully_shard` on every decoder
layer, the input embedding and the [final norm, lm_head] tail, bf16 mixed precision on a
GPU, sharded (DCP) checkpoints that resume on the same number of processes. This module
holds what the stage adds around it:

- the Trainer's FSDP settings (`trainer_args`), with the stage's own checkpointing (the
  Trainer's is off: stages/train/model.py sets it up in the order that works);
- the base loaded into host memory, never whole onto a GPU: each process then moves only
  its shard, so a model larger than one GPU loads (stages.model.load.load_base(sharded=True)); QLoRA keeps its NF4
  weights in the compute dtype (`bnb_4bit_quant_storage`), which FSDP can flatten;
- the same FSDP path on CPU (gloo): accelerate 1.15 turns FSDP on only for GPU-like
  backends and would silently run a multi-CPU job as DDP (`enable_on_cpu`), so the CPU
  test runs the code the GPUs run;
- the adapter gathered from its shards and written once (`adapter_state_dict`), and each
  process's peak memory collected for the report (`per_rank_memory`).
"""

from __future__ import annotations

import os

import torch

from stages.config import RunConfig
from stages.model.architecture import decoder_layers


def active(cfg: RunConfig) -> bool:
    """FSDP applies: distributed: fsdp, inside a process the launcher started (not merge, not the preflight)."""
    return cfg.training.distributed == "fsdp" and "LOCAL_RANK" in os.environ


def trainer_args(cfg: RunConfig, model) -> dict:
    """TrainingArguments for FSDP2 through accelerate; {} when it does not apply."""
    if not active(cfg):
        return {}
    layers = {type(m).__name__ for m in decoder_layers(model)}
    return {"fsdp": True, "fsdp_config": {
        "version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": sorted(layers),
        "reshard_after_forward": True,        # ZeRO-3: a layer's full weights exist only while it computes
        "state_dict_type": "SHARDED_STATE_DICT",  # each process writes its shard: no full model in one host's memory
        "cpu_ram_efficient_loading": False,   # every process reads the base (into host memory, see load_on_host)
        "activation_checkpointing": False,    # the stage's own (non-reentrant, per layer), set in build_model
    }}


def enable_on_cpu(trainer) -> None:
    """On CPU (gloo), switch accelerate's state to the FSDP it builds on GPUs.

    accelerate 1.15 keeps the FSDP plugin only for GPU-like distributed types; for MULTI_CPU
    it drops it and the Trainer wraps DDP instead, with no warning. FSDP2 itself runs on CPU
    with gloo, so the stage sets the state accelerate would have set.
    """
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if trainer.args.fsdp and not trainer.is_fsdp_enabled and state.distributed_type == DistributedType.MULTI_CPU:
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
        state.distributed_type = DistributedType.FSDP
        trainer.is_fsdp_enabled = True


def agree_on_best_checkpoint(trainer) -> None:
    """After a sharded checkpoint is saved: every process names the same best checkpoint.

    transformers 5.17 looks for the best checkpoint's directory before a sharded (DCP) save has
    created it, so whether a process records it depends on timing: measured, process 0 never
    did, skipped loading the best model at the end while process 1 waited for it in a
    collective (a hang), and its trainer_state.json named no best checkpoint to resume with.
    """
    from pathlib import Path

    state = trainer.state
    if not state.best_global_step:
        return
    best = Path(trainer.args.output_dir) / f"checkpoint-{state.best_global_step}"
    if best.is_dir() and state.best_model_checkpoint != str(best):
        state.best_model_checkpoint = str(best)
        if trainer.args.should_save:  # the state file of the checkpoint just written, replaced whole
            path = Path(trainer.args.output_dir) / f"checkpoint-{state.global_step}" / "trainer_state.json"
            tmp = path.with_suffix(".json.tmp")
            state.save_to_json(str(tmp))
            tmp.replace(path)


def gather_lm_head_for_fused_loss(model) -> None:
    """Liger's fused linear cross-entropy reads lm_head.weight inside the model's forward without calling
    lm_head, so FSDP's hooks never gather it and the loss gets a shard (measured: "aten.mm.out got mixed
    torch.Tensor and DTensor"). The lm_head's unit is gathered when the decoder returns its hidden
    states, and let go when the next micro-batch's forward begins: it is whole through one backward.
    """
    from torch.distributed.fsdp import FSDPModule

    def owners():
        heads = (model.get_output_embeddings(), model.get_input_embeddings())  # tied: one unit holds both
        return [m for m in heads if isinstance(m, FSDPModule)]

    def gather(module, args, output):
        for m in owners():
            m.unshard()

    def release(module, args):
        for m in owners():
            m.reshard()

    decoder = model.get_decoder()
    decoder.register_forward_hook(gather)
    decoder.register_forward_pre_hook(release)


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def adapter_state_dict(model) -> dict[str, torch.Tensor] | None:
    """The trainable (LoRA) tensors, whole, on CPU, in process 0; None in the others.

    Every process must call it: each all-gathers one tensor at a time, so only the adapter is
    ever whole in one place, never the base.
    """
    from torch.distributed.tensor import DTensor

    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if rank0:
                out[name] = full.to("cpu", copy=True)
    return out if rank0 else None


def from_process_zero(obj):
    """Process 0's `obj` in every process (pickled through the process group); `obj` itself without one.
    Every process must call it."""
    if not torch.distributed.is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def per_rank_memory() -> list[dict] | None:
    """Each process's peak memory this stage (GPU: torch's peak allocated and reserved; CPU: peak RSS),
    in process 0; None elsewhere. Every process must call it."""
    from stages import memory

    if torch.cuda.is_available():
        mine = {"peak_alloc_gib": round(torch.cuda.max_memory_allocated() / memory.GIB, 4),
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / memory.GIB, 4)}
    else:
        mine = {"peak_rss_gib": round(memory.peak_rss_gib(), 4)}
    if not torch.distributed.is_initialized():
        return [{"rank": 0} | mine]
    rows = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rows, {"rank": torch.distributed.get_rank()} | mine)
    return rows if torch.distributed.get_rank() == 0 else None
