"""Attention + routed-experts LoRA on MoE shapes, one H200, one process: plain peft 0.21 target_parameters
(its ParamWrapper forms W + B@A for every expert on each forward) against the train stage's grouped LoRA
(stages.model.experts.lora: the adapter applied to the tokens routed to each expert, three grouped matmuls).

Same model (random init from the family's published shapes, bf16, on the GPU), same adapter tensors (r 16,
alpha 32, no dropout: peft has none on experts), same 2 x 2048 random tokens per step, gradient
checkpointing, torch AdamW; peak reserved measured from a fresh peak and an emptied cache for each variant.
Before timing, one batch's loss and LoRA gradients are compared between the two.

    python bench/moe_speed/run.py --out $OUT/moe_speed.json [--shapes qwen3-30b-a3b olmoe-1b-7b] [--attention-only]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from stages.model import architecture  # noqa: E402
from stages.model.experts import lora as experts  # noqa: E402
from stages.model.experts import structure  # noqa: E402

# config.json shapes of the released models (num_hidden_layers etc. as published)
SHAPES = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960,
                          rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                        vocab_size=50304, max_position_embeddings=4096, rope_theta=1e4, tie_word_embeddings=False),
}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
H200_BF16_FLOPS = 989e12   # dense bf16 peak


def build(shape: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(shape)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model


def active_params(model, shape: dict) -> int:
    """Parameters one token meets: everything but the experts it is not routed to and the input table."""
    total = sum(p.numel() for p in model.parameters())
    stacks = structure.fused_experts(model).stacks
    expert = sum(s.numel for s in stacks)
    e, k = stacks[0].experts, shape["num_experts_per_tok"]
    return total - expert + expert * k // e - shape["vocab_size"] * shape["hidden_size"]


def step(model, opt, batch) -> float:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def timed(model, params, batches, warmup: int, steps: int) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    opt = torch.optim.AdamW(params, lr=1e-5)
    for b in batches[:warmup]:
        step(model, opt, b)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches[warmup:warmup + steps]:
        step(model, opt, b)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = {"tokens_per_s": round(steps * batches[0].numel() / dt, 1), "s_per_step": round(dt / steps, 4),
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
           "allocated_before_gib": round(base / 2**30, 3)}
    del opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def agreement(model, params, batch) -> dict:
    """One batch's loss and LoRA gradients, peft's path against the grouped one."""
    grads = {}
    for on in (False, True):
        experts.use_grouped_lora(model, on=on)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        grads[on] = (float(loss), torch.cat([p.grad.float().flatten() for p in params]))
        for p in params:
            p.grad = None
    (l0, g0), (l1, g1) = grads[False], grads[True]
    return {"loss_peft": l0, "loss_grouped": l1, "grad_cosine": round(float(torch.nn.functional.cosine_similarity(g0, g1, dim=0)), 6),
            "grad_rel_norm_diff": round(float((g0 - g1).norm() / g0.norm()), 6)}


def run_shape(name: str, shape: dict, args) -> dict:
    from peft import LoraConfig, get_peft_model

    model = build(shape)
    row = {"shape": name, "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3)}
    active = active_params(model, shape)
    row["active_params_b"] = round(active / 1e9, 3)
    targets = architecture.resolve_targets("all-linear", architecture.describe(model))
    row["adapted"] = targets.summary(args.r)
    model.config.use_cache = False
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    with structure.peft_targets_as_given():
        model = get_peft_model(model, LoraConfig(r=args.r, lora_alpha=2 * args.r, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=targets.modules, target_parameters=targets.parameters))
    params = [p for p in model.parameters() if p.requires_grad]
    row["lora_params_m"] = round(sum(p.numel() for p in params) / 1e6, 2)
    row["expert_lora_params_m"] = round(targets.expert_params(args.r) / 1e6, 2)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=g).cuda()
               for _ in range(args.warmup + args.steps)]
    row["agreement"] = agreement(model, params, batches[0])
    for variant, on in (("peft_target_parameters", False), ("grouped", True)):
        experts.use_grouped_lora(model, on=on)
        try:
            row[variant] = timed(model, params, batches, args.warmup, args.steps)
        except torch.OutOfMemoryError as e:
            row[variant] = {"oom": str(e)[:300]}
            gc.collect()
            torch.cuda.empty_cache()
        print(name, variant, row[variant], flush=True)
    a, b = row["peft_target_parameters"], row["grouped"]
    if "tokens_per_s" in a and "tokens_per_s" in b:
        weights = a["allocated_before_gib"]
        row["speedup"] = round(b["tokens_per_s"] / a["tokens_per_s"], 3)
        row["reserved_ratio"] = round(b["peak_reserved_gib"] / a["peak_reserved_gib"], 3)
        row["above_weights_ratio"] = round((b["peak_reserved_gib"] - weights) / (a["peak_reserved_gib"] - weights), 3)
        for v in (a, b):  # model FLOPs (6 x active parameters per token) per second over the card's bf16 peak
            v["mfu_active"] = round(6 * active * v["tokens_per_s"] / H200_BF16_FLOPS, 4)
    del model, params
    gc.collect()
    torch.cuda.empty_cache()
    if args.attention_only:  # the ceiling for any change to the experts' LoRA: the experts not adapted at all
        model = build(shape)
        model.config.use_cache = False
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=args.r, lora_alpha=2 * args.r, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=ATTENTION))
        params = [p for p in model.parameters() if p.requires_grad]
        row["attention_only"] = timed(model, params, batches, args.warmup, args.steps)
        row["attention_only"]["mfu_active"] = round(6 * active * row["attention_only"]["tokens_per_s"] / H200_BF16_FLOPS, 4)
        print(name, "attention_only", row["attention_only"], flush=True)
        del model, params
    del batches
    gc.collect()
    torch.cuda.empty_cache()
    return row


def timing_arguments(shapes: list[str], steps: int) -> argparse.ArgumentParser:
    """The options every MoE timing bench takes (this one and bench/moe_qlora): output, shapes, rank, tokens, steps."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=shapes)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=steps)
    return ap


def main() -> None:
    ap = timing_arguments(list(SHAPES), steps=6)
    ap.add_argument("--attention-only", action="store_true", help="also time attention-only LoRA (experts frozen)")
    args = ap.parse_args()
    import peft
    import transformers

    out = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__, "peft": peft.__version__, "settings": vars(args), "rows": []}
    for name in args.shapes:
        out["rows"].append(run_shape(name, SHAPES[name], args))
        Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
