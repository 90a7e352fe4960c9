"""The train stage's own MoE QLoRA path, at its defaults, against plain peft + the HF Trainer, on the same samples.

Where bench/moe_speed and bench/moe_qlora time hand-built steps on full-length random rows, this one times what a
user runs: `stage` builds the model through stages.train.model.build_model (the defaults a GPU resolves: NF4 experts,
the grouped expert LoRA, Liger, packing with varlen attention, fit: memory's offloads, 8-bit paged AdamW) and trains
it with the stage's own Trainer (stages.train.hf_trainer.make_trainer) over the stage's own micro-batch plan
(stages.train.batches.dataset); `peft` is plain peft 0.21 target_parameters on the bf16 base, HF Trainer, dynamic
padding, torch AdamW, gradient checkpointing, no Liger (the issue's baseline). Only the base's load differs from a
real run: the model is built at a released model's shapes (random init, on the GPU) and, under QLoRA, quantized in
place the way stages.model.load.load_base stores it (bench/moe_qlora's quantize_in_place), because a 57 GiB checkpoint
does not fit the device's disk.

Same settings in both: micro-batch 2, data.max_length 2048, a step of `--samples` samples (padded: micro-batch x
gradient accumulation; packed_step: samples lays the same samples end to end into micro-batches of at most
2 x 2048 tokens), LoRA r 16 / alpha 32 on attention and every routed expert. Two data sets, each trained once by
both, in this order: `longtail` (log-normal lengths, median 512, sigma 1.02, capped at 2048: chat data) and `full`
(every sample 2048 tokens, the issue's 2 x 2048). Before each timed run, a one-step run on other rows of the same
kind warms kernels and the allocator. Timed: trainer.train() of `--steps` steps over exactly steps x samples rows, so
both methods train the very same samples; samples/s is exact, tokens/s counts what the top-level forward received
(padding excluded). Peak reserved is torch's over the timed run; 8-bit paged optimizer states (CUDA managed memory,
outside torch's allocator) are reported apart.

    python bench/moe_stage_speed/run.py peft  --out $OUT/peft.json  [--shape qwen3-30b-a3b]
    python bench/moe_stage_speed/run.py stage --out $OUT/stage.json
    python bench/moe_stage_speed/run.py merge $OUT/moe_stage_speed.json $OUT/peft.json $OUT/stage.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))



def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_run", ROOT / "bench" / name / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_speed, _qlora, _profile = _load("moe_speed"), _load("moe_qlora"), _load("moe_profile")
# a CPU dry run's shape: the same family, small enough for two cores
SHAPES = _speed.SHAPES | {"tiny-qwen3-moe": dict(_speed.SHAPES["qwen3-30b-a3b"], hidden_size=64, intermediate_size=128,
                                                 moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                                 vocab_size=512),
                           # the 30B's layer shapes, 4 layers of 48: where the host waits, in a minute of device time
                           "qwen3-30b-a3b-4-layers": dict(_speed.SHAPES["qwen3-30b-a3b"], num_hidden_layers=4),
                           # GPT-OSS-20B's published config: 32 experts top-4 with biases, attention sinks, every other
                           # layer a 128-token window (no SDPA path in transformers: flex_attention on a GPU)
                           "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                                               num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                                               head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                                               sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
                                               max_position_embeddings=131072, tie_word_embeddings=False),
                           "tiny-gpt-oss": dict(model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                                                num_experts_per_tok=2, vocab_size=512, sliding_window=32,
                                                layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False),
                           "tiny-olmoe": dict(_speed.SHAPES["olmoe-1b-7b"], hidden_size=64, intermediate_size=32,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                              num_experts=8, num_experts_per_tok=2, vocab_size=512)}
ON_GPU = torch.cuda.is_available()


def lengths(kind: str, n: int, cap: int, seed: int) -> list[int]:
    """`longtail`: log-normal, median cap/4, sigma 1.02, in [16, cap]; `full`: every sample `cap` tokens."""
    if kind == "full":
        return [cap] * n
    rng = random.Random(seed)
    return [max(16, min(cap, round(rng.lognormvariate(math.log(cap / 4), 1.02)))) for _ in range(n)]


def rows(kind: str, n: int, cap: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids} for ids in
            (torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths(kind, n, cap, seed))]


class Counter:
    """Tokens the top-level model's forward receives (padding excluded), whichever Trainer calls it."""

    def __init__(self, model) -> None:
        self.tokens = 0
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, args, kwargs):
        mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids", args[0] if args else None)
        if torch.is_tensor(mask) and mask.dim() == 2:
            self.tokens += int(mask.sum())
        elif torch.is_tensor(ids):
            self.tokens += ids.numel()


def timer():
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        """The run's wall time, and each optimizer step's end: the steps after the first are the steady state (the
        first also creates the optimizer's states, which a long run pays once)."""

        def __init__(self) -> None:
            self.begin = self.end = 0.0
            self.step_ends: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize() if ON_GPU else None
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize() if ON_GPU else None
            self.step_ends.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize() if ON_GPU else None
            self.end = time.perf_counter()

    return Timer()


def measured(trainer, counter: Counter, clock, samples: int, steps: int) -> dict:
    """trainer.train() from a fresh peak: samples/s (the whole run, and `steady_` the steps after the first),
    tokens/s, peak memory, paged optimizer states."""
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = counter.tokens
    out = trainer.train()
    dt = clock.end - clock.begin
    row = {"steps": out.global_step, "samples": samples * steps, "s": round(dt, 3),
           "samples_per_s": round(samples * steps / dt, 3), "tokens": counter.tokens - before,
           "tokens_per_s": round((counter.tokens - before) / dt, 1), "final_loss": round(out.training_loss, 4)}
    if len(clock.step_ends) >= 2:
        row["steady_samples_per_s"] = round(samples * (len(clock.step_ends) - 1) / (clock.step_ends[-1] - clock.step_ends[0]), 3)
        row["first_step_s"] = round(clock.step_ends[0] - clock.begin, 3)
    if ON_GPU:
        row |= {"peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
                "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)   # accelerate wraps it
    if getattr(inner, "is_paged", False):   # bitsandbytes' paged states: CUDA managed memory, outside torch's peak
        states = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
        row["paged_states_gib"] = round(sum(v.numel() * v.element_size() for v in states) / 2**30, 3)
    return row


def base_builder(shape: dict):
    """stages.model.load.load_base's stand-in: the shapes built on the device from their config (random init, seeded),
    under QLoRA quantized in place as load_base stores them (linear layers and expert stacks NF4)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils.quantization_config import QuantizationMethod

    def config():
        spec = dict(shape)
        return AutoConfig.for_model(spec.pop("model_type"), **spec)

    def attention(requested: str) -> str:   # what load_base passes: `auto` resolved for the family and device
        from stages.model import architecture, load

        return load.attention_for(requested, architecture.from_config_text(config().to_json_string()))

    def load_base(model, quant, *, quantized=None, sharded=False):
        torch.manual_seed(0)
        dtype = torch.bfloat16 if ON_GPU else torch.float32
        with torch.device("cuda" if ON_GPU else "cpu"):
            m = AutoModelForCausalLM.from_config(config(), dtype=dtype, attn_implementation=attention(model.attn_implementation))
        if quant.load_in_4bit if quantized is None else quantized:
            _qlora.quantize_in_place(m, "cuda" if ON_GPU else "cpu", dtype)
            m.quantization_method = QuantizationMethod.BITS_AND_BYTES   # as from_pretrained marks it: no .to()
        return m

    return load_base


def stage_config(model_dir: Path, args, kind: str, steps: int, overrides: dict):
    from stages.config import RunConfig

    raw = {"model": {"name_or_path": str(model_dir), "torch_dtype": "auto"},   # attention: the default, auto
           "data": {"train_file": str(model_dir / "unused.jsonl"), "max_length": args.max_length},
           "lora": {"r": args.r, "lora_alpha": 2 * args.r, "lora_dropout": 0.0, "target_modules": "all-linear"},
           "quantization": {"load_in_4bit": args.qlora},
           "training": {"per_device_train_batch_size": args.batch, "gradient_accumulation_steps": args.samples // args.batch,
                        "max_steps": steps, "learning_rate": 1e-4, "warmup_steps": 0, "save_steps": 10_000,
                        "logging_steps": 10_000, "seed": 0},
           "handoff": {"model_name": "bench"}}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        raw.setdefault(section, {})[name] = value
    return RunConfig.model_validate(raw)


def write_model_dir(shape: dict, where: Path) -> Path:
    """config.json and a placeholder weights file: what architecture.of_model and resolve_model_dir read."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    spec = dict(shape)
    AutoConfig.for_model(spec.pop("model_type"), **spec).save_pretrained(where)
    save_file({"placeholder": torch.zeros(1)}, str(where / "model.safetensors"))
    return where


class SyncStacks:
    """torch's CUDA sync debug mode warning at every synchronizing op between start() and stop(); the Python
    stacks that warned, by count (`found()`)."""

    def __init__(self) -> None:
        import collections
        import warnings

        self.seen: collections.Counter = collections.Counter()
        self._catch = warnings.catch_warnings()

    def _record(self, message, category, filename, lineno, file=None, line=None):
        import traceback

        frames = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and "warnings" not in f.filename][-7:]
        self.seen[(str(message)[:80], tuple(frames))] += 1

    def start(self) -> None:
        import warnings

        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(None, None, None)

    def found(self) -> list[dict]:
        return [{"calls": n, "what": m, "stack": list(st)} for (m, st), n in self.seen.most_common(20)]


def profiled_after_first(trainer, stacks: bool) -> dict:
    """trainer.train() of 2 optimizer steps, the second one under torch.profiler (and with `stacks` torch's sync
    debug mode): a steady step, not the first, which also creates the optimizer's states."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    p = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    syncs = SyncStacks() if stacks else None
    window = {}

    class Window(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                torch.cuda.synchronize()
                window["t0"] = time.perf_counter()
                p.start()
                syncs.start() if syncs else None

        def on_train_end(self, args, state, control, **kwargs):
            syncs.stop() if syncs else None
            torch.cuda.synchronize()
            window["wall"] = time.perf_counter() - window["t0"]
            p.stop()

    trainer.add_callback(Window())
    trainer.train()
    try:
        timeline = streams(p)
    except Exception as e:  # noqa: BLE001 - the kernel summary stands without it
        timeline = {"error": repr(e)}
    return _profile.summary(p, window["wall"], 1) | {"streams": timeline} | ({"host_syncs": syncs.found()} if syncs else {})


def streams(p, gap_ns: int = 5_000, after_ns: int = 30_000) -> dict:
    """Where the compute stream (the one with the most kernel time) sat idle in a profiled window: each gap of at
    least `gap_ns` is put down to a copy on another stream when one ended inside it and compute started again within
    `after_ns` of that end (a wait on the copy's event), else to the host (nothing queued yet). Also how much of the
    other streams' copy time ran beside compute."""
    every = p.profiler.kineto_results.events()
    events = [e for e in every if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0]
    runtime = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()) for e in every
                     if e.device_type() == torch.autograd.DeviceType.CPU and e.name().startswith("cu") and e.duration_ns() > 100_000)
    by_stream: dict[int, list] = {}
    for e in events:
        by_stream.setdefault(e.device_resource_id(), []).append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()))
    if not by_stream:
        return {}
    compute = max(by_stream, key=lambda s: sum(b - a for a, b, _ in by_stream[s]))
    busy = []   # compute's busy intervals, merged
    for a, b, _ in sorted(by_stream[compute]):
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    copies = sorted((a, b, n) for s, ev in by_stream.items() if s != compute for a, b, n in ev if "Memcpy" in n)
    waits = {"host": [0, 0.0]}
    t0 = busy[0][0]
    big = []   # the gaps over 0.5 ms in order, with the host's long runtime calls during them
    for (_, g0), (g1, _) in zip(busy, busy[1:], strict=False):
        if g1 - g0 < gap_ns:
            continue
        ended = [c for c in copies if g0 <= c[1] <= g1 and g1 - c[1] <= after_ns]
        key = ("waited for " + ended[-1][2].split(" (")[0]) if ended else "host"
        if g1 - g0 > 500_000 and len(big) < 60:
            after = min((e for e in by_stream[compute] if e[0] >= g1), default=(0, 0, ""))[2][:60]
            big.append({"at_ms": round((g0 - t0) / 1e6, 2), "ms": round((g1 - g0) / 1e6, 2), "cause": key, "then": after,
                        "host_calls": [f"{n} {round((b - a) / 1e6, 2)}" for a, b, n in runtime if a < g1 and b > g0][:6]})
        w = waits.setdefault(key, [0, 0.0])
        w[0] += 1
        w[1] += (g1 - g0) / 1e6

    def overlapped(a: int, b: int) -> int:
        return sum(max(0, min(b, y) - max(a, x)) for x, y in busy if y > a and x < b)

    side = {}
    for a, b, n in copies:
        k = side.setdefault(n.split(" (")[0], {"calls": 0, "ms": 0.0, "beside_compute_ms": 0.0})
        k["calls"] += 1
        k["ms"] += (b - a) / 1e6
        k["beside_compute_ms"] += overlapped(a, b) / 1e6
    span = (busy[-1][1] - busy[0][0]) / 1e6
    timeline = [{"copy": n.split(" (")[0], "at_ms": round((a - t0) / 1e6, 2), "ms": round((b - a) / 1e6, 2),
                 "beside_compute_ms": round(overlapped(a, b) / 1e6, 2)} for a, b, n in copies[:60]]
    return {"compute_stream": compute, "span_ms": round(span, 1), "compute_busy_ms": round(sum(b - a for a, b in busy) / 1e6, 1),
            "idle_ms_by_cause": {k: {"gaps": n, "ms": round(ms, 1)} for k, (n, ms) in waits.items()},
            "side_copies": {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in side.items()},
            "other_streams": {s: round(sum(b - a for a, b, _ in ev) / 1e6, 1) for s, ev in by_stream.items() if s != compute},
            "gaps_over_half_ms": big, "copies": timeline}


def _before():
    """stages/model/experts/lora.py as it was before a change, saved beside this script (`before` variant: an A/B in one
    process; not committed)."""
    spec = importlib.util.spec_from_file_location("before_expert_lora", Path(__file__).with_name("_before_expert_lora.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_stage(args, shape: dict, work: Path) -> dict:
    from stages.model.experts import lora as expert_lora
    from stages.train import batches, kernels, widen
    from stages.train import model as train_model
    from stages.train.hf_trainer import make_trainer
    from stages.train.stage import choose_fit

    overrides = dict(o.split("=", 1) for o in args.set)
    overrides = {k: json.loads(v) if v[:1] in "0123456789[{tn" else v for k, v in overrides.items()}
    model_dir = write_model_dir(shape, work / "model")
    train_model.load_base = base_builder(shape)   # the one stand-in: the base from a config, not from disk
    cfg = stage_config(model_dir, args, "longtail", 1, overrides)
    settings = kernels.settings(cfg, args.max_length)
    model = train_model.build_model(cfg, args.max_length, settings)
    counter = Counter(model)
    out = {"settings": {k: v for k, v in vars(settings).items()}, "overrides": overrides,
           "weights_gib": round(torch.cuda.memory_allocated() / 2**30, 3) if ON_GPU else None, "runs": {}}
    forwards = {"stage": expert_lora.grouped_lora_forward} | (
        {"before": _before().grouped_lora_forward} if "before" in args.variants else {})
    fit_done = False
    for kind, budget, variant in [(k, b, v) for k in args.data for b in (args.budgets or [None]) for v in args.variants]:
        at = {} if budget is None else {"training.max_tokens_per_batch": budget}
        expert_lora.grouped_lora_forward = forwards[variant]
        for phase, steps, seed in (("warmup", 1, 100), ("timed", args.steps, 1)):
            cfg = stage_config(model_dir, args, kind, steps, overrides | at)
            data = rows(kind, steps * args.samples, args.max_length, shape["vocab_size"], seed)
            lens = [len(r["input_ids"]) for r in data]
            if budget is None:   # the default: the budget this card widens it to, as the stage's run() does
                cfg = widen.in_training(cfg, max(lens))
            dataset, plan = batches.dataset(cfg, data, settings.packing, 1, lens)
            collator = (batches.PackedCollator(varlen=settings.packed_attention == "varlen") if settings.packing
                        else batches.Collator(0))
            if not fit_done:   # once, on the heaviest micro-batch the data can make, as the stage does
                out["fit"] = vars(choose_fit(cfg, model, data, collator, work / "fit", lens, settings))
                fit_done = True
            clock = timer()
            trainer = make_trainer(cfg, model, dataset, collator, work / f"{kind}-{phase}", callbacks=[clock], settings=settings,
                                   disable_tqdm=True)
            r = measured(trainer, counter, clock, args.samples, steps)
            r["plan"] = plan.describe()
            name = f"{kind}-{phase}" + (f"@{budget}" if budget else "") + ("" if variant == "stage" else f"-{variant}")
            out["runs"][name] = r
            print("stage", kind, phase, budget or "", variant, r, flush=True)
            del trainer
        if phase == "timed" and ON_GPU and budget in (args.profile or []) and variant == args.variants[0]:
            cfg = stage_config(model_dir, args, kind, 2, overrides | at)
            data = rows(kind, 2 * args.samples, args.max_length, shape["vocab_size"], 7)
            if budget is None:
                cfg = widen.in_training(cfg, max(len(r["input_ids"]) for r in data))
            dataset = batches.dataset(cfg, data, settings.packing, 1, [len(r["input_ids"]) for r in data])[0]
            # no checkpoint save at the end: the window is the second step alone (a save inside it once passed
            # for the step's own host copies, README "Steady steps")
            trainer = make_trainer(cfg, model, dataset, collator, work / "profile", settings=settings, disable_tqdm=True,
                                   save_strategy="no")
            out["profile"] = {"at": name, "step": 2, **profiled_after_first(trainer, args.stacks)}
            print("profile", json.dumps(out["profile"])[:3000], flush=True)
            del trainer
    return out


def run_peft(args, shape: dict, work: Path) -> dict:
    from transformers import Trainer, TrainingArguments

    # attention: the product's `auto` for the family (SDPA; flex_attention on a GPU where SDPA would skip sinks or
    # soft-capping), so both methods compute the same attention
    model = base_builder(shape)(type("M", (), {"attn_implementation": "auto"})(), None, quantized=False)
    model, targets = _qlora.adapt(model, args.r)   # all-linear, experts included, checkpointed: the benches' plain peft
    counter = Counter(model)
    out = {"adapted": targets.summary(args.r), "runs": {},
           "weights_gib": round(torch.cuda.memory_allocated() / 2**30, 3) if ON_GPU else None}

    def pad(batch: list[dict]) -> dict:
        width = max(len(r["input_ids"]) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    for kind in args.data:
        for phase, steps, seed in (("warmup", 1, 100), ("timed", args.steps, 1)):
            data = rows(kind, steps * args.samples, args.max_length, shape["vocab_size"], seed)
            targs = TrainingArguments(output_dir=str(work / f"peft-{kind}-{phase}"), per_device_train_batch_size=args.batch,
                                      gradient_accumulation_steps=args.samples // args.batch, max_steps=steps,
                                      learning_rate=1e-4, bf16=ON_GPU, optim="adamw_torch", logging_steps=10_000,
                                      save_strategy="no", report_to=[], remove_unused_columns=False, disable_tqdm=True,
                                      use_cpu=not ON_GPU, seed=0)
            clock = timer()
            trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=pad, callbacks=[clock])
            r = measured(trainer, counter, clock, args.samples, steps)
            out["runs"][f"{kind}-{phase}"] = r
            print("peft", kind, phase, r, flush=True)
            del trainer
    return out


def merge(dest: str, files: list[str]) -> None:
    """One JSON of the methods run in their own processes, with each timed run's ratios over peft's."""
    runs = {}
    for f in files:
        if Path(f).is_file():
            d = json.loads(Path(f).read_text())
            runs[d["method"]] = d
    out = {"methods": runs, "vs_peft": {}}
    baseline = next((n for n in runs if n.split("-")[0] == "peft"), "peft")   # peft, or peft-<shape>
    peft = runs.get(baseline, {}).get("result", {}).get("runs", {})
    for name, d in runs.items():
        for key, r in d.get("result", {}).get("runs", {}).items():
            p = peft.get(key.split("@")[0])
            if name == baseline or not p or not key.split("@")[0].endswith("timed") or "samples_per_s" not in r:
                continue
            out["vs_peft"].setdefault(name, {})[key] = {
                "speed": round(r["samples_per_s"] / p["samples_per_s"], 3),
                **({"steady_speed": round(r["steady_samples_per_s"] / p["steady_samples_per_s"], 3)}
                   if "steady_samples_per_s" in r and "steady_samples_per_s" in p else {}),
                **({"peak_reserved": round(r["peak_reserved_gib"] / p["peak_reserved_gib"], 3)} if "peak_reserved_gib" in r else {}),
                **({"peak_reserved_with_paged_states": round((r["peak_reserved_gib"] + r.get("paged_states_gib", 0))
                                                             / p["peak_reserved_gib"], 3)} if "peak_reserved_gib" in r else {})}
    Path(dest).write_text(json.dumps(out, indent=2))
    print(json.dumps(out["vs_peft"], indent=1))


def main() -> None:
    if sys.argv[1:2] == ["merge"]:
        return merge(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser()
    ap.add_argument("method", choices=["peft", "stage"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", help="the method's name in the merged JSON (default: the method; e.g. stage-speed)")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--data", nargs="+", default=["longtail", "full"], choices=["longtail", "full"])
    ap.add_argument("--samples", type=int, default=16, help="samples per optimizer step")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per data set")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--bf16", dest="qlora", action="store_false", help="stage: the 16-bit base instead of QLoRA")
    ap.add_argument("--budgets", type=int, nargs="+", help="stage: train each data set once per packed micro-batch "
                    "budget (training.max_tokens_per_batch), in one process; runs are named <data>-timed@<budget>")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="stage: a config override")
    ap.add_argument("--variants", nargs="+", default=["stage"], choices=["stage", "before"],
                    help="stage: the product's grouped expert LoRA and/or `before`, stages/model/experts/lora.py as it was before "
                    "a change (saved beside this script as _before_expert_lora.py, not committed), each timed in this "
                    "process; before runs are named <run>-before")
    ap.add_argument("--stacks", action="store_true", help="stage: the profiled step also says where the host syncs "
                    "(torch.cuda.set_sync_debug_mode: the Python stacks of every synchronizing op, by count)")
    ap.add_argument("--profile", type=int, nargs="*", help="stage: after the timed runs at these budgets, two more steps "
                    "of the first variant, the second under torch.profiler (kernels by kind, GPU busy share)")
    args = ap.parse_args()
    import peft
    import transformers

    out = {"method": args.name or args.method, "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name() if ON_GPU else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "peft": peft.__version__, "settings": vars(args)}
    with tempfile.TemporaryDirectory() as work:
        try:
            out["result"] = (run_peft if args.method == "peft" else run_stage)(args, SHAPES[args.shape], Path(work))
        except Exception:  # noqa: BLE001  (recorded: the merge reports what ran)
            import traceback
            out["error"] = traceback.format_exc()[-4000:]
            print(out["error"], flush=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
