"""Where a MoE training step spends its GPU time: Qwen3-30B-A3B shapes, attention + every expert adapted (r 16),
2 x 2048 random tokens, gradient checkpointing, Liger's kernels and fused loss, the grouped expert LoRA
(stages.model.experts.lora), on the bf16 base and on the NF4 base QLoRA stores (bench/moe_qlora's quantize_in_place).

Per variant: tokens/s over timed steps, then torch.profiler over two steps: the kernels by GPU time, grouped
into kinds (expert matmuls, dequantization, attention, routing and index ops, ...), and the GPU's busy share
of the wall time (kernel time summed over the step's wall time: below 1 the host or a sync holds it).

    python bench/moe_profile/run.py --out $OUT/moe_profile.json [--variants peft bf16 nf4] [--profile bf16 nf4]
    python bench/moe_profile/run.py merge $OUT/moe_profile.json $OUT/peft.json $OUT/nf4.json ...

Variants (VARIANTS): plain peft target_parameters (the issue's baseline), the grouped path on the bf16 base and on
the NF4 base, and each with one of this bench's changes undone (the offsets through torch.bincount; NF4 stacks
dequantized three times per checkpointed step), so before and after come from the same call.
"""

from __future__ import annotations

import gc
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import importlib.util  # noqa: E402

from stages.model.experts import lora as expert_lora  # noqa: E402


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_run", Path(__file__).resolve().parents[1] / name / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_speed, _qlora = _load("moe_speed"), _load("moe_qlora")
_spec = importlib.util.spec_from_file_location("moe_compiled", Path(__file__).resolve().parent / "compiled.py")
_compiled = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_compiled)

KINDS = [  # first match wins: kernel-name patterns by what they do
    ("dequantize", r"dequant|kDequant"),
    ("optimizer", r"adam|multi_tensor|foreach|optimizer"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("compiled", r"^triton_(poi|per|red|tem)_"),   # inductor's fused kernels (the compiled routed math)
    ("liger", r"liger|_rms_norm|swiglu|rope|cross_entropy|_ce_|triton"),
    ("sort/route", r"sort|radix|topk|bincount|histogram|cumsum|scan"),
    ("index/gather/scatter", r"index|gather|scatter|embedding"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|sm90|sm100|wgmma|grouped|cublas"),
    ("copy", r"copy|memcpy|memset|cat|CatArray"),
    ("reduce", r"reduce|sum|norm"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
]


def kind(name: str) -> str:
    for k, pat in KINDS:
        if re.search(pat, name, re.I):
            return k
    return "other"


def profile(model, opt, batches, steps: int) -> dict:
    def run():
        for b in batches[:steps]:
            _speed.step(model, opt, b)

    return profiled(run, steps)


def profiled(run, steps: int = 1) -> dict:
    """`run()` (`steps` steps) under torch.profiler: the kernels by GPU time and kind, the GPU's busy share of the
    wall time, the host's top ops; per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        run()
        torch.cuda.synchronize()
    return summary(p, time.perf_counter() - t0, steps)


def summary(p, wall_s: float, steps: int) -> dict:
    """A finished torch.profiler run of `steps` steps over `wall_s` seconds, per step."""
    wall = wall_s / steps
    kernels: dict[str, list] = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time / 1e3   # ms
    total = sum(v[1] for v in kernels.values()) / steps
    kinds: dict[str, float] = {}
    for n, (_c, ms) in kernels.items():
        kinds[kind(n)] = kinds.get(kind(n), 0.0) + ms / steps
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:30]
    host = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:30]
    return {"wall_ms_per_step_profiled": round(wall * 1e3, 1), "kernel_ms_per_step": round(total, 1),
            "gpu_busy": round(total / (wall * 1e3), 3),
            "kernels_per_step": sum(v[0] for v in kernels.values()) // steps,
            "kinds_ms_per_step": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "host_top": [{"op": e.key[:120], "calls": e.count // steps, "self_cpu_ms": round(e.self_cpu_time_total / 1e3 / steps, 2)}
                         for e in host],
            "top": [{"kernel": n[:160], "kind": kind(n), "calls": c // steps, "ms": round(ms / steps, 2)} for n, (c, ms) in top]}


def _bincount_offsets(groups, experts: int):
    # the offsets as stages.model.experts.lora computed them before: torch.bincount, which syncs with the host on CUDA
    return torch.bincount(groups, minlength=experts).cumsum(0).to(torch.int32)


# name: (base, Liger, grouped expert LoRA, optimizer, what is put back as it was before this bench's changes)
VARIANTS = {
    "peft": ("bf16", False, False, "adamw_torch", {}),   # the baseline: plain peft target_parameters
    "bf16-bincount": ("bf16", True, True, "adamw_torch", {"offsets": _bincount_offsets}),
    "bf16": ("bf16", True, True, "adamw_torch", {}),
    "nf4-dequant3": ("nf4", True, True, "paged_adamw_8bit", {"_recomputing": lambda: False}),
    "nf4": ("nf4", True, True, "paged_adamw_8bit", {}),
    # trials of levers the product does not use yet (bench/moe_profile/compiled.py; HF's per-layer checkpoint flag)
    "bf16-compiled": ("bf16", True, True, "adamw_torch", {"compiled": True}),
    "nf4-compiled": ("nf4", True, True, "paged_adamw_8bit", {"compiled": True}),
    "nf4-ckpt2of3": ("nf4", True, True, "paged_adamw_8bit", {"checkpoint_every": 3}),
}


def variant(name: str, args, batches) -> dict:
    base, use_liger, grouped, optim, patches = VARIANTS[name]
    patches = dict(patches)
    compiled, every = patches.pop("compiled", False), patches.pop("checkpoint_every", 0)
    saved = {k: getattr(expert_lora, k) for k in patches}
    for k, v in patches.items():
        setattr(expert_lora, k, v)
    if compiled:
        saved["grouped_lora_forward"] = _compiled.use()
    try:
        shape = _speed.SHAPES["qwen3-30b-a3b"]
        model = _speed.build(shape)
        active = _speed.active_params(model, shape)
        if base == "nf4":
            _qlora.quantize_in_place(model)
        row = {"variant": name, "base": base, "grouped": grouped, "optim": optim,
               "liger": _qlora.liger(model) if use_liger else False, "restored": sorted(patches)}
        model, _ = _qlora.adapt(model, args.r)
        if every:   # checkpoint 2 layers of every `every`: the others keep their activations and skip the recompute
            layers = model.base_model.model.model.layers
            for i, layer in enumerate(layers):
                layer.gradient_checkpointing = i % every != every - 1
            row["checkpointed_layers"] = sum(bool(layer.gradient_checkpointing) for layer in layers)
        if grouped:
            assert expert_lora.use_grouped_lora(model) > 0
        params = [p for p in model.parameters() if p.requires_grad]
        row["timed"] = _qlora.timed(model, params, batches, args.warmup, args.steps, optim)
        row["timed"]["mfu_active"] = round(6 * active * row["timed"]["tokens_per_s"] / _speed.H200_BF16_FLOPS, 4)
        print(name, row["timed"], flush=True)
        if name in args.profile:
            opt = torch.optim.AdamW(params, lr=1e-5)
            _speed.step(model, opt, batches[0])
            row["profile"] = profile(model, opt, batches[1:], 2)
            print(name, json.dumps(row["profile"], indent=1), flush=True)
            del opt
    finally:
        for k, v in saved.items():
            setattr(expert_lora, k, v)
    del model, params
    gc.collect()
    torch.cuda.empty_cache()
    return row


def ratios(out: dict) -> None:
    """The issue's goal against the baseline measured in the same call: each variant's tokens/s and peak reserved
    over plain peft's."""
    tps = {r["variant"]: r["timed"]["tokens_per_s"] for r in out["rows"]}
    mem = {r["variant"]: r["timed"]["peak_reserved_gib"] for r in out["rows"]}
    if "peft" in tps:
        out["vs_peft"] = {k: {"speedup": round(t / tps["peft"], 3), "reserved_ratio": round(mem[k] / mem["peft"], 3)}
                          for k, t in tps.items()}


def merge(files: list[str], dest: str) -> None:
    """One JSON of the variants run in their own processes (session.sh: a fresh process per variant, so none is
    timed after another's models and compiled graphs were built and dropped in the same process)."""
    runs = [json.loads(Path(f).read_text()) for f in files if Path(f).is_file()]
    out = {k: v for k, v in runs[0].items() if k not in ("rows", "errors", "vs_peft")} | {"processes": len(runs), "rows": []}
    for run in runs:
        out["rows"] += run["rows"]
        out.setdefault("errors", {}).update(run.get("errors", {}))
    ratios(out)
    Path(dest).write_text(json.dumps(out, indent=2))
    print(json.dumps(out.get("vs_peft"), indent=1))


def main() -> None:
    if sys.argv[1:2] == ["merge"]:
        return merge(sys.argv[3:], sys.argv[2])
    ap = _speed.timing_arguments(["qwen3-30b-a3b"], steps=4)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--profile", nargs="*", default=["bf16", "nf4"], help="the variants also profiled")
    args = ap.parse_args()
    out = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "settings": vars(args), "rows": []}
    shape = _speed.SHAPES["qwen3-30b-a3b"]
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=g).cuda()
               for _ in range(args.warmup + args.steps)]
    for v in args.variants:
        try:
            out["rows"].append(variant(v, args, batches))
        except Exception as e:  # noqa: BLE001  (a trial that fails is recorded and the next one runs)
            import traceback
            out.setdefault("errors", {})[v] = traceback.format_exc()[-3000:]
            print(v, "failed:", repr(e)[:500], flush=True)
        gc.collect()   # after the except block: the traceback held the failed variant's model
        torch.cuda.empty_cache()
        if v not in {r["variant"] for r in out["rows"]}:
            continue
        ratios(out)
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
