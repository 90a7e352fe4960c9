"""Preflight: will this run fit in memory at its worst step? Decide before training starts.

    python -m stages.preflight --config configs/default.yaml [--gpu-memory-gib 24]

1. Reads config.json only (no weights) and the dataset; tokenizes every sample with the
   real tokenizer and chat template; applies `data.long_sample_policy`; finds the longest
   sample, because with dynamic padding the micro-batch that holds it is the worst step
   ("enough VRAM, yet OOM at step 400" is that batch arriving late).
2. Estimates peak memory for that worst micro-batch, itemised, for the settings the train
   stage resolves (`estimate`): what a run capped at the result needs (its peak allocated
   plus the allocator's slack), not what an uncapped run happens to reserve.
3. On a CUDA device, probes it: two real optimizer steps on that micro-batch under a cap at
   the budget; the measurement, where it ran, decides.
4. Compares with the budget (`preflight.gpu_memory_gib`, default the device's memory; on
   CPU the available RAM) less the CUDA context and `preflight.margin`; when it does not fit,
   stops with the reason and the single config changes that would make it fit, smallest first.

The coefficients are fitted to runs measured on an H200 (bench/fit_memory.py).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from stages import data, memory
from stages.config import RunConfig, load_config
from stages.errors import UserError
from stages.memory import GIB, MemoryReport
from stages.modelio import compute_dtype, load_tokenizer, resolve_model_dir

KNOWN_MODEL_TYPES = {"llama", "qwen2", "mistral", "qwen3"}
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NF4_BYTES = {True: 0.5 + 1 / 64 + 4 / (64 * 256), False: 0.5 + 4 / 64}  # 4-bit + absmax (double-quant or fp32)
OPTIM_BYTES = {"auto": 8, "adamw_torch": 8, "adamw_torch_fused": 8, "paged_adamw_8bit": 2, "adamw_8bit": 2, "sgd": 0}
# Probe when the estimate is below this multiple of the budget: a run capped at the estimate
# completed and one capped 3% lower ran out on every row checked (bench/results/cap_at_estimate.json),
# so an estimate 10% over the budget is already a clear "does not fit", and probing it would only OOM slowly.
PROBE_IF_UNDER = 1.1
CUDA_CONTEXT_GIB = 0.5      # typical CUDA context of a torch process; not in torch's counters (not measured here)
CUBLAS_WORKSPACE = 64 * 2**20  # cuBLAS's workspaces in torch's allocator: what stays allocated after a freed model (H200)
LOSS_H = 3  # hidden-sized tensors around Liger's loss: the final hidden states, their norm, the input gradient it computes in forward
# Fitted by bench/fit_memory.py to the default-settings grid (bench/results/memory_grid_raw_run*.jsonl).
COEF = dict(
    layer_h=5.765,      # x T*H*act: hidden-sized tensors and grads of the layer being back-propagated (beyond its input)
    layer_kv=2.0,       # x T*KV*act: its key/value-sized ones
    layer_i=3.081,      # x T*I*act: its intermediate-sized ones, untiled (SwiGLU's gate and up, the product's grad)
    tiled_h=4.63,       # x T*H*act: with the tiled MLP instead: its saved input and the input grad it accumulates
    tile_i=0.175,       # x shard*I*act: one tiled-MLP shard recomputed and back-propagated
    nf4_i=0.894,        # x T*I*act: QLoRA, untiled: one more intermediate-sized tensor than 16-bit LoRA (measured, not traced)
    nf4_tiled_h=-1.436, # x T*H*act: QLoRA, tiled: hidden-sized difference to 16-bit LoRA (measured)
    mask=4.519,         # bytes per element of the batch x seq x seq padding mask
    slack_gib=0.125,    # allocator: what a capped run cannot give back (partly used pages, the small-block pool)
    slack=0.01,         # allocator: as a fraction of the step's activations
    logits=14.07,       # bytes per logit element, plain cross-entropy (bf16 logits, fp32 upcast, fp32 grad; earlier grid)
    frag_logits=0.005,  # reserved - allocated, per plain-CE logit element (earlier grid)
)


class PreflightError(UserError, RuntimeError):
    """The run would not fit; the message says by how much and what to change."""


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
    unknown: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, cfg: dict) -> Shapes:
        """Reads Llama/Qwen/Mistral-style names, with GPT-style fallbacks; never raises on a missing key."""
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
            experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 1), unknown=unknown,
        )
        arch = (cfg.get("architectures") or ["?"])[0]
        if cfg.get("model_type") not in KNOWN_MODEL_TYPES:
            shapes.unknown.append(
                f"architecture {arch} (model_type {cfg.get('model_type')!r}) is not one the estimate was calibrated on "
                f"({', '.join(sorted(KNOWN_MODEL_TYPES))}): weights are counted from the shapes above, activations assume a "
                "Llama-style decoder; trust the GPU probe over the estimate"
            )
        if shapes.experts > 1:
            shapes.unknown.append(f"{shapes.experts} experts: every expert's MLP weights are counted, activations as if dense")
        return shapes

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
    items_bytes: dict[str, float] = field(default_factory=dict, repr=False)


@dataclass
class ProbeResult:
    ok: bool                   # two optimizer steps completed under the cap
    peak_reserved_gib: float   # what the caching allocator held at its peak
    peak_alloc_gib: float
    cap_gib: float             # set_per_process_memory_fraction of the device
    batch: list[int]           # the row lengths of the probed micro-batch
    postmortem: Path | None = None
    error: str | None = None


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
    probe: ProbeResult | None = None
    notes: list[str] = field(default_factory=list)


def run(cfg: RunConfig, out_dir: Path, gpu_memory_gib: float | None = None) -> PreflightResult:
    """Scan the data, estimate the worst step, probe it on a GPU; raise PreflightError if it does not fit."""
    out_dir = Path(out_dir)
    with memory.track("preflight", out_dir) as meter:
        shapes = Shapes.from_config(json.loads((resolve_model_dir(cfg.model.name_or_path) / "config.json").read_text()))
        tokenizer = load_tokenizer(cfg.model)
        lengths = scan_lengths(cfg, tokenizer)
        check_held_out(cfg, tokenizer)  # what merge, export and smoke will read: its problems stop the run now, not after training
        device, budget = _budget(gpu_memory_gib or cfg.preflight.gpu_memory_gib)
        on_gpu = device != "cpu"
        # The CUDA context (driver, kernels) lives outside torch's allocator, which is what
        # the estimate and the probe measure; on a GPU it comes off the budget first.
        usable = (budget - (CUDA_CONTEXT_GIB if on_gpu else 0.0)) * (1 - cfg.preflight.margin)
        est = estimate(cfg, shapes, lengths.max, on_gpu=on_gpu)
        weights = next(v for k, v in est.items_gib.items() if k.startswith("base weights"))
        if weights > usable:
            raise PreflightError(
                f"the base weights alone need {weights:.2f} GiB, more than the {usable:.2f} GiB usable of {budget:.2f} GiB on {device}; "
                + ("use a bigger card or several GPUs (FSDP)" if cfg.quantization.load_in_4bit
                   else "set quantization.load_in_4bit: true (QLoRA) or use a bigger card")
            )
        result_probe = None
        # Probing a run the estimate puts far over budget would only OOM slowly.
        if on_gpu and cfg.preflight.probe and est.total_gib <= PROBE_IF_UNDER * usable:
            result_probe = probe(cfg, lengths.max, usable, out_dir)
        fits = result_probe.ok if result_probe else est.total_gib <= usable
        suggestions = [] if fits else suggest(cfg, shapes, lengths, usable, on_gpu=on_gpu)
    result = PreflightResult(fits, device, round(budget, 3), round(usable, 3), est, lengths, suggestions,
                             out_dir / "preflight.md", meter.report, probe=result_probe, notes=shapes.unknown)
    result.report_md.write_text(render(result, cfg))
    (out_dir / "preflight.json").write_text(json.dumps(memory.jsonable(result), indent=2, default=str))
    print(result.report_md.read_text())
    if not fits:
        best = smallest_fix(suggestions)
        fix = (f"smallest change that fits: {best['change']} (estimate {best['estimate_gib']:.2f} GiB); in the YAML:\n{best['diff']}\n"
               f"or on the command line: " + " ".join(f"--set {o}" for o in best["overrides"])
               if best else "no single change fits: combine QLoRA, a smaller micro-batch and a shorter max_length")
        what = (f"two real optimizer steps on the worst micro-batch ran out of memory under a {usable:.2f} GiB cap "
                f"(estimate {est.total_gib:.2f} GiB; post-mortem {result_probe.postmortem})" if result_probe
                else f"the estimated peak, {est.total_gib:.2f} GiB, exceeds")
        raise PreflightError(
            f"{what} for the worst micro-batch ({lengths.worst_batch_tokens} tokens, longest sample {lengths.longest_id}): "
            f"{usable:.2f} GiB usable of {budget:.2f} GiB on {device} (preflight.margin {cfg.preflight.margin:.0%}); {fix}. "
            f"Full table: {result.report_md}"
        )
    return result


def probe(cfg: RunConfig, worst_len: int, cap_gib: float, out_dir: Path, model=None) -> ProbeResult:
    """Two real optimizer steps on the worst micro-batch, built exactly as training builds it,
    with the process capped at `cap_gib` (torch.cuda.set_per_process_memory_fraction).

    The batch is the longest sample plus rows one token shorter, so dynamic padding and the
    padding mask appear as they will in training.

    Args:
        model: an already built stage model (bench/memory_grid.py reuses one across rows);
            None builds it here, which is what preflight does.
    """
    import torch

    from stages import train

    total = torch.cuda.get_device_properties(0).total_memory
    b = cfg.training.per_device_train_batch_size
    batch = [worst_len] + [max(1, worst_len - 1)] * (b - 1)
    memory.free_gpu()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total))
    torch.cuda.reset_peak_memory_stats()
    built, trainer = model is None, None
    try:
        if built:
            model = train.build_model(cfg)
        vocab = model.get_input_embeddings().num_embeddings
        gen = torch.Generator().manual_seed(0)
        rows = []
        for _ in range(2):
            for n in batch:
                ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
                rows.append({"input_ids": ids, "labels": ids})
        trainer = train.make_trainer(
            cfg, model, rows, train.Collator(0), out_dir / "probe", max_steps=2, gradient_accumulation_steps=1,
            train_sampling_strategy="sequential", save_strategy="no", logging_steps=1000, disable_tqdm=True, logging_first_step=False,
        )
        trainer.train()
        ok, error, postmortem = True, None, None
    except torch.OutOfMemoryError as e:
        ok, error = False, str(e).split("\n")[0][:300]
        postmortem = out_dir / "probe_postmortem.txt"
        postmortem.write_text(f"{error}\n\nbatch rows: {batch}\n\n{torch.cuda.memory_summary()}")
    finally:
        peak_reserved, peak_alloc = torch.cuda.max_memory_reserved() / GIB, torch.cuda.max_memory_allocated() / GIB
        if trainer is not None:
            train.release(trainer)
        if built:
            model = None
        del trainer
        memory.free_gpu()
        torch.cuda.set_per_process_memory_fraction(1.0)
    return ProbeResult(ok, round(peak_reserved, 4), round(peak_alloc, 4), round(cap_gib, 3), batch, postmortem, error)


def check_held_out(cfg: RunConfig, tokenizer) -> None:
    """The held-out file parses, renders with the chat template, and its prompts fit the smoke test's context."""
    from stages import smoke

    samples = data.held_out(cfg, max(cfg.smoke.max_prompts, cfg.export.fidelity.samples, cfg.merge.samples))
    data.tokenize(samples, tokenizer, 1 << 30, "error")
    smoke.check_context(cfg, tokenizer)


def scan_lengths(cfg: RunConfig, tokenizer=None) -> LengthScan:
    tokenizer = tokenizer or load_tokenizer(cfg.model)
    tok = data.tokenize(data.read_jsonl(cfg.data.train_file), tokenizer, cfg.data.max_length, cfg.data.long_sample_policy)
    ls = sorted(tok.lengths)

    def pct(p: float) -> int:
        return ls[min(len(ls) - 1, math.ceil(p * len(ls)) - 1)]

    longest = max(range(len(tok.lengths)), key=tok.lengths.__getitem__)
    return LengthScan(len(ls), pct(0.5), pct(0.95), pct(0.99), ls[-1], tok.ids[longest], tok.truncated, tok.dropped,
                      worst_batch_tokens=cfg.training.per_device_train_batch_size * ls[-1])


def estimate(cfg: RunConfig, s: Shapes, seq: int, on_gpu: bool, coef: dict | None = None) -> Estimate:
    """Memory one optimizer step on a micro-batch padded to `seq` tokens needs: on a GPU, the smallest cap
    under which it runs (its peak allocated plus the allocator's slack; bench/results/cap_at_estimate.json).

    Counted from what each piece of the training stage keeps, with the settings it resolves
    (`train.resolve_auto`: host embeddings, offloaded layer inputs, Liger kernels, 8-bit
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
                  cross-entropy), one chunk of logits; plain, the whole tokens x vocab
                  logits in 16 and 32 bits
      mask        the 4-D padding mask of a padded micro-batch (batch x seq x seq)
      allocator   the slack a capped run cannot give back (partly used pages, the small-block
                  pool); what an uncapped run reserves beyond that is returned under a cap
    Coefficients (COEF) are fitted to the measured grid (bench/fit_memory.py), one per
    mechanism, not per shape.
    """
    k = COEF | (coef or {})
    t, lo, q = cfg.training, cfg.lora, cfg.quantization
    from stages.train import resolve_auto

    gpu = resolve_auto(cfg, on_gpu=on_gpu)  # the settings as the train stage resolves them there
    act = compute_dtype(cfg.model.torch_dtype, cuda=on_gpu).itemsize
    b = t.per_device_train_batch_size
    tokens = b * seq
    lin = s.linears()
    h, i, kv = s.hidden, s.intermediate, s.kv_heads * s.head_dim
    mlp = {"gate_proj", "up_proj", "down_proj"}
    linear_params = s.layers * sum(a * o * (s.experts if m in mlp else 1) for m, (a, o) in lin.items())
    table = s.vocab * s.hidden
    host_embeddings = gpu["offload_embeddings"] and not s.tied  # a table tied to lm_head stays on the GPU
    other_params = (0 if host_embeddings else table) + (0 if s.tied else table) + (2 * s.layers + 1) * s.hidden
    linear_bytes = linear_params * (NF4_BYTES[q.bnb_4bit_use_double_quant] if q.load_in_4bit else act)
    weights = linear_bytes + other_params * act

    targets = list(lin) if lo.target_modules == "all-linear" else [m for m in lo.target_modules if m in lin]
    matrices = [n for m in targets for n in (lo.r * lin[m][0], lo.r * lin[m][1])]  # lora_A, lora_B of one layer
    lora_params = s.layers * sum(matrices)
    states = s.layers * sum(_state_bytes(gpu["optim"], n, on_gpu) for n in matrices)
    adapters = lora_params * 8 + states  # peft keeps adapters in fp32 (autocast_adapter_dtype): weight 4 + grad 4
    workspace = CUBLAS_WORKSPACE if on_gpu else 0

    dropout = tokens * sum(lin[m][0] for m in targets) * (act + 1) if lo.lora_dropout > 0 else 0  # copy + mask
    tiled = gpu["tiled_mlp"]
    if t.gradient_checkpointing:
        kept = (2 if gpu["offload_activations"] else s.layers) * tokens * h * act
        nf4 = q.load_in_4bit
        if tiled:  # Liger's TiledMLP: shards of ceil(seq / hidden) per row, recomputed one at a time in backward
            shard = b * math.ceil(seq / math.ceil(seq / h))
            layer = (tokens * act * (k["layer_h"] * h + k["layer_kv"] * kv + (k["tiled_h"] + nf4 * k["nf4_tiled_h"]) * h)
                     + k["tile_i"] * shard * i * act)
        else:
            layer = tokens * act * (k["layer_h"] * h + k["layer_kv"] * kv + (k["layer_i"] + nf4 * k["nf4_i"]) * i)
        layer += dropout
        if nf4:  # bitsandbytes dequantizes the weight to compute the input gradient
            layer += max(a * o for a, o in lin.values()) * act
    else:
        kept = s.layers * (tokens * act * (k["layer_h"] * h + k["layer_kv"] * kv + k["layer_i"] * i) + dropout)
        layer = 0.0
    chunked = _loss_mode(cfg, on_gpu) == "chunked"
    if chunked:  # Liger: chunks of next_pow2(tokens / ceil(vocab / hidden)) rows of logits, computed and consumed in turn
        chunk = 1 << max(0, math.ceil(math.log2(math.ceil(tokens / math.ceil(s.vocab / h)))))
        loss = LOSS_H * tokens * h * act + 2 * min(chunk, tokens) * s.vocab * act
    else:
        loss = LOSS_H * tokens * h * act + k["logits"] * tokens * s.vocab
    mask = k["mask"] * b * seq * seq if b > 1 else 0.0
    if cfg.model.attn_implementation == "eager":  # the seq x seq scores, per head, saved per layer
        mask += b * s.heads * seq * seq * act * (2 if t.gradient_checkpointing else 2 * s.layers)
    phase, peak = ("loss", loss) if loss >= layer else ("layer recompute + backward", layer)
    # With expandable segments the allocator unmaps free pages inside its segment and maps them where a request
    # needs them once the process reaches its cap: the 4-21% more an uncapped run reserves is given back, and a
    # run capped a few % above its peak allocated completes (bench/results/cap_check.json). What stays is slack.
    overhead = (k["slack_gib"] * GIB + k["slack"] * (kept + peak + mask)
                + (0.0 if chunked else k["frag_logits"] * tokens * s.vocab)) if on_gpu else 0.0
    paged = s.layers * sum(_state_bytes(gpu["optim"], n, on_gpu, paged=True) for n in matrices)
    items = {
        "base weights" + (" (NF4 + 16-bit embeddings)" if q.load_in_4bit else "")
        + (", input embedding in host memory" if host_embeddings else ""): weights,
        f"LoRA weights+grads+{gpu['optim']} states ({lora_params / 1e6:.1f} M params)"
        + (f"; {paged / GIB:.2f} GiB more states paged outside torch" if paged else ""): adapters,
        "cuBLAS workspaces": workspace,
        "activations kept for backward" + (" (layer inputs, checkpointed" + (", offloaded to host)" if gpu["offload_activations"] else ")")
                                           if t.gradient_checkpointing else " (all layers)"): kept,
        f"peak moment: {phase}" + (" (chunked cross-entropy)" if chunked and phase == "loss" else "")
        + (" (tiled MLP)" if tiled and phase != "loss" else ""): peak,
        "padding mask / attention scores": mask,
        "allocator overhead (reserved - allocated)": overhead,
    }
    gib = {key: round(v / GIB, 4) for key, v in items.items()}
    return Estimate(gib, round(sum(items.values()) / GIB, 4), items)


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


def _loss_mode(cfg: RunConfig, on_gpu: bool) -> str:
    if cfg.training.cross_entropy == "auto":
        return "chunked" if on_gpu else "plain"
    return cfg.training.cross_entropy


def suggest(cfg: RunConfig, s: Shapes, lengths: LengthScan, usable: float, on_gpu: bool) -> list[dict]:
    """Single config changes, each re-estimated, ranked by predicted saving.

    Each carries `overrides` (for --set), a YAML `diff`, and `rank`: how much it changes
    the run, lowest first. Same maths, only slower: chunked loss, micro-batch traded for
    accumulation, checkpointing; then numerics: 8-bit optimizer, QLoRA; last, data: drop.
    """
    t = cfg.training
    options = []  # (rank, overrides, seq)
    if on_gpu and _loss_mode(cfg, on_gpu) == "plain":
        options.append((0, {"training.cross_entropy": "chunked"}, lengths.max))
    if t.per_device_train_batch_size > 1:
        h = t.halved()
        options.append((1, {"training.per_device_train_batch_size": h.per_device_train_batch_size,
                            "training.gradient_accumulation_steps": h.gradient_accumulation_steps}, lengths.max))
    if not t.gradient_checkpointing:
        options.append((2, {"training.gradient_checkpointing": True}, lengths.max))
    if t.optim in ("auto", "adamw_torch", "adamw_torch_fused"):
        options.append((3, {"training.optim": "paged_adamw_8bit"}, lengths.max))
    if not cfg.quantization.load_in_4bit:
        options.append((4, {"quantization.load_in_4bit": True}, lengths.max))
    if cfg.lora.r > 8:  # less adapter capacity: changes what the run can learn
        options.append((4, {"lora.r": cfg.lora.r // 2}, lengths.max))
    if lengths.p99 < lengths.max:
        options.append((5, {"data.max_length": lengths.p99, "data.long_sample_policy": "drop"}, lengths.p99))
    from stages.train import resolve_auto

    base = estimate(cfg, s, lengths.max, on_gpu).total_gib
    resolved = resolve_auto(cfg, on_gpu=on_gpu) | {"cross_entropy": _loss_mode(cfg, on_gpu)}
    out = []
    for rank, overrides, seq in options:
        # a change to what `auto` already resolves to would change nothing: never offered
        if all(key.startswith("training.") and resolved.get(key.split(".")[1]) == value for key, value in overrides.items()):
            continue
        patch: dict[str, dict] = {}
        for key, value in overrides.items():
            section, field_name = key.split(".")
            patch.setdefault(section, {})[field_name] = value
        changed = cfg.model_copy(update={k: getattr(cfg, k).model_copy(update=v) for k, v in patch.items()})
        total = estimate(changed, s, seq, on_gpu).total_gib
        if base - total < 0.001:  # saves nothing measurable on this model
            continue
        diff = "\n".join(
            f"{section}:\n" + "\n".join(f"  {k}: {json.dumps(v)}  # was {json.dumps(getattr(getattr(cfg, section), k))}" for k, v in fields.items())
            for section, fields in patch.items())
        sets = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
        out.append({"change": " ".join(sets), "overrides": sets, "diff": diff, "rank": rank, "estimate_gib": total,
                    "saving_gib": round(base - total, 3), "fits": total <= usable})
    return sorted(out, key=lambda o: -o["saving_gib"])


def smallest_fix(suggestions: list[dict]) -> dict | None:
    """The least invasive change that fits (see `suggest`), or None."""
    fitting = [x for x in suggestions if x["fits"]]
    return min(fitting, key=lambda x: (x["rank"], -x["estimate_gib"])) if fitting else None


def _budget(requested: float | None) -> tuple[str, float]:
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        return torch.cuda.get_device_name(0), min(requested or total, total)
    import psutil

    return "cpu", requested or psutil.virtual_memory().available / GIB


def headline(r: PreflightResult, cfg: RunConfig) -> str:
    """The verdict and what decided it: the probe's measurement where it ran, else the estimate."""
    verdict = "FITS" if r.fits else "DOES NOT FIT"
    budget = (f"{r.usable_gib:.2f} GiB usable of {r.budget_gib:.2f} GiB on {r.device} (margin {cfg.preflight.margin:.0%}"
              + (f", CUDA context {CUDA_CONTEXT_GIB} GiB)" if r.device != "cpu" else ")"))
    p = r.probe
    if p and p.ok:
        return (f"Preflight: {verdict}, measured: two real optimizer steps on the worst micro-batch ran under a {p.cap_gib:.2f} GiB cap, "
                f"peak {p.peak_alloc_gib:.2f} GiB allocated / {p.peak_reserved_gib:.2f} GiB reserved; {budget}. "
                f"The estimate below said {r.estimate.total_gib:.2f} GiB.")
    if p:
        return (f"Preflight: {verdict}, measured: two real optimizer steps on the worst micro-batch ran out of memory under the "
                f"{p.cap_gib:.2f} GiB cap; {budget}. The estimate below said {r.estimate.total_gib:.2f} GiB.")
    why = ("no CUDA device here to measure on" if r.device == "cpu" else "preflight.probe is off" if not cfg.preflight.probe
           else f"over {PROBE_IF_UNDER:.1f}x the usable memory: not worth a probe")
    return f"Preflight: {verdict}, estimated: {r.estimate.total_gib:.2f} GiB for {budget} ({why})."


def render(r: PreflightResult, cfg: RunConfig) -> str:
    L = r.lengths
    lines = [
        f"## {headline(r, cfg)}",
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
    if r.probe:
        p = r.probe
        lines += ["", f"Probe (two real optimizer steps on rows {p.batch}, capped at {p.cap_gib:.2f} GiB): "
                  + (f"peak reserved {p.peak_reserved_gib:.2f} GiB, allocated {p.peak_alloc_gib:.2f} GiB." if p.ok
                     else f"OUT OF MEMORY ({p.error}); post-mortem: {p.postmortem}")]
    if r.notes:
        lines += ["", "Not estimated precisely:", *[f"- {n}" for n in r.notes]]
    if r.suggestions:
        best = smallest_fix(r.suggestions)
        lines += ["", "| change (by predicted saving) | saves GiB | estimate GiB | fits |", "|---|---|---|---|"]
        lines += [f"| `{x['change']}`{' **(smallest that fits)**' if x is best else ''} | {x['saving_gib']:.2f} | {x['estimate_gib']:.2f} | "
                  f"{'yes' if x['fits'] else 'no'} |" for x in r.suggestions]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Check that a run fits in memory before it starts (a stage of train-and-export).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--gpu-memory-gib", type=float, help="budget of the training card (default: preflight.gpu_memory_gib or the device's)")
    ap.add_argument("--out", type=Path, help="stage directory (default: artifacts/runs/<new id>/preflight)")
    a = ap.parse_args(argv)
    cfg = load_config(a.config, a.set)
    from stages.paths import RunPaths

    run(cfg, a.out or RunPaths.for_run(cfg).stage("preflight"), a.gpu_memory_gib)


if __name__ == "__main__":
    import sys

    from stages.errors import run_cli

    sys.exit(run_cli(main, "preflight"))
