"""The train stage beside the tools users would pick instead: Unsloth, peft + Liger, plain peft. Same model shapes,
same samples in the same order, same LoRA, same samples per optimizer step; each tool in its own process with its
own recommended fast settings.

    python bench/peers/run.py make  --shape llama-3.1-8b --dir /tmp/peers/llama-3.1-8b
    python bench/peers/run.py TOOL  --shape llama-3.1-8b --dir /tmp/peers/llama-3.1-8b --data full longtail --out x.json
    python bench/peers/run.py merge bench/peers/results.json x.json y.json ...

TOOL is one of
  unsloth     Unsloth's FastLanguageModel (its 4-bit load, its LoRA patches, use_gradient_checkpointing="unsloth"),
              trained by TRL's SFTTrainer as Unsloth patches it (padding-free batches where it decides so, which on
              a Hopper GPU it always does), optim adamw_8bit: what its notebooks run.
  stage       the train stage at the product's defaults: stages.model.load.load_base from the checkpoint on disk,
              stages.train.model.build_model, the stage's micro-batch plan, fit and Trainer (the widening and
              fit: auto as its run() decides them on this card); `--set section.key=value` changes one setting.
  peft-liger  peft 0.21 + Liger Kernel 0.8.5 (the family's class patch: fused linear cross-entropy, RMSNorm, SwiGLU,
              RoPE), HF Trainer, dynamically padded micro-batches, non-reentrant gradient checkpointing, torch AdamW.
  peft        the same without Liger: the floor.

QLoRA is NF4 with double quantization and a bf16 compute type in every tool (`--bf16`: a 16-bit base instead). LoRA
r 16, alpha 32, dropout 0 on every linear layer of the decoder. The checkpoint is random-init from the release's
config.json values (speed and memory depend on the shapes, not on the values), with a word-level tokenizer of the
release's vocabulary size (the rows are token ids).

Data (`--data`), the same rows for every tool, trained in order (train_sampling_strategy: sequential):
  full       every sample 4,096 tokens, 2 samples a step, all tokens carry the loss
  longtail   log-normal lengths (median 512, sigma 1.02, capped at 8,192: bench/packing_speed's distribution), the
             first 30% of each sample a prompt without loss, 8 samples a step
  long       one 32,768-token sample a step
Micro-batches: Unsloth and peft take Unsloth's notebook recipe, 2 samples x accumulation (longtail: 2 x 4); the stage
takes its own default, one micro-batch of the step's samples (per_device_train_batch_size = samples a step, packed).

Timed: `--steps` optimizer steps in one trainer.train(); rates are over the steps after the first (the first
compiles, autotunes and creates the optimizer states). tokens/s counts what the top-level model's forward received
(padding excluded), loss_tokens/s the labels that are not -100. Peak reserved is torch's over the whole run, plus
bitsandbytes' paged optimizer states where a tool keeps them outside torch's allocator. The loss of every step is
kept: the tools must train the same thing.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# The releases' config.json values (the keys that decide shapes, attention and the tokenizer's size)
SHAPES = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       bos_token_id=151643, eos_token_id=151643),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     bos_token_id=151643, eos_token_id=151645),
    # 128 routed experts, top-8, no shared expert (48 layers; its 61 GB checkpoint does not fit the device's disk
    # beside another, so it runs with --layers)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                          rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    # 60 routed experts top-4 plus a shared expert with its own gate, q/k/v biases
    "qwen1.5-moe-a2.7b": dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                              shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                              num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                              vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=8192, rms_norm_eps=1e-6,
                              tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643),
    # a CPU dry run of every row's code (tests/test_bench_peers.py)
    "tiny-llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "tiny-qwen2-moe": dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=512,
                           max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]   # transformers 5's fused expert stacks
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DATA = {  # samples per step, cap (data.max_length), peers' micro-batch
    "full": dict(samples=2, cap=4096, batch=2),
    "longtail": dict(samples=8, cap=8192, batch=2),
    "long": dict(samples=1, cap=32768, batch=1),
}
H100_BF16_FLOPS = 989e12  # dense bf16 peak of an H100 SXM (the MFU's denominator)


def shape_of(args) -> dict:
    shape = dict(SHAPES[args.shape])
    if args.layers:   # the release's widths, fewer layers (a CPU dry run, or a shape whose checkpoint the disk cannot hold)
        shape["num_hidden_layers"] = args.layers
    return shape


def scaled(kind: str, args) -> dict:
    """The data set's settings, its caps scaled down for a tiny dry run (`--cap-scale`)."""
    d = dict(DATA[kind])
    d["cap"] = max(16, int(d["cap"] * args.cap_scale))
    return d


def lengths(kind: str, n: int, cap: int) -> list[int]:
    if kind != "longtail":
        return [cap] * n
    rng = random.Random(f"longtail/{cap}")
    return [max(16, min(cap, round(cap / 16 * math.exp(rng.gauss(0, 1.02))))) for _ in range(n)]


def rows(kind: str, args, vocab: int) -> list[dict]:
    """The same rows for every tool: random token ids; longtail's first 30% of each sample a prompt (label -100)."""
    import torch

    d = scaled(kind, args)
    gen = torch.Generator().manual_seed({"full": 1, "longtail": 2, "long": 3}[kind])
    out = []
    for k in lengths(kind, args.steps * d["samples"], d["cap"]):
        ids = torch.randint(3, vocab, (k,), generator=gen).tolist()
        cut = int(0.3 * k) if kind == "longtail" else 0
        out.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:]})
    return out


# ---------------------------------------------------------------------------------------------------------- checkpoint

def make(args) -> dict:
    """A random-init checkpoint of the shape (bf16 safetensors) and a word-level tokenizer of its vocabulary."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    where = Path(args.dir)
    if (where / "config.json").is_file() and any(where.glob("*.safetensors")):
        return {"dir": str(where), "made": False}
    shape = shape_of(args)
    spec = dict(shape)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    on_gpu = torch.cuda.is_available()
    t0 = time.perf_counter()
    with torch.device("cuda" if on_gpu else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(where, max_shard_size="5GB")
    params = sum(p.numel() for p in model.parameters())
    del model
    vocab = {f"<t{i}>": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", pad_token="<t0>",
                            bos_token=f"<t{shape.get('bos_token_id', 1)}>", eos_token=f"<t{shape.get('eos_token_id', 2)}>",
                            model_max_length=shape["max_position_embeddings"]).save_pretrained(where)
    return {"dir": str(where), "made": True, "params": params, "s": round(time.perf_counter() - t0, 1)}


# ------------------------------------------------------------------------------------------------------------- timing

class Meter:
    """Tokens and loss-carrying tokens the top-level model's forward receives, and each optimizer step's end time and
    loss: a TrainerCallback made by callback()."""

    def __init__(self, model) -> None:
        self.tokens = self.loss_tokens = 0
        self.marks: list[tuple[float, int, int]] = []   # (time, tokens, loss tokens) at each step's end
        self.losses: list[float] = []
        self.begin = 0.0
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, args, kwargs):
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        mask, labels = kwargs.get("attention_mask"), kwargs.get("labels")
        if torch.is_tensor(mask) and mask.dim() == 2:
            self.tokens += int(mask.sum())
        elif torch.is_tensor(ids):
            self.tokens += ids.numel()
        if torch.is_tensor(labels):
            self.loss_tokens += int((labels != -100).sum())

    def callback(self):
        import torch
        from transformers import TrainerCallback

        meter = self

        class Clock(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                meter.begin = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                meter.marks.append((time.perf_counter(), meter.tokens, meter.loss_tokens))

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    meter.losses.append(round(float(logs["loss"]), 4))

        return Clock()

    def result(self, params_active: int, layers: int, hidden: int) -> dict:
        import torch

        out = {"steps": len(self.marks), "losses": list(self.losses)}   # a copy: the next run refills the list
        if len(self.marks) >= 2:
            (t0, k0, l0), (t1, k1, l1) = self.marks[0], self.marks[-1]
            out |= {"tokens_per_s": round((k1 - k0) / (t1 - t0), 1), "loss_tokens_per_s": round((l1 - l0) / (t1 - t0), 1),
                    "steady_s": round(t1 - t0, 3), "first_step_s": round(t0 - self.begin, 3),
                    "tokens_per_step": round((k1 - k0) / (len(self.marks) - 1))}
            # model FLOPs per token: 2 N forward + 2 N for the input gradients (frozen base: no weight gradients),
            # attention's score and value products forward and backward; recompute not counted
            seq = out["tokens_per_step"]
            out["mfu"] = round(out["tokens_per_s"] * (4 * params_active + 6 * layers * hidden * seq / 2) / H100_BF16_FLOPS, 4) \
                if torch.cuda.is_available() else None
        if torch.cuda.is_available():
            out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
            out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        return out


def paged_states_gib(trainer) -> float:
    """bitsandbytes' paged optimizer states: CUDA managed memory, outside torch's peak."""
    import torch

    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if not getattr(inner, "is_paged", False):
        return 0.0
    return round(sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values() if torch.is_tensor(v)) / 2**30, 3)


def fresh_peak() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def active_params(model) -> int:
    """Parameters a token passes through in the decoder's linear layers and the output layer (the base's; LoRA's
    are under 1%)."""
    cfg = model.config
    h, layers, heads = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", heads)
    hd = getattr(cfg, "head_dim", None) or h // heads
    attn = h * hd * (heads * 2 + kv * 2)
    experts = getattr(cfg, "num_experts_per_tok", None)
    mlp = (3 * h * (cfg.moe_intermediate_size * experts + (getattr(cfg, "shared_expert_intermediate_size", 0) or 0))
           if experts else 3 * h * cfg.intermediate_size)
    return layers * (attn + mlp) + h * cfg.vocab_size


# -------------------------------------------------------------------------------------------------------------- tools

def run_unsloth(args, shape: dict) -> dict:
    import unsloth  # noqa: F401  (first: it patches transformers, peft and TRL on import)
    import datasets
    import torch
    from trl import SFTConfig, SFTTrainer
    from unsloth import FastLanguageModel

    longest = max(scaled(k, args)["cap"] for k in args.data)
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=args.dir, max_seq_length=longest, dtype=torch.bfloat16,
                                                         load_in_4bit=args.qlora, local_files_only=True)
    model = FastLanguageModel.get_peft_model(model, r=args.r, lora_alpha=2 * args.r, lora_dropout=0, target_modules=LINEAR,
                                             bias="none", use_gradient_checkpointing="unsloth", random_state=0)
    meter = Meter(model)
    out = {"versions": {"unsloth": unsloth.__version__}, "runs": {}}
    for kind in args.data:
        d = scaled(kind, args)
        data = datasets.Dataset.from_list(rows(kind, args, shape["vocab_size"]))
        cfg = SFTConfig(output_dir=str(Path(args.work) / f"unsloth-{kind}"), per_device_train_batch_size=d["batch"],
                        gradient_accumulation_steps=d["samples"] // d["batch"], max_steps=args.steps, learning_rate=1e-4,
                        warmup_steps=0, logging_steps=1, optim="adamw_8bit", bf16=True, save_strategy="no", report_to=[],
                        max_length=d["cap"], seed=0, dataset_num_proc=1, train_sampling_strategy="sequential",
                        disable_tqdm=True, **({"packing": True} if args.unsloth_packing else {}))
        trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=data, args=cfg,
                             callbacks=[meter.callback()])
        out["runs"][kind] = timed(trainer, meter, model, shape) | {"padding_free": getattr(trainer.args, "padding_free", None),
                                                                    "micro_batch": d["batch"]}
        print("unsloth", kind, out["runs"][kind], flush=True)
        keep(args, out)
        del trainer
    return out


def keep(args, result: dict) -> None:
    """The runs so far, written as they finish: a tool stopped by its time limit keeps the rows it made."""
    if args.out:
        Path(args.out).write_text(json.dumps(args.header | {"result": result, "partial": True}, indent=1, default=str))


def timed(trainer, meter: Meter, model, shape: dict) -> dict:
    meter.marks.clear()
    meter.losses.clear()
    fresh_peak()
    trainer.train()
    r = meter.result(active_params(model), shape["num_hidden_layers"], shape["hidden_size"])
    r["paged_states_gib"] = paged_states_gib(trainer)
    return r


def stage_config(args, kind: str):
    from stages.config import RunConfig

    d = scaled(kind, args)
    raw = {"model": {"name_or_path": args.dir},
           "data": {"train_file": str(Path(args.dir) / "unused.jsonl"), "max_length": d["cap"]},
           "lora": {"r": args.r, "lora_alpha": 2 * args.r, "lora_dropout": 0.0, "target_modules": "all-linear"},
           "quantization": {"load_in_4bit": args.qlora},
           "training": {"per_device_train_batch_size": d["samples"], "gradient_accumulation_steps": 1,
                        "max_steps": args.steps, "learning_rate": 1e-4, "warmup_steps": 0, "save_steps": 10_000,
                        "logging_steps": 1, "seed": 0, "train_sampling_strategy": "sequential"},
           "handoff": {"model_name": "bench"}}
    for override in args.set:
        key, _, value = override.partition("=")
        section, _, name = key.partition(".")
        raw.setdefault(section, {})[name] = json.loads(value) if value[:1] in "0123456789[{tfn-" else value
    return RunConfig.model_validate(raw)


def run_stage(args, shape: dict) -> dict:
    import torch

    from stages.train import batches, fused_lora, kernels, widen
    from stages.train.hf_trainer import make_trainer
    from stages.train.model import build_model
    from stages.train.stage import choose_fit

    if args.varlen_only:
        from stages.train import attention
        attention._equal_rows = lambda *a: None
    if args.loss == "narrow":
        from stages.train import chunked_loss
        chunked_loss.WIDE_CHUNK_LOGITS = chunked_loss.MIN_CHUNK_LOGITS
    if args.stock_modules:
        kernels.llama_like = lambda model: ([], [], False)
    if args.loss == "own":
        kernels.fused_loss_for = lambda family: False
    out, model, built_with = {"set": args.set, "runs": {}, "varlen_only": args.varlen_only}, None, None
    for kind in args.data:
        data = rows(kind, args, shape["vocab_size"])
        lens = [len(r["input_ids"]) for r in data]
        cfg = widen.in_training(stage_config(args, kind), max(lens))   # fit: auto and the packed budget, as run() decides
        settings = kernels.settings(cfg, max(lens))
        if settings != built_with:   # the settings decide what the model is built with (the tiled MLP, the loss)
            model = trainer = None
            fresh_peak()
            model, built_with = build_model(cfg, max(lens), settings), settings
            meter = Meter(model)
        dataset, plan = batches.dataset(cfg, data, settings.packing, 1, lens)
        collator = (batches.PackedCollator(varlen=settings.packed_attention == "varlen") if settings.packing
                    else batches.Collator(0))
        fit = choose_fit(cfg, model, data, collator, Path(args.work) / f"fit-{kind}", lens, settings)
        trainer = make_trainer(cfg, model, dataset, collator, Path(args.work) / f"stage-{kind}", callbacks=[meter.callback()],
                               settings=settings, disable_tqdm=True, save_strategy="no")
        r = timed(trainer, meter, model, shape)
        r |= {"settings": {k: v for k, v in vars(settings).items()}, "plan": plan.describe(),
              "fit": {"fit": fit.fit, "checkpointed_layers": fit.checkpointed_layers, "total_layers": fit.total_layers,
                      "reason": fit.reason}}
        out["runs"][kind] = r
        print("stage", kind, {k: v for k, v in r.items() if k != "settings"}, flush=True)
        keep(args, out)
        del trainer
        if torch.cuda.is_available() and args.profile == kind:
            out["profile"] = profile_steps(cfg, model, dataset, collator, settings, args)
        if "fused-off" in args.variants and kind != "long":   # the same model and fit, peft's own LoRA forward
            for m in model.modules():
                m.__dict__.pop("forward", None) if fused_lora.fusable(m) else None
            trainer = make_trainer(cfg, model, dataset, collator, Path(args.work) / f"stage-{kind}-off", callbacks=[meter.callback()],
                                   settings=settings, disable_tqdm=True, save_strategy="no")
            out["runs"][f"{kind}@fused-off"] = timed(trainer, meter, model, shape)
            print("stage", kind, "fused-off", out["runs"][f"{kind}@fused-off"], flush=True)
            keep(args, out)
            del trainer
            fused_lora.use(model)
    return out


def profile_steps(cfg, model, dataset, collator, settings, args) -> dict:
    """Two more steps, the second under torch.profiler: GPU time by kernel kind (bench/moe_profile's summary); with
    `--syncs` also the Python stacks of every op that made the host wait for the GPU in it."""
    import importlib.util

    from stages.train.hf_trainer import make_trainer

    spec = importlib.util.spec_from_file_location("peers_step_profile", ROOT / "bench" / "peers" / "step_profile.py")
    msr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(msr)
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"max_steps": 2})})
    trainer = make_trainer(cfg, model, dataset, collator, Path(args.work) / "profile", settings=settings, disable_tqdm=True,
                           save_strategy="no")
    return msr.profiled_after_first(trainer, args.syncs)


def run_peft(args, shape: dict, liger: bool) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

    on_gpu = torch.cuda.is_available()
    if liger:   # the class patch, before the model is built (as Liger documents it)
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        MODEL_TYPE_TO_APPLY_LIGER_FN[shape["model_type"]]()
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16) if args.qlora else None
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16 if on_gpu else torch.float32,
                                                 quantization_config=quant, attn_implementation="sdpa",
                                                 device_map={"": 0} if on_gpu else None)
    model.config.use_cache = False
    model.train()   # from_pretrained returns eval mode: checkpointing would do nothing
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    torch.manual_seed(0)
    names = {n for n, _ in model.named_parameters()}
    stacks = sorted({e for e in EXPERTS for n in names if n.endswith(e)})   # every routed expert too (16-bit: bitsandbytes
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=args.r, lora_alpha=2 * args.r, lora_dropout=0.0,  # has no
                                             target_modules=LINEAR, target_parameters=stacks or None))   # 3-D layers)
    meter = Meter(model)
    out = {"runs": {}}

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
        d = scaled(kind, args)
        targs = TrainingArguments(output_dir=str(Path(args.work) / f"peft-{kind}"), per_device_train_batch_size=d["batch"],
                                  gradient_accumulation_steps=d["samples"] // d["batch"], max_steps=args.steps,
                                  learning_rate=1e-4, warmup_steps=0, bf16=on_gpu, optim="adamw_torch", logging_steps=1,
                                  save_strategy="no", report_to=[], remove_unused_columns=False, disable_tqdm=True,
                                  use_cpu=not on_gpu, seed=0, train_sampling_strategy="sequential")
        trainer = Trainer(model=model, args=targs, train_dataset=rows(kind, args, shape["vocab_size"]), data_collator=pad,
                          callbacks=[meter.callback()])
        out["runs"][kind] = timed(trainer, meter, model, shape) | {"micro_batch": d["batch"]}
        print("peft-liger" if liger else "peft", kind, out["runs"][kind], flush=True)
        keep(args, out)
        del trainer
    return out


# -------------------------------------------------------------------------------------------------------------- merge

def merge(dest: str, files: list[str]) -> None:
    """bench/peers/results.json: one row per (tool, shape, data), each with its device call; the ratios of every
    tool over Unsloth and plain peft of the same call, shape and data."""
    rows_out, errors = [], []
    for f in files:
        d = json.loads(Path(f).read_text())
        if "error" in d:
            errors.append({k: d.get(k) for k in ("tool", "name", "shape", "device", "run", "error")})
        for key, r in d.get("result", {}).get("runs", {}).items():
            kind, _, variant = key.partition("@")
            rows_out.append({"tool": d["tool"], "name": d["name"] + (f"-{variant}" if variant else ""), "shape": d["shape"],
                             "kind": d["kind"], "data": kind,
                             "quant": "nf4" if d["qlora"] else "bf16", "device": d["device"], "run": d["run"],
                             **{k: r.get(k) for k in ("tokens_per_s", "loss_tokens_per_s", "peak_reserved_gib", "paged_states_gib",
                                                      "mfu", "tokens_per_step", "steps", "losses", "first_step_s")},
                             "mean_loss": round(sum(r["losses"]) / len(r["losses"]), 4) if r.get("losses") else None,
                             **({"fit": r["fit"]} if "fit" in r else {}), **({"set": d["set"]} if d.get("set") else {})})
    for r in rows_out:
        same = [o for o in rows_out if (o["shape"], o["data"], o["quant"], o["run"]) == (r["shape"], r["data"], r["quant"], r["run"])]
        for base in ("unsloth", "peft"):
            b = next((o for o in same if o["name"] == base and o.get("tokens_per_s")), None)
            if b and r.get("tokens_per_s") and r["name"] != base:
                r[f"vs_{base}"] = {"speed": round(r["tokens_per_s"] / b["tokens_per_s"], 3),
                                   "memory": round((r["peak_reserved_gib"] + (r["paged_states_gib"] or 0))
                                                   / (b["peak_reserved_gib"] + (b["paged_states_gib"] or 0)), 3)
                                   if r.get("peak_reserved_gib") and b.get("peak_reserved_gib") else None}
    old = json.loads(Path(dest).read_text()) if Path(dest).is_file() else {"rows": [], "errors": []}
    runs = {r["run"] for r in rows_out} | {e["run"] for e in errors}
    keep = [r for r in old["rows"] if r["run"] not in runs]
    Path(dest).write_text(json.dumps({"rows": keep + rows_out, "errors": [e for e in old.get("errors", []) if e["run"] not in runs] + errors},
                                     indent=1))
    for r in rows_out:
        print(f"{r['run']:>8} {r['shape']:>14} {r['quant']} {r['data']:>8} {r['name']:>18}: {r['tokens_per_s']} tok/s "
              f"{r['peak_reserved_gib']} GiB  vs unsloth {r.get('vs_unsloth')}  vs peft {r.get('vs_peft')}")


def main() -> None:
    if sys.argv[1:2] == ["merge"]:
        return merge(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser()
    ap.add_argument("tool", choices=["make", "unsloth", "stage", "peft-liger", "peft"])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, help="the release's widths with this many decoder layers")
    ap.add_argument("--dir", required=True, help="the checkpoint (made by `make`)")
    ap.add_argument("--out")
    ap.add_argument("--name", help="the row's tool name in results.json (default: the tool; e.g. stage-fit-memory)")
    ap.add_argument("--run", default="local", help="the device call this row comes from (results.json's `run`)")
    ap.add_argument("--data", nargs="+", default=["full", "longtail"], choices=list(DATA))
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps; rates over all but the first")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--bf16", dest="qlora", action="store_false", help="a 16-bit base instead of NF4")
    ap.add_argument("--cap-scale", type=float, default=1.0, help="scale the data's lengths (a tiny dry run)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="stage: a config override")
    ap.add_argument("--profile", choices=list(DATA), help="stage: two more steps of this data, the second profiled")
    ap.add_argument("--syncs", action="store_true", help="stage: the profiled step also lists the stacks of the ops "
                    "that synchronized the host with the GPU (torch's sync debug mode)")
    ap.add_argument("--unsloth-packing", action="store_true", help="unsloth: SFTConfig(packing=True), its opt-in packing "
                    "(rows of max_length), instead of its padding-free default")
    ap.add_argument("--varlen-only", action="store_true", help="stage: every packed row through the varlen kernel, "
                    "equal-length samples included (the attention before stages/train/attention.py's `_causal_rows`)")
    ap.add_argument("--loss", choices=["narrow", "own"], help="stage: the project's chunked loss in memory-first chunks "
                    "whatever the plan (narrow: the loss before the plan sized its chunks), or instead of Liger's "
                    "fused loss where Liger has one (own)")
    ap.add_argument("--stock-modules", action="store_true", help="stage: no Llama kernels on a family Liger has no "
                    "kernels for (kernels.llama_modules; the modules before)")
    ap.add_argument("--variants", nargs="*", default=[], choices=["fused-off"], help="stage: after each data set (not "
                    "long), the same model again with this change; its rows are named <tool>-<variant>")
    args = ap.parse_args()
    if args.tool == "make":
        print(json.dumps(make(args)))
        return
    import torch

    shape = shape_of(args)
    out = {"tool": args.tool, "name": args.name or args.tool, "shape": args.shape + (f"-{args.layers}-layers" if args.layers else ""),
           "kind": "moe" if any(k in shape for k in ("num_experts", "num_local_experts")) else "dense", "qlora": args.qlora,
           "run": args.run, "set": args.set, "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    args.header = dict(out)
    with tempfile.TemporaryDirectory() as work:
        args.work = work
        try:
            out["result"] = {"unsloth": run_unsloth, "stage": run_stage}.get(args.tool, None)(args, shape) \
                if args.tool in ("unsloth", "stage") else run_peft(args, shape, liger=args.tool == "peft-liger")
        except Exception:  # noqa: BLE001  (recorded: results.json says what failed, and why)
            import traceback

            out["error"] = traceback.format_exc()[-4000:]
            print(out["error"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    if "error" in out:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
