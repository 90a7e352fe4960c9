"""Preflight: will this run fit in memory at its worst step? Decide before training starts.

    python -m stages.preflight --config configs/default.yaml [--gpu-memory-gib 24]

1. Reads config.json only (no weights) and the dataset; tokenizes every sample with the
   real tokenizer and chat template; applies `data.long_sample_policy`; finds the longest
   sample, because with dynamic padding the micro-batch that holds it is the worst step
   ("enough VRAM, yet OOM at step 400" is that batch arriving late). Packed, every
   micro-batch holds up to the token budget: the worst is a full budget of the longest samples.
2. Estimates peak memory for that worst micro-batch, itemised, for the settings the train
   stage resolves (`estimate`): what a run capped at the result needs (its peak allocated
   plus the allocator's slack), not what an uncapped run happens to reserve.
3. On a CUDA device, probes it: two real optimizer steps on that micro-batch under a cap at
   the budget; the measurement, where it ran, decides.
4. Compares with the budget (`preflight.gpu_memory_gib`, default the device's memory; on
   CPU the available RAM) less the CUDA context and `preflight.margin`; when it does not fit,
   stops with the reason and the single config changes that would make it fit, smallest first.

The estimate is the analytic model in stages/train/memory_model.py, fitted to runs measured on an
H200 (docs/benchmarks.md: gpu_figure).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from stages import checks, data, inputs, memory, result_files
from stages.artifact import Artifact
from stages.config import ConfigError, RunConfig
from stages.errors import UserError
from stages.memory import CUDA_CONTEXT_GIB, GIB, MemoryReport
from stages.model import architecture
from stages.model.load import load_tokenizer
from stages.train import batches, eval_loss, packing, widen
from stages.train.kernels import resolve_auto
from stages.train.memory_model import Estimate, Shapes, estimate, loss_mode

# Probe when the estimate is below this multiple of the budget: a run capped at the estimate
# completed and one capped 3% lower ran out on every row checked (docs/benchmarks.md: gpu_figure),
# so an estimate 10% over the budget is already a clear "does not fit", and probing it would only OOM slowly.
PROBE_IF_UNDER = 1.1
# The probe measures what one step on the worst micro-batch needs under a cap (capped_step_need); the whole run
# (micro-batches of other widths before it, its evals and checkpoints) needs 0.985-1.033x that, by row: bisected on
# 10 capped runs with the activation offload's fixed-point release, under which a run's peak repeated exactly in
# fresh processes (docs/benchmarks.md: gpu_figure, its bracket and spread modes). 1.035x + 5 MiB sits over all 10 and within
# 5% of 9; then checked unchanged on the 28 rows it was not chosen on, 7B-12B and Gemma-2 included: every one
# completes capped there and runs out at 0.95x it (docs/benchmarks.md: gpu_figure, its pages mode; docs/preflight.md).
NEED_SCALE, NEED_PLUS_GIB = 1.035, 0.005


class PreflightError(UserError, RuntimeError):
    """The run would not fit; the message says by how much and what to change."""


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
    worst_batch_tokens: int   # padded: micro-batch x longest sample; packed: the run's heaviest planned micro-batch
    longest: list[int] = field(default_factory=list)  # the longest lengths, longest first: a packed worst micro-batch's rows
    packed: bool = False      # micro-batches are packed to a token budget (training.packing as resolved for the device)
    planned: list[int] = field(default_factory=list)  # packed: the row lengths of the run's heaviest planned micro-batch
    eval_planned: list[int] = field(default_factory=list)  # packed: the fullest eval micro-batch's, where it holds more tokens


@dataclass
class ProbeResult:
    ok: bool                   # two optimizer steps completed under the cap
    peak_reserved_gib: float   # what the caching allocator held at its peak
    peak_alloc_gib: float
    cap_gib: float             # set_per_process_memory_fraction of the device
    batch: list[int]           # the row lengths of the probed micro-batch
    postmortem: Path | None = None
    error: str | None = None
    pages_gib: float | None = None        # the two steps: the most allocator pages live blocks touched at once (memory.page_need)
    build_pages_gib: float | None = None  # the same over the model build
    step_need_gib: float | None = None    # the smallest cap one more step completes under (capped_step_need)
    eval_need_gib: float | None = None    # the same for an eval forward of the fullest eval micro-batch, after the steps


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
    adapted: str = ""          # the modules LoRA adapts (as resolved against the model) and their parameter count
    target_notes: list[str] = field(default_factory=list)  # requested names mapped onto fused modules
    data_notes: list[str] = field(default_factory=list)    # what the data holds that the run goes on with (shared held-out samples)
    steps: dict = field(default_factory=dict)  # samples and tokens per optimizer step, steps per epoch, epochs max_steps covers

    @property
    def need_gib(self) -> float | None:
        """Measured on this GPU: the cap under which the whole train stage completes (the probe's step need, scaled)."""
        return self.need_of(self.probe)

    @staticmethod
    def need_of(p: ProbeResult | None) -> float | None:
        if not (p and p.ok and p.step_need_gib):
            return None
        need = max(p.step_need_gib, p.eval_need_gib or 0.0)
        return round(max(need * NEED_SCALE + NEED_PLUS_GIB, p.build_pages_gib or 0.0), 4)

    def artifacts(self) -> list[Artifact]:
        return [Artifact("preflight-report", "Preflight memory estimate", markdown=self.report_md.read_text())]


def run(cfg: RunConfig, out_dir: Path, gpu_memory_gib: float | None = None, *, train_only: bool = False) -> PreflightResult:
    """Scan the data, estimate the worst step, probe it on a GPU; raise PreflightError if it does not fit.

    train_only: the export side runs elsewhere (or not at all): its tools (llama.cpp, gguf, the converter) and
    its disk are not checked here."""
    out_dir = Path(out_dir)
    with memory.track("preflight", out_dir) as meter:
        shapes = Shapes.of_run(cfg)
        targets = shapes.targets(cfg.lora.target_modules)  # names that match no module stop the run here, before any weights load
        lora_notes = architecture.dropout_note(cfg.lora, architecture.lora_kwargs(cfg.lora, targets, shapes.arch.model_class if shapes.arch else "this model"))
        tokenizer = load_tokenizer(cfg.model)
        content_notes = check_content(cfg, tokenizer)  # before the served tokenizer is compared on sample texts holding it
        # what the run would otherwise hit after training: trackers, disk, export tools, the tokenizer as llama.cpp reads it
        checks.before_training(cfg, out_dir, tokenizer, export=not train_only)
        lengths = scan_lengths(cfg, tokenizer)
        held_notes = content_notes + check_held_out(cfg, tokenizer)  # what merge, export and smoke will read: stopped now
        device, budget = memory.card(gpu_memory_gib or cfg.preflight.gpu_memory_gib)
        on_gpu = device != "cpu"
        architecture.attention_implementation(cfg.model.attn_implementation, shapes.arch, on_gpu)  # one the model cannot use stops here
        if skipped := architecture.sdpa_skips(cfg.model.attn_implementation, shapes.arch):
            print(f"preflight: model.attn_implementation: sdpa trains {shapes.arch.model_class} without its {', '.join(skipped)}, "
                  "which llama.cpp applies when it serves the model; auto computes it (flex_attention on a GPU)")
        usable = memory.usable_gib(budget, cfg.preflight.margin, on_gpu)
        cfg = widen.on_card(cfg, shapes, lengths.max, usable, on_gpu)  # the packed micro-batch's width, as training picks it
        eval_rows = eval_loss.rows(cfg, tokenizer) if eval_loss.eval_steps(cfg, True) else []
        settings = resolve_auto(cfg, on_gpu=on_gpu, longest=lengths.max)
        lengths.worst_batch_tokens, lengths.packed = settings["widest_micro_batch"], settings["packing"]
        widen_for_eval(cfg, eval_rows, lengths, settings["packing"])  # padded: a longer eval sample widens the worst micro-batch
        if settings["packing"] and lengths.max > batches.token_budget(cfg):
            raise ConfigError(f"training.max_tokens_per_batch is {batches.token_budget(cfg)}, shorter than the longest sample "
                              f"({lengths.max} tokens, {lengths.longest_id}); set it to at least {lengths.max}")
        planned, steps = _plan(cfg, tokenizer, settings["packing"])
        plan_tokens = packed_worst(cfg, tokenizer, planned, eval_rows, lengths, held_notes) if settings["packing"] else None
        est = estimate(cfg, shapes, lengths.max, on_gpu=on_gpu, packed_tokens=lengths.worst_batch_tokens if lengths.planned else None)
        weights = next(v for k, v in est.items_gib.items() if k.startswith("base weights"))
        if weights > usable:
            sharded = fsdp_over(cfg, shapes, lengths.max, usable, on_gpu, plan_tokens)
            raise PreflightError(
                f"the base weights alone need {weights:.2f} GiB per GPU, more than the {usable:.2f} GiB usable of {budget:.2f} GiB "
                f"on {device}; "
                + ("" if cfg.quantization.load_in_4bit else "set quantization.load_in_4bit: true (QLoRA), ")
                + (f"shard the model over {sharded[0]} GPUs (estimate {sharded[1]:.2f} GiB per GPU): --set training.launcher=accelerate "
                   f"--set training.distributed=fsdp --set training.num_processes={sharded[0]}" if sharded else "")
                + " or use a bigger card"
            )
        result_probe = None
        # Probing a run the estimate puts far over budget would only OOM slowly. With fsdp one process's memory
        # depends on the others: the probe (one process) cannot measure it, the train stage records each's peak.
        if on_gpu and cfg.preflight.probe and cfg.training.distributed != "fsdp" and est.total_gib <= PROBE_IF_UNDER * usable:
            result_probe = probe(cfg, lengths.max, usable, out_dir, lengths=lengths.longest, rows=lengths.planned or None,
                                 eval_rows=lengths.eval_planned or None)
        fits, need = est.total_gib <= usable, None
        if result_probe:  # measured on this GPU: the probe's steps ran under the cap, and what the run needs fits it
            need = PreflightResult.need_of(result_probe)
            fits = result_probe.ok and (need is None or need <= usable)
        suggestions = [] if fits else suggest(cfg, shapes, lengths, usable, on_gpu=on_gpu, packed_tokens=plan_tokens)
    result = PreflightResult(fits, device, round(budget, 3), round(usable, 3), est, lengths, suggestions,
                             out_dir / "preflight.md", meter.report, probe=result_probe, notes=shapes.unknown, data_notes=held_notes,
                             adapted=targets.summary(cfg.lora.r), target_notes=targets.notes + lora_notes, steps=steps)
    result.report_md.write_text(render(result, cfg))
    result_files.save(out_dir, "preflight", result)
    print(result.report_md.read_text())
    if not fits:
        best = smallest_fix(suggestions)
        fix = (f"smallest change that fits: {best['change']} (estimate {best['estimate_gib']:.2f} GiB); in the YAML:\n{best['diff']}\n"
               f"or on the command line: " + " ".join(f"--set {o}" for o in best["overrides"])
               if best else "no single change fits: combine QLoRA, a smaller micro-batch and a shorter max_length")
        what = (f"two real optimizer steps on the worst micro-batch ran out of memory under a {usable:.2f} GiB cap "
                f"(estimate {est.total_gib:.2f} GiB; post-mortem {result_probe.postmortem})" if result_probe and not result_probe.ok
                else f"the need measured on this GPU, {need:.2f} GiB, exceeds what is usable" if result_probe
                else f"the estimated peak, {est.total_gib:.2f} GiB, exceeds")
        raise PreflightError(
            f"{what} for the worst micro-batch ({lengths.worst_batch_tokens} tokens, longest sample {lengths.longest_id}): "
            f"{usable:.2f} GiB usable of {budget:.2f} GiB on {device} (preflight.margin {cfg.preflight.margin:.0%}); {fix}. "
            f"Full table: {result.report_md}"
        )
    return result


def probe(cfg: RunConfig, worst_len: int, cap_gib: float, out_dir: Path, model=None, lengths: list[int] | None = None,
          rows: list[int] | None = None, descend: bool = True, eval_rows: list[int] | None = None) -> ProbeResult:
    """Two real optimizer steps on the worst micro-batch, built exactly as training builds it,
    with the process capped at `cap_gib` (torch.cuda.set_per_process_memory_fraction).

    Padded, the batch is the longest sample plus rows one token shorter, so dynamic padding and
    the padding mask appear as they will in training. Packed, it is one full token budget of
    the data's longest samples (`lengths`; without them, samples of `worst_len`).

    Args:
        model: an already built stage model (the memory grid reuses one across rows, docs/benchmarks.md: gpu_figure);
            None builds it here, which is what preflight does.
        rows: packed, the row lengths of the micro-batch to probe (the run's heaviest planned one), as they are.
        descend: after the two steps, find the smallest cap a step completes under (capped_step_need): the need.
        eval_rows: packed, the row lengths of an eval micro-batch fuller than `rows`: after the descent, the smallest
            cap its eval forward completes under, beside the optimizer states the steps left, as training's evals meet
            it; the need is the larger of the two.
    """
    import torch

    from stages.train import batches, kernels
    from stages.train.hf_trainer import make_trainer, release
    from stages.train.model import build_model

    total = torch.cuda.get_device_properties(0).total_memory
    settings = kernels.settings(cfg, worst_len)   # as the train stage resolves them for this data
    packed = settings.packing
    b = cfg.training.per_device_train_batch_size
    batch = (list(rows) if packed and rows else packing.worst_rows(lengths or [worst_len], batches.token_budget(cfg),
                                batches.samples_per_step(cfg) if cfg.training.packed_step == "samples" else None) if packed
             else [worst_len] + [max(1, worst_len - 1)] * (b - 1))
    memory.free_gpu()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total))
    torch.cuda.reset_peak_memory_stats()
    built, trainer = model is None, None
    built_pages, step_pages, need, build_peaks, eval_need = memory.page_need(), memory.page_need(), None, None, None
    try:
        with built_pages:
            if built:
                model = build_model(cfg, worst_len, settings)
        build_peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        torch.cuda.reset_peak_memory_stats()  # the steps' own peak: where the descent starts
        vocab = model.get_input_embeddings().num_embeddings
        gen = torch.Generator().manual_seed(0)
        rows = random_rows(batch, vocab, gen) + random_rows(batch, vocab, gen)
        train_data, collator = ((packing.PackedRows(rows, [list(range(len(batch))), list(range(len(batch), 2 * len(batch)))]),
                            batches.PackedCollator(varlen=settings.packed_attention == "varlen")) if packed
                           else (rows, batches.Collator(0)))
        trainer = make_trainer(
            cfg, model, train_data, collator, out_dir / "probe", settings=settings, max_steps=2, gradient_accumulation_steps=1,
            train_sampling_strategy="sequential", save_strategy="no", logging_steps=1000, disable_tqdm=True, logging_first_step=False,
        )
        with step_pages:
            trainer.train()
        if descend and step_pages.gib:
            need = capped_step_need(trainer, torch.cuda.max_memory_allocated() / GIB, step_pages.gib, total, cap_gib)
        if descend and need is not None and eval_rows:
            eval_need = capped_eval_need(trainer, random_rows(eval_rows, vocab, gen), eval_loss.collate_like(collator), total, cap_gib)
        ok, error, postmortem = True, None, None
    except torch.OutOfMemoryError as e:
        ok, error = False, str(e).split("\n")[0][:300]
        postmortem = out_dir / "probe_postmortem.txt"
        postmortem.write_text(f"{error}\n\nbatch rows: {batch}\n\n{torch.cuda.memory_summary()}")
    finally:
        peak_alloc = max(build_peaks[0] if build_peaks else 0, torch.cuda.max_memory_allocated()) / GIB
        peak_reserved = max(build_peaks[1] if build_peaks else 0, torch.cuda.max_memory_reserved()) / GIB
        if trainer is not None:
            release(trainer)
        if built:
            model = None
        del trainer
        memory.free_gpu()
        torch.cuda.set_per_process_memory_fraction(1.0)
    return ProbeResult(ok, round(peak_reserved, 4), round(peak_alloc, 4), round(cap_gib, 3), batch, postmortem, error,
                       pages_gib=_r4(step_pages.gib), build_pages_gib=_r4(built_pages.gib), step_need_gib=_r4(need),
                       eval_need_gib=_r4(eval_need))


def _r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def random_rows(lengths: list[int], vocab: int, gen) -> list[dict]:
    """Rows of these lengths of random token ids, every token a label: what the probe trains and evaluates on."""
    import torch

    return [{"input_ids": ids, "labels": ids} for ids in (torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths)]


def capped_step_need(trainer, lo: float, hi: float, total: int, cap_gib: float, tries: int = 6) -> float | None:
    """The smallest cap (GiB) under which one more optimizer step on the worst micro-batch completes (capped_need)."""
    trainer.args.max_steps = 1

    def step() -> None:
        try:
            trainer.train()
        finally:
            trainer.model.zero_grad(set_to_none=True)
            if trainer.offload is not None:
                trainer.offload.reset()

    return capped_need(step, lo, hi, total, cap_gib, tries)


def capped_eval_need(trainer, rows: list[dict], collate, total: int, cap_gib: float) -> float | None:
    """The smallest cap (GiB) under which the eval forward of one micro-batch of `rows` completes, the optimizer
    states of the steps before it still allocated, as at a training eval (eval_loss.measure, the Trainer's own)."""
    import torch

    def forward() -> None:
        eval_loss.measure(trainer.model, [rows], collate, trainer.args.device, trainer.accelerator.autocast)

    memory.free_gpu()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total))
    torch.cuda.reset_peak_memory_stats()
    pages = memory.page_need()
    with pages:
        forward()
    hi = pages.gib or torch.cuda.max_memory_reserved() / GIB  # no page figure (the record overflowed): what it reserved
    return capped_need(forward, torch.cuda.max_memory_allocated() / GIB, hi, total, cap_gib)


def capped_need(attempt, lo: float, hi: float, total: int, cap_gib: float, tries: int = 6) -> float | None:
    """The smallest cap (GiB) under which `attempt()` completes, found by bisection between its peak allocated (`lo`,
    never enough: pages hold more) and its page figure (`hi`, raised until it completes under it). Each try starts
    from an emptied cache, as a capped run's allocator is after it gave its free pages back; an OOM's frames are
    dropped before the next. None if it does not complete under `cap_gib`."""
    import traceback

    import torch

    def completes(cap: float) -> bool:
        memory.free_gpu()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GIB / total))
        try:
            attempt()
            return True
        except torch.OutOfMemoryError as e:
            traceback.clear_frames(e.__traceback__)
            return False

    while not completes(hi):
        if hi >= cap_gib:
            return None
        lo, hi = hi, min(cap_gib, hi * 1.05)
    for _ in range(tries):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if completes(mid) else (mid, hi)
    return hi


def packed_worst(cfg: RunConfig, tokenizer, planned, eval_rows: list[dict], lengths: LengthScan, notes: list[str]):
    """Packed, the micro-batches the probe and the estimate size: the run's own heaviest (its plan is fixed by the
    data, seed, budget and max_steps) into `lengths.planned`, the fullest eval one where it holds more tokens into
    `lengths.eval_planned` (with a note), the heavier's tokens into `lengths.worst_batch_tokens`. Returns the same
    count for a changed config (budget, processes), same data, for the suggestions."""
    lengths.planned = planned_worst(cfg, tokenizer, planned)
    fullest_eval = eval_worst(cfg, eval_rows)
    if sum(fullest_eval) > sum(lengths.planned):
        lengths.eval_planned = fullest_eval
        notes.append(f"the fullest eval micro-batch holds {sum(fullest_eval)} tokens, more than the "
                     f"{sum(lengths.planned)} of the heaviest the training plan holds: the probe measures its eval too")
    lengths.worst_batch_tokens = max(sum(lengths.planned), sum(fullest_eval))
    return lambda changed: max(sum(planned_worst(changed, tokenizer)), sum(eval_worst(changed, eval_rows)))


def planned_worst(cfg: RunConfig, tokenizer, planned=None) -> list[int]:
    """Row lengths of the heaviest packed micro-batch the run will train (stages.train.batches.heaviest); `planned`:
    the run's plan where `_plan` made it already."""
    from stages.train import batches

    ls = data.training_set(cfg, tokenizer).lengths
    return sorted((ls[i] for i in batches.heaviest(cfg, ls, cfg.training.world_size, planned)), reverse=True)


def _plan(cfg: RunConfig, tokenizer, packed: bool):
    """The micro-batches training will make (batches.dataset, without the rows), and its figures: what an optimizer
    step trains and how many epochs training.max_steps covers."""
    from dataclasses import asdict

    from stages.train import batches

    planned, plan = batches.dataset(cfg, None, packed, cfg.training.world_size, data.training_set(cfg, tokenizer).lengths)
    return planned, asdict(plan)


def check_held_out(cfg: RunConfig, tokenizer) -> list[str]:
    """The held-out file parses, renders with the chat template, its prompts fit the smoke test's context, and it is
    not the training data; returns a note when a few held-out samples are also training samples."""
    from stages import smoke

    samples = data.held_out(cfg, max(cfg.smoke.max_prompts, cfg.export.fidelity.samples, cfg.merge.samples))
    data.tokenize(samples, tokenizer, 1 << 30, "error")
    smoke.check_context(cfg, tokenizer)
    return held_out_overlap(cfg)


def check_content(cfg: RunConfig, tokenizer) -> list[str]:
    """Messages holding the text of a special token, training and held-out (the eval loss tokenizes every held-out
    sample): refused by file:line under data.special_tokens_in_content: error, a note naming them under plain."""
    plain = data.check_special_tokens(data.train_samples(cfg) + data.eval_samples(cfg), tokenizer, cfg.data.special_tokens_in_content)
    if not plain:
        return []
    return [f"{len(plain)} sample(s) hold special-token text in a message ({', '.join(plain[:3])}{', ...' if len(plain) > 3 else ''}), "
            "encoded as plain text (data.special_tokens_in_content: plain)"]


# Held-out samples that are training samples too, from which the eval data is refused: eval loss, the merge and
# fidelity checks, the smoke test and the champion comparison would measure recall of the training set.
OVERLAP_REFUSED = 0.10


def held_out_overlap(cfg: RunConfig) -> list[str]:
    """DataError when the held-out data is the training data (the same file, or mostly the same samples); a note
    naming the few shared samples otherwise."""
    held = data.eval_samples(cfg)
    if not held:
        return []
    train_paths = [cfg.data.train_file] if cfg.data.train_file else [Path(s.path) for s in cfg.data.sources]
    if cfg.data.eval_file is not None and any(p.exists() and Path(cfg.data.eval_file).resolve() == p.resolve() for p in train_paths):
        raise data.DataError(f"data.eval_file is the training file ({Path(cfg.data.eval_file).resolve()}): every held-out figure "
                             "(eval loss, fidelity, smoke, the champion comparison) would be measured on samples the model trained "
                             "on; point data.eval_file at held-out samples, or remove it and set data.eval_split: 0.05 to hold "
                             "some out of training")

    def key(s: data.Sample) -> str:
        return json.dumps(s.messages, sort_keys=True, default=str)

    trained = {key(s) for s in data.train_samples(cfg)}
    shared = [s.id for s in held if key(s) in trained]
    where = cfg.data.eval_file if cfg.data.eval_file is not None else "the data.eval_split samples"
    if len(shared) > OVERLAP_REFUSED * len(held):
        fix = (f"remove them from {where} (or remove data.eval_file and set data.eval_split, which holds samples out of training)"
               if cfg.data.eval_file is not None else "remove the repeated samples from the training data")
        raise data.DataError(f"{len(shared)} of the {len(held)} held-out samples in {where} are also training samples (e.g. "
                             f"{', '.join(shared[:3])}): the held-out figures would measure recall of the training set; {fix}")
    if shared:
        return [f"{len(shared)} of the {len(held)} held-out samples are also training samples ({', '.join(shared[:3])}"
                f"{', ...' if len(shared) > 3 else ''}); their figures are not held out"]
    return []


def scan_lengths(cfg: RunConfig, tokenizer=None) -> LengthScan:
    """Token lengths of the training data after data.long_sample_policy, from the tokenized set the
    train stage will read (data.training_set: made here on first use, cached by content)."""
    tokenizer = tokenizer or load_tokenizer(cfg.model)
    tset = data.training_set(cfg, tokenizer)
    ls = sorted(tset.lengths)

    def pct(p: float) -> int:
        return ls[min(len(ls) - 1, math.ceil(p * len(ls)) - 1)]

    longest = max(range(len(tset.lengths)), key=tset.lengths.__getitem__)
    top = ls[::-1][:MAX_LONGEST]
    return LengthScan(len(ls), pct(0.5), pct(0.95), pct(0.99), ls[-1], tset.rows[longest]["id"], tset.truncated, tset.dropped,
                      worst_batch_tokens=cfg.training.per_device_train_batch_size * ls[-1], longest=top)


def widen_for_eval(cfg: RunConfig, rows: list[dict], lengths: LengthScan, packed: bool) -> None:
    """The eval steps' share of the worst step. Eval runs micro-batches shaped like training's, forward
    only: no grads, no saved activations, and the fused loss (no logits) where training has it, so a
    training step of the same width bounds it (eval_loss.measure). Padded, an eval sample longer than
    every training one makes a wider micro-batch than training's own: the worst step is then sized by
    it. Packed, every eval micro-batch fits the same token budget, which must hold its longest sample
    (and the fullest of them may hold more tokens than any training one: eval_worst)."""
    if not rows:
        return
    i = max(range(len(rows)), key=lambda k: len(rows[k]["input_ids"]))
    longest = len(rows[i]["input_ids"])
    if longest <= lengths.max:
        return
    if packed and longest > batches.token_budget(cfg):
        raise ConfigError(f"training.max_tokens_per_batch is {batches.token_budget(cfg)}, shorter than the longest eval sample "
                          f"({longest} tokens, {rows[i]['id']}); set it to at least {longest}")
    if not packed:  # padded, the worst micro-batch is micro-batch x longest sample (as scan_lengths and resolve_auto size it)
        lengths.max, lengths.longest_id = longest, f"{rows[i]['id']} (eval)"
        lengths.worst_batch_tokens = cfg.training.per_device_train_batch_size * longest


def eval_worst(cfg: RunConfig, rows: list[dict]) -> list[int]:
    """Packed: the row lengths of the eval micro-batch holding the most tokens ([] without eval rows). Eval packs the
    held-out rows end to end to the training budget, so one can be fuller than every micro-batch the training plan
    holds, and the stock loss materialises its logits as training's does: a training step on it bounds its eval."""
    micro = eval_loss.micro_batches(cfg, rows, True)
    if not micro:
        return []
    return sorted((len(r["input_ids"]) for r in max(micro, key=lambda b: sum(len(r["input_ids"]) for r in b))), reverse=True)


MAX_LONGEST = 4096  # lengths kept for building the packed worst micro-batch (a budget of 4096 x 1-token samples)


def _with_loss(cfg: RunConfig, loss: str) -> RunConfig:
    return cfg.model_copy(update={"training": cfg.training.model_copy(update={"cross_entropy": loss})})


def suggest(cfg: RunConfig, s: Shapes, lengths: LengthScan, usable: float, on_gpu: bool, packed_tokens=None) -> list[dict]:
    """Single config changes, each re-estimated, ranked by predicted saving.

    packed_tokens: config -> the tokens of its heaviest planned packed micro-batch (None: the budget); a change to
    the data (max_length, dropping) is estimated at its budget.

    Each carries `overrides` (for --set), a YAML `diff`, and `rank`: how much it changes
    the run, lowest first. Same maths, only slower: chunked loss, micro-batch traded for
    accumulation, checkpointing; then numerics: 8-bit optimizer, QLoRA; last, data: drop.
    """
    t = cfg.training
    options = []  # (rank, overrides, seq)
    if on_gpu and loss_mode(cfg, on_gpu) == "plain" and loss_mode(_with_loss(cfg, "chunked"), on_gpu) != "plain":
        options.append((0, {"training.cross_entropy": "chunked"}, lengths.max))
    if (half := batches.halved(cfg, lengths.packed, lengths.max)) is not None:
        options.append((1, half, lengths.max))
    if not t.gradient_checkpointing:
        options.append((2, {"training.gradient_checkpointing": True}, lengths.max))
    if resolve_auto(cfg, on_gpu=on_gpu, longest=lengths.max)["optim"] in ("adamw_torch", "adamw_torch_fused"):
        options.append((3, {"training.optim": "paged_adamw_8bit"}, lengths.max))
    if not cfg.quantization.load_in_4bit:
        options.append((4, {"quantization.load_in_4bit": True}, lengths.max))
    if cfg.lora.r > 8:  # less adapter capacity: changes what the run can learn
        options.append((4, {"lora.r": cfg.lora.r // 2}, lengths.max))
    if lengths.p99 < lengths.max:
        options.append((5, {"data.max_length": lengths.p99, "data.long_sample_policy": "drop"}, lengths.p99))
    sharded = fsdp_over(cfg, s, lengths.max, usable, on_gpu, packed_tokens) if on_gpu and t.distributed != "fsdp" else None
    if sharded:  # more GPUs, same run
        options.append((6, {"training.launcher": "accelerate", "training.distributed": "fsdp", "training.num_processes": sharded[0]},
                        lengths.max))
    tokens = packed_tokens or (lambda c: None)
    base = estimate(cfg, s, lengths.max, on_gpu, packed_tokens=tokens(cfg)).total_gib
    resolved = resolve_auto(cfg, on_gpu=on_gpu) | {"cross_entropy": loss_mode(cfg, on_gpu)}
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
        # the packed budget as the changed run would widen it on this card (a shorter max_length packs differently)
        changed = widen.on_card(batches.with_card_budget(changed, None, ""), s, seq, usable, on_gpu)
        total = estimate(changed, s, seq, on_gpu, packed_tokens=None if "data" in patch else tokens(changed)).total_gib
        if base - total < 0.001:  # saves nothing measurable on this model
            continue
        diff = "\n".join(
            f"{section}:\n" + "\n".join(f"  {k}: {json.dumps(v)}  # was {json.dumps(getattr(getattr(cfg, section), k))}" for k, v in fields.items())
            for section, fields in patch.items())
        sets = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
        out.append({"change": " ".join(sets), "overrides": sets, "diff": diff, "rank": rank, "estimate_gib": total,
                    "saving_gib": round(base - total, 3), "fits": total <= usable})
    return sorted(out, key=lambda o: -o["saving_gib"])


def fsdp_over(cfg: RunConfig, s: Shapes, longest: int, usable: float, on_gpu: bool, packed_tokens=None) -> tuple[int, float] | None:
    """The fewest GPUs (of 2, 4, 8) that distributed: fsdp needs for the estimate to fit, with that estimate per GPU."""
    for n in (2, 4, 8):
        t = cfg.training.model_copy(update={"launcher": "accelerate", "distributed": "fsdp", "num_processes": n, "num_machines": 1})
        changed = cfg.model_copy(update={"training": t})
        total = estimate(changed, s, longest, on_gpu, packed_tokens=packed_tokens and packed_tokens(changed)).total_gib
        if total <= usable:
            return n, total
    return None


def smallest_fix(suggestions: list[dict]) -> dict | None:
    """The least invasive change that fits (see `suggest`), or None."""
    fitting = [x for x in suggestions if x["fits"]]
    return min(fitting, key=lambda x: (x["rank"], -x["estimate_gib"])) if fitting else None


def headline(r: PreflightResult, cfg: RunConfig) -> str:
    """The verdict and what decided it: the probe's measurement where it ran, else the estimate."""
    verdict = "FITS" if r.fits else "DOES NOT FIT"
    budget = (f"{r.usable_gib:.2f} GiB usable of {r.budget_gib:.2f} GiB on {r.device} (margin {cfg.preflight.margin:.0%}"
              + (f", CUDA context {CUDA_CONTEXT_GIB} GiB)" if r.device != "cpu" else ")"))
    p = r.probe
    if p and p.ok and r.need_gib:
        by_eval = (p.eval_need_gib or 0.0) > p.step_need_gib
        what = "the eval forward of the fullest eval micro-batch" if by_eval else "one optimizer step on the worst micro-batch"
        return (f"Preflight: {verdict}, measured: this run needs {r.need_gib:.2f} GiB on this GPU ({what} "
                f"completed under a {max(p.step_need_gib, p.eval_need_gib or 0.0):.2f} GiB cap and no lower, x {NEED_SCALE} + {NEED_PLUS_GIB} GiB for "
                f"the rest of the run); {budget}. The estimate below, {r.estimate.total_gib:.2f} GiB, is from config.json alone, what a card "
                f"must have where nothing measures (docs/preflight.md: how both were validated).")
    if p and p.ok:
        return (f"Preflight: {verdict}, measured: two real optimizer steps on the worst micro-batch ran under a {p.cap_gib:.2f} GiB cap, "
                f"peak {p.peak_alloc_gib:.2f} GiB allocated / {p.peak_reserved_gib:.2f} GiB reserved; {budget}. "
                f"The estimate below, {r.estimate.total_gib:.2f} GiB, is what a card must have for this run (a run capped there completes).")
    if p:
        return (f"Preflight: {verdict}, measured: two real optimizer steps on the worst micro-batch ran out of memory under the "
                f"{p.cap_gib:.2f} GiB cap; {budget}. The estimate below said {r.estimate.total_gib:.2f} GiB.")
    why = ("no CUDA device here to measure on" if r.device == "cpu" else "preflight.probe is off" if not cfg.preflight.probe
           else "distributed: fsdp: one process cannot probe a sharded step; train/memory.json records each process's peak"
           if cfg.training.distributed == "fsdp" else f"over {PROBE_IF_UNDER:.1f}x the usable memory: not worth a probe")
    per = (f" per GPU (each of {cfg.training.world_size} processes holds 1/{cfg.training.world_size} of the sharded model)"
           if cfg.training.distributed == "fsdp" else "")
    return (f"Preflight: {verdict}, estimated: {r.estimate.total_gib:.2f} GiB{per} (what a card must have for this run: a run capped "
            f"there completes) for {budget} ({why}).")


def _plan_line(steps: dict) -> str:
    from stages.train import batches

    return batches.Plan(**steps).describe() if steps else "not planned"


def render(r: PreflightResult, cfg: RunConfig) -> str:
    L = r.lengths
    lines = [
        f"## {headline(r, cfg)}",
        "",
        (f"Worst micro-batch: packed, {L.worst_batch_tokens} tokens ({len(L.planned)} samples): the heaviest the run's plan holds "
         f"over training.max_steps ({cfg.training.max_steps}) under a {batches.token_budget(cfg)}-token budget (longest sample {L.max} tokens, "
         f"{L.longest_id}). "
         if L.packed else f"Worst micro-batch: {cfg.training.per_device_train_batch_size} x {L.max} tokens (longest sample {L.longest_id}). ")
        + f"Lengths over {L.n_samples} samples: p50 {L.p50}, p95 {L.p95}, p99 {L.p99}, max {L.max}. "
        f"Truncated: {len(L.truncated)}, dropped: {len(L.dropped)}.",
        "",
        f"LoRA adapts {r.adapted}." + "".join(f" {n}." for n in r.target_notes),
        *(["", "Data: " + "; ".join(r.data_notes) + "."] if r.data_notes else []),
        "",
        f"Steps: {_plan_line(r.steps)}.",
        *(["", f"Plan: {cfg.training._fit_reason}."] if cfg.training.fit == "auto" and cfg.training._fit_reason else []),
        "",
        "| item | GiB |",
        "|---|---|",
        *[f"| {k} | {v:.3f} |" for k, v in r.estimate.items_gib.items()],
        f"| **total** | **{r.estimate.total_gib:.3f}** |",
    ]
    if r.probe:
        p = r.probe
        lines += ["", f"Probe (two real optimizer steps on rows {p.batch}, capped at {p.cap_gib:.2f} GiB): "
                  + (f"peak reserved {p.peak_reserved_gib:.2f} GiB, allocated {p.peak_alloc_gib:.2f} GiB"
                     + (f"; pages touched at most {p.pages_gib:.2f} GiB (model build {p.build_pages_gib or 0:.2f}); one more step completed "
                        f"under {p.step_need_gib:.2f} GiB and no lower (bisection)" if p.step_need_gib else "")
                     + (f"; the eval forward of the fullest eval micro-batch ({sum(r.lengths.eval_planned)} tokens) under "
                        f"{p.eval_need_gib:.2f} GiB" if p.eval_need_gib else "") + "." if p.ok
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
    ap.add_argument("--train-only", action="store_true", help="the export runs elsewhere: skip its tool and disk checks")
    a = ap.parse_args(argv)
    cfg = inputs.load(a.config, a.set)
    from stages.paths import RunPaths

    run(cfg, a.out or RunPaths.for_run(cfg).stage("preflight"), a.gpu_memory_gib, train_only=a.train_only)


if __name__ == "__main__":
    import sys

    from stages.errors import run_cli

    sys.exit(run_cli(main, "preflight"))
