"""Where a MoE training step spends its GPU time: Qwen3-30B-A3B shapes, attention + every expert adapted (r 16),
2 x 2048 random tokens, gradient checkpointing, Liger's kernels and fused loss, the grouped expert LoRA
(stages.expert_lora), on the bf16 base and on the NF4 base QLoRA stores (bench/moe_qlora's quantize_in_place).

Per variant: tokens/s over timed steps, then torch.profiler over two steps: the kernels by GPU time, grouped
into kinds (expert matmuls, dequantization, attention, routing and index ops, ...), and the GPU's busy share
of the wall time (kernel time summed over the step's wall time: below 1 the host or a sync holds it).

    python bench/moe_profile/run.py --out $OUT/moe_profile.json [--variants bf16 nf4]
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

from stages import expert_lora  # noqa: E402


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_run", Path(__file__).resolve().parents[1] / name / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_speed, _qlora = _load("moe_speed"), _load("moe_qlora")

KINDS = [  # first match wins: kernel-name patterns by what they do
    ("dequantize", r"dequant|kDequant"),
    ("optimizer", r"adam|multi_tensor|foreach|optimizer"),
    ("attention", r"flash|fmha|attention|sdpa"),
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
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for b in batches[:steps]:
            _speed.step(model, opt, b)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
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
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:45]
    return {"wall_ms_per_step_profiled": round(wall * 1e3, 1), "kernel_ms_per_step": round(total, 1),
            "gpu_busy": round(total / (wall * 1e3), 3),
            "kernels_per_step": sum(v[0] for v in kernels.values()) // steps,
            "kinds_ms_per_step": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": n[:160], "kind": kind(n), "calls": c // steps, "ms": round(ms / steps, 2)} for n, (c, ms) in top]}


def variant(name: str, args, batches) -> dict:
    shape = _speed.SHAPES["qwen3-30b-a3b"]
    model = _speed.build(shape)
    active = _speed.active_params(model, shape)
    if name == "nf4":
        _qlora.quantize_in_place(model)
    row = {"variant": name, "liger": _qlora.liger(model)}
    model, _ = _qlora.adapt(model, args.r)
    assert expert_lora.use_grouped_lora(model) > 0
    params = [p for p in model.parameters() if p.requires_grad]
    row["timed"] = _qlora.timed(model, params, batches, args.warmup, args.steps, "paged_adamw_8bit" if name == "nf4" else "adamw_torch")
    row["timed"]["mfu_active"] = round(6 * active * row["timed"]["tokens_per_s"] / _speed.H200_BF16_FLOPS, 4)
    print(name, row["timed"], flush=True)
    opt = torch.optim.AdamW(params, lr=1e-5)
    _speed.step(model, opt, batches[0])
    row["profile"] = profile(model, opt, batches[1:], 2)
    print(name, json.dumps(row["profile"], indent=1), flush=True)
    del model, params, opt
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = _speed.timing_arguments(["qwen3-30b-a3b"], steps=4)
    ap.add_argument("--variants", nargs="+", default=["bf16", "nf4"])
    args = ap.parse_args()
    out = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "settings": vars(args), "rows": []}
    shape = _speed.SHAPES["qwen3-30b-a3b"]
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=g).cuda()
               for _ in range(args.warmup + args.steps)]
    for v in args.variants:
        out["rows"].append(variant(v, args, batches))
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
