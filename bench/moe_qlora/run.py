"""QLoRA on a MoE with the routed experts in NF4 (stages.model.experts.nf4), against 16-bit LoRA, one H200, one process.

One model at a released model's shapes (random init, bf16, on the GPU) is timed three ways on the same 2 x 2048
random-token steps, attention + every routed expert adapted (r 16, alpha 32, no dropout), gradient checkpointing,
Liger's fused linear cross-entropy (the train stage's default on a GPU) in all three:
  peft      bf16 base, plain peft 0.21 target_parameters (its ParamWrapper forms W + B@A per expert), torch AdamW
  grouped   bf16 base, the train stage's grouped expert LoRA (stages.model.experts.lora), torch AdamW
  qlora     the same base quantized in place to NF4 (nn.Linear -> bitsandbytes Linear4bit, every expert stack -> NF4
            as stages.model.experts.nf4 stores it at load), grouped expert LoRA over the NF4 stacks, and the optimizer the
            train stage picks for QLoRA on a GPU (8-bit paged AdamW; its states live outside torch's allocator and
            are reported apart); qlora_adamw: the same with torch AdamW
Peak reserved is measured from a fresh peak and an emptied cache per variant. A second part loads a small MoE
checkpoint written to disk through stages.model.load.load_base (QLoRA), to measure the load's own peak.

    python bench/moe_qlora/run.py --out $OUT/moe_qlora.json [--shapes qwen3-30b-a3b]
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from stages.model import architecture  # noqa: E402
from stages.model.experts import lora as expert_lora  # noqa: E402
from stages.model.experts import nf4 as expert_nf4  # noqa: E402
from stages.model.experts import structure  # noqa: E402


def _moe_speed():
    """bench/moe_speed/run.py: the shapes, the model build, the step, the FLOPs count and the options this compares on."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe_speed_run", Path(__file__).resolve().parents[1] / "moe_speed" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_speed = _moe_speed()
H200_BF16_FLOPS, SHAPES, active_params, build, step = _speed.H200_BF16_FLOPS, _speed.SHAPES, _speed.active_params, _speed.build, _speed.step

GIB = 2**30


def quantize_in_place(model, device: str = "cuda", compute_dtype=torch.bfloat16) -> None:
    """What stages.model.load.load_base makes of a checkpoint under QLoRA, made from a model already on `device`:
    every nn.Linear but lm_head a Linear4bit (NF4, double quant, `compute_dtype` compute), every fused expert stack NF4."""
    import bitsandbytes as bnb

    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child_name != "lm_head":
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                        compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4", device="meta")
                new.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, blocksize=64, compress_statistics=True,
                                               quant_type="nf4")._quantize(device)
                if child.bias is not None:
                    new.bias = child.bias
                setattr(module, child_name, new)
                del child
    for s in structure.fused_experts(model).stacks:
        module_name, _, leaf = s.name.rpartition(".")
        module = model.get_submodule(module_name)
        p = getattr(module, leaf)
        setattr(module, leaf, bnb.nn.Params4bit(p.data, requires_grad=False, blocksize=expert_nf4.BLOCKSIZE,
                                                compress_statistics=True, quant_type="nf4")._quantize(device))
        del p
    model.is_loaded_in_4bit = True
    expert_nf4.show_shapes(model)
    expert_lora.use_nf4_stacks(model)
    gc.collect()
    torch.cuda.empty_cache()


def liger(model) -> bool:
    try:
        from stages.train import kernels
        kernels.use_liger(model, loss=True, kernels=True)
    except Exception as e:  # noqa: BLE001  (the bench reports it and goes on with the stock loss)
        print("liger:", repr(e)[:300], flush=True)
        return False
    expert_lora.use_nf4_stacks(model)   # as stages.train.model does after Liger
    return True


def adapt(model, r: int):
    from peft import LoraConfig, get_peft_model

    targets = architecture.resolve_targets("all-linear", architecture.describe(model))
    model.config.use_cache = False
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    with structure.peft_targets_as_given():
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=targets.modules, target_parameters=targets.parameters))
    return model, targets


def timed(model, params, batches, warmup: int, steps: int, optim: str) -> dict:
    import bitsandbytes as bnb

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    opt = bnb.optim.PagedAdamW8bit(params, lr=1e-5) if optim == "paged_adamw_8bit" else torch.optim.AdamW(params, lr=1e-5)
    losses = [step(model, opt, b) for b in batches[:warmup]]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    losses += [step(model, opt, b) for b in batches[warmup:warmup + steps]]
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = {"optim": optim, "tokens_per_s": round(steps * batches[0].numel() / dt, 1), "s_per_step": round(dt / steps, 4),
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
           "allocated_before_gib": round(base / GIB, 3), "losses": [round(x, 4) for x in losses]}
    if optim == "paged_adamw_8bit":   # paged states: CUDA managed memory, outside torch's allocator
        out["paged_states_gib"] = round(sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                                            if torch.is_tensor(v)) / GIB, 3)
    del opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def run_shape(name: str, shape: dict, args, batches) -> dict:
    model = build(shape)
    row = {"shape": name, "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3)}
    active = active_params(model, shape)
    row["liger"] = liger(model)
    model, targets = adapt(model, args.r)
    row["adapted"] = targets.summary(args.r)
    params = [p for p in model.parameters() if p.requires_grad]
    row["lora_params_m"] = round(sum(p.numel() for p in params) / 1e6, 2)
    for variant, on in (("peft", False), ("grouped", True)):
        expert_lora.use_grouped_lora(model, on=on)
        try:
            row[variant] = timed(model, params, batches, args.warmup, args.steps, "adamw_torch")
        except Exception as e:  # noqa: BLE001  (an OOM or a kernel's refusal: recorded, the next variant runs)
            row[variant] = {"error": repr(e)[:400]}
        print(name, variant, row[variant], flush=True)
        Path(args.out + ".partial").write_text(json.dumps(row, indent=2))
    del model, params
    gc.collect()
    torch.cuda.empty_cache()
    base = build(shape)   # the same random init (seeded), quantized in place
    quantize_in_place(base)
    row["nf4_weights_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
    row["nf4_stacks"] = sum(map(len, expert_nf4.stacks(base).values()))
    liger(base)
    model, _ = adapt(base, args.r)
    assert expert_lora.use_grouped_lora(model) > 0
    params = [p for p in model.parameters() if p.requires_grad]
    for variant, optim in (("qlora", "paged_adamw_8bit"), ("qlora_adamw", "adamw_torch")):
        try:
            row[variant] = timed(model, params, batches, args.warmup, args.steps, optim)
        except Exception as e:  # noqa: BLE001
            row[variant] = {"error": repr(e)[:400]}
        print(name, variant, row[variant], flush=True)
    for v in ("peft", "grouped", "qlora", "qlora_adamw"):
        if "tokens_per_s" in row[v]:
            row[v]["mfu_active"] = round(6 * active * row[v]["tokens_per_s"] / H200_BF16_FLOPS, 4)
    a = row["peft"]
    for v in ("grouped", "qlora", "qlora_adamw"):
        if "tokens_per_s" in a and "tokens_per_s" in row[v]:
            row[f"{v}_vs_peft"] = {"speed": round(row[v]["tokens_per_s"] / a["tokens_per_s"], 3),
                                   "peak_reserved": round(row[v]["peak_reserved_gib"] / a["peak_reserved_gib"], 3)}
    del model, params, base
    gc.collect()
    torch.cuda.empty_cache()
    return row


def load_peak(args) -> dict:
    """A small MoE checkpoint on disk, loaded QLoRA through stages.model.load.load_base: the load's peak against the
    NF4 model it leaves, and against the same checkpoint's 16-bit size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.config import ModelSection, QuantizationSection
    from stages.model.load import load_base

    spec = dict(SHAPES["qwen3-30b-a3b"], num_hidden_layers=args.load_layers)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    bf16_gib = sum(p.numel() * p.element_size() for p in m.parameters()) / GIB
    path = Path(args.work) / "qwen3-moe-load"
    m.save_pretrained(path, max_shard_size="2GB")
    del m
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = load_base(ModelSection(name_or_path=str(path), torch_dtype="bfloat16"), QuantizationSection(load_in_4bit=True))
    out = {"layers": args.load_layers, "checkpoint_bf16_gib": round(bf16_gib, 3), "load_s": round(time.perf_counter() - t0, 1),
           "load_peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
           "load_peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
           "loaded_allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3),
           "nf4_stacks": sum(map(len, expert_nf4.stacks(model).values())),
           "stacks": len(structure.fused_experts(model).stacks)}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = _speed.timing_arguments(["qwen3-30b-a3b"], steps=5)
    ap.add_argument("--load-layers", type=int, default=8)
    ap.add_argument("--work", default="/tmp/moe-qlora")
    args = ap.parse_args()
    import bitsandbytes
    import peft
    import transformers

    out = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__, "peft": peft.__version__, "bitsandbytes": bitsandbytes.__version__,
           "settings": vars(args), "rows": []}
    try:
        out["load"] = load_peak(args)
    except Exception as e:  # noqa: BLE001  (reported; the training rows still run)
        out["load"] = {"error": repr(e)[:600]}
    print("load", out["load"], flush=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    for name in args.shapes:
        shape = SHAPES[name]
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=g).cuda()
                   for _ in range(args.warmup + args.steps)]
        out["rows"].append(run_shape(name, shape, args, batches))
        Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
