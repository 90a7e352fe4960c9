"""Preflight: will this run fit in memory at its worst step? Decide before training starts.

    python -m stages.preflight --config configs/default.yaml [--gpu-memory-gib 24]

1. Reads config.json only (no weights) and the dataset; tokenizes every sample with the
   real tokenizer and chat template; applies `data.long_sample_policy`; finds the longest
   sample, because with dynamic padding the micro-batch that holds it is the worst step
   ("enough VRAM, yet OOM at step 400" is that batch arriving late).
2. Estimates peak memory for that worst micro-batch, itemised: base weights by dtype
   (NF4 for QLoRA, with the embeddings and lm_head bitsandbytes leaves in 16-bit), LoRA
   weights + grads + optimizer states, activations with or without checkpointing, the
   logits and cross-entropy buffer (vocab x tokens, often the largest single item), the
   CUDA context and allocator overhead.
3. Compares with the budget (`preflight.gpu_memory_gib`, default the device's memory; on
   CPU the available RAM) minus `preflight.margin`, and when it does not fit, stops with
   the reason and the single config changes that would make it fit, smallest first.

This is the first analytic model; constants marked CALIBRATE are to be fitted against
measured peaks on a GPU (bench/).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stages import data, memory
from stages.config import RunConfig, load_config
from stages.memory import GIB, MemoryReport
from stages.modelio import compute_dtype, load_tokenizer, resolve_model_dir

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NF4_BYTES = {True: 0.5 + 1 / 64 + 4 / (64 * 256), False: 0.5 + 4 / 64}  # 4-bit + absmax (double-quant or fp32)
OPTIM_BYTES = {"adamw_torch": 8, "adamw_torch_fused": 8, "paged_adamw_8bit": 2, "adamw_8bit": 2, "sgd": 0}
LOGITS_BYTES_PER_ELEM = 10  # bf16 logits + fp32 upcast + fp32 grad (anchors: 11.5 GiB at 8192 x 152064)
CUDA_CONTEXT_GIB = 0.5      # CALIBRATE: driver + cuBLAS workspaces, outside torch's counters
ALLOCATOR_OVERHEAD = 0.10   # CALIBRATE: reserved over allocated with expandable_segments


class PreflightError(RuntimeError):
    """The run would not fit; the message says by how much and what to change."""


@dataclass
class Shapes:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, cfg: dict) -> Shapes:
        cfg = cfg.get("text_config", cfg)
        heads = cfg["num_attention_heads"]
        return cls(
            vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"],
            layers=cfg["num_hidden_layers"], heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") in ("qwen2",))),
        )

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each per-layer linear module."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass
class LengthScan:
    n_samples: int
    p50: int
    p95: int
    p99: int
    max: int
    longest_id: str
    truncated: list[str]
    dropped: list[str]
    worst_batch_tokens: int   # micro-batch x longest sample: what dynamic padding can build


@dataclass
class Estimate:
    items_gib: dict[str, float]
    total_gib: float


@dataclass
class PreflightResult:
    fits: bool
    device: str
    budget_gib: float
    usable_gib: float          # budget minus margin
    estimate: Estimate
    lengths: LengthScan
    suggestions: list[dict]    # config changes that fit, smallest estimate first
    report_md: Path
    memory: MemoryReport | None = None
    notes: list[str] = field(default_factory=list)


def run(cfg: RunConfig, out_dir: Path, gpu_memory_gib: float | None = None) -> PreflightResult:
    """Scan the data, estimate the worst step, and raise PreflightError if it does not fit."""
    out_dir = Path(out_dir)
    with memory.track("preflight", out_dir) as meter:
        shapes = Shapes.from_config(json.loads((resolve_model_dir(cfg.model.name_or_path) / "config.json").read_text()))
        lengths = scan_lengths(cfg)
        device, budget = _budget(gpu_memory_gib or cfg.preflight.gpu_memory_gib)
        usable = budget * (1 - cfg.preflight.margin)
        est = estimate(cfg, shapes, lengths.max, on_gpu=device != "cpu")
        fits = est.total_gib <= usable
        suggestions = [] if fits else suggest(cfg, shapes, lengths, usable, on_gpu=device != "cpu")
    result = PreflightResult(fits, device, round(budget, 3), round(usable, 3), est, lengths, suggestions,
                             out_dir / "preflight.md", meter.report)
    result.report_md.write_text(render(result, cfg))
    (out_dir / "preflight.json").write_text(json.dumps(_jsonable(result), indent=2, default=str))
    print(result.report_md.read_text())
    if not fits:
        fitting = [s for s in suggestions if s["fits"]]
        fix = (f"smallest change that fits: {fitting[0]['change']} (estimate {fitting[0]['estimate_gib']:.2f} GiB)"
               if fitting else "no single change fits: combine QLoRA, a smaller micro-batch and a shorter max_length")
        raise PreflightError(
            f"estimated peak {est.total_gib:.2f} GiB for the worst micro-batch ({lengths.worst_batch_tokens} tokens, "
            f"longest sample {lengths.longest_id}) exceeds {usable:.2f} GiB usable of {budget:.2f} GiB on {device} "
            f"(preflight.margin {cfg.preflight.margin:.0%}); {fix}. Full table: {result.report_md}"
        )
    return result


def scan_lengths(cfg: RunConfig) -> LengthScan:
    tokenizer = load_tokenizer(cfg.model)
    tok = data.tokenize(data.read_jsonl(cfg.data.train_file), tokenizer, cfg.data.max_length, cfg.data.long_sample_policy)
    ls = sorted(tok.lengths)

    def pct(p: float) -> int:
        return ls[min(len(ls) - 1, math.ceil(p * len(ls)) - 1)]

    longest = max(range(len(tok.lengths)), key=tok.lengths.__getitem__)
    return LengthScan(len(ls), pct(0.5), pct(0.95), pct(0.99), ls[-1], tok.ids[longest], tok.truncated, tok.dropped,
                      worst_batch_tokens=cfg.training.per_device_train_batch_size * ls[-1])


def estimate(cfg: RunConfig, s: Shapes, seq: int, on_gpu: bool) -> Estimate:
    """Peak memory of one optimizer step on a micro-batch of `seq`-token samples."""
    t, lo, q = cfg.training, cfg.lora, cfg.quantization
    act_bytes = compute_dtype(cfg.model.torch_dtype).itemsize if on_gpu else 4
    tokens = t.per_device_train_batch_size * seq
    lin = s.linears()
    per_layer_linear = sum(i * o for i, o in lin.values())
    embed = s.vocab * s.hidden * (1 if s.tied else 2)
    norms = (2 * s.layers + 1) * s.hidden
    if q.load_in_4bit:
        weights = per_layer_linear * s.layers * NF4_BYTES[q.bnb_4bit_use_double_quant] + (embed + norms) * act_bytes
    else:
        weights = (per_layer_linear * s.layers + embed + norms) * act_bytes
    targets = ALL_LINEAR if lo.target_modules == "all-linear" else [m for m in lo.target_modules if m in lin]
    lora_params = s.layers * sum(lo.r * (lin[m][0] + lin[m][1]) for m in targets)
    # peft keeps adapters in fp32 (autocast_adapter_dtype): weights 4 + grads 4 + optimizer.
    lora = lora_params * (8 + OPTIM_BYTES[t.optim])
    h, i, kvd = s.hidden, s.intermediate, s.kv_heads * s.head_dim
    # One decoder layer's forward working set: residual, norm, q/k/v, attention out, o,
    # gate/up/act/product (SDPA: no seq x seq matrix). CALIBRATE against measured peaks.
    layer_acts = tokens * (6 * h + 2 * kvd + 4 * i) * act_bytes
    if cfg.model.attn_implementation == "eager":
        layer_acts += t.per_device_train_batch_size * s.heads * seq * seq * act_bytes * 2
    if t.gradient_checkpointing:
        activations = s.layers * tokens * h * act_bytes + 2 * layer_acts  # saved inputs + recompute and its grads
    else:
        activations = s.layers * layer_acts
    logits = tokens * s.vocab * LOGITS_BYTES_PER_ELEM
    items = {
        "base weights" + (" (NF4 + 16-bit embeddings)" if q.load_in_4bit else ""): weights,
        f"LoRA weights+grads+{t.optim} ({lora_params / 1e6:.1f} M params)": lora,
        "activations" + (" (checkpointed)" if t.gradient_checkpointing else ""): activations,
        "logits + cross-entropy": logits,
    }
    subtotal = sum(items.values())
    items["allocator overhead"] = subtotal * ALLOCATOR_OVERHEAD if on_gpu else 0
    if on_gpu:
        items["CUDA context"] = CUDA_CONTEXT_GIB * GIB
    gib = {k: round(v / GIB, 4) for k, v in items.items()}
    return Estimate(gib, round(sum(gib.values()), 4))


def suggest(cfg: RunConfig, s: Shapes, lengths: LengthScan, usable: float, on_gpu: bool) -> list[dict]:
    """Single config changes, each re-estimated; those that fit, smallest first."""
    t = cfg.training
    options = []
    if not t.gradient_checkpointing:
        options.append(("training.gradient_checkpointing=true", {"training": {"gradient_checkpointing": True}}, lengths.max))
    if not cfg.quantization.load_in_4bit:
        options.append(("quantization.load_in_4bit=true (QLoRA)", {"quantization": {"load_in_4bit": True}}, lengths.max))
    if t.per_device_train_batch_size > 1:
        b = t.per_device_train_batch_size // 2
        ga = t.gradient_accumulation_steps * t.per_device_train_batch_size // b
        options.append((f"training.per_device_train_batch_size={b} training.gradient_accumulation_steps={ga} (same effective batch)",
                        {"training": {"per_device_train_batch_size": b, "gradient_accumulation_steps": ga}}, lengths.max))
    if lengths.p99 < lengths.max:
        options.append((f"data.max_length={lengths.p99} data.long_sample_policy=drop (drops the longest 1%)",
                        {"data": {"max_length": lengths.p99, "long_sample_policy": "drop"}}, lengths.p99))
    if t.optim in ("adamw_torch", "adamw_torch_fused"):
        options.append(("training.optim=paged_adamw_8bit", {"training": {"optim": "paged_adamw_8bit"}}, lengths.max))
    out = []
    for label, patch, seq in options:
        changed = cfg.model_copy(update={k: getattr(cfg, k).model_copy(update=v) for k, v in patch.items()})
        total = estimate(changed, s, seq, on_gpu).total_gib
        out.append({"change": label, "estimate_gib": total, "fits": total <= usable})
    return sorted([o for o in out if o["fits"]], key=lambda o: -o["estimate_gib"]) + [o for o in out if not o["fits"]]


def _budget(requested: float | None) -> tuple[str, float]:
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        return torch.cuda.get_device_name(0), min(requested or total, total)
    import psutil

    return "cpu", requested or psutil.virtual_memory().available / GIB


def render(r: PreflightResult, cfg: RunConfig) -> str:
    L = r.lengths
    verdict = "FITS" if r.fits else "DOES NOT FIT"
    lines = [
        f"## Preflight: {verdict} — {r.estimate.total_gib:.3f} GiB estimated / {r.usable_gib:.2f} GiB usable "
        f"({r.budget_gib:.2f} GiB on {r.device}, margin {cfg.preflight.margin:.0%})",
        "",
        f"Worst micro-batch: {cfg.training.per_device_train_batch_size} x {L.max} tokens (longest sample {L.longest_id}). "
        f"Lengths over {L.n_samples} samples: p50 {L.p50}, p95 {L.p95}, p99 {L.p99}, max {L.max}. "
        f"Truncated: {len(L.truncated)}, dropped: {len(L.dropped)}.",
        "",
        "| item | GiB |",
        "|---|---|",
        *[f"| {k} | {v:.3f} |" for k, v in r.estimate.items_gib.items()],
        f"| **total** | **{r.estimate.total_gib:.3f}** |",
    ]
    if r.suggestions:
        lines += ["", "| change | estimate GiB | fits |", "|---|---|---|"]
        lines += [f"| `{s['change']}` | {s['estimate_gib']:.2f} | {'yes' if s['fits'] else 'no'} |" for s in r.suggestions]
    return "\n".join(lines) + "\n"


def _jsonable(r: PreflightResult) -> dict:
    d = asdict(r)
    d["memory"] = r.memory.to_json() if r.memory else None
    return d


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Check that a run fits in memory before it starts (a stage of train-and-export).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--gpu-memory-gib", type=float, help="budget of the training card (default: preflight.gpu_memory_gib or the device's)")
    ap.add_argument("--out", type=Path, help="stage directory (default: artifacts/runs/<new id>/preflight)")
    a = ap.parse_args(argv)
    cfg = load_config(a.config, a.set)
    from stages.paths import RunPaths

    try:
        run(cfg, a.out or RunPaths.for_run(cfg).stage("preflight"), a.gpu_memory_gib)
    except PreflightError as e:
        raise SystemExit(f"preflight: {e}") from None


if __name__ == "__main__":
    main()
