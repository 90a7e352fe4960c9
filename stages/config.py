"""The one run-config schema: every YAML file under configs/ is an instance of `RunConfig`.

Sections passed straight to a library keep that library's field names, so users can copy
what they know: `lora` is peft's `LoraConfig`, `quantization` is transformers'
`BitsAndBytesConfig`, `training` is a subset of `TrainingArguments`.

Loading is strict: an unknown key, a wrong type or a missing input stops the run before
anything expensive, with every problem listed at once and, for a misspelt key, the
nearest valid one.

    cfg = load_config("configs/default.yaml", overrides=["training.max_steps=20"])
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

# ConfigError lives in stages.errors, so that stages.model.load raises it without importing the config; it is still stages.config.ConfigError.
from stages.errors import ConfigError
from stages.quants import TYPES, UNQUANTIZED



# What people type for a key that has a library name (checked before spelling distance).
ALIASES = {
    "rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "targets": "target_modules",
    "lr": "learning_rate", "batch_size": "per_device_train_batch_size", "micro_batch_size": "per_device_train_batch_size",
    "steps": "max_steps", "grad_accum": "gradient_accumulation_steps", "qlora": "load_in_4bit",
    "model_path": "name_or_path", "path": "name_or_path", "dtype": "torch_dtype",
}


def _yaml_switch(value: Any) -> Any:
    """YAML 1.1 reads a bare `on`/`off` (also `yes`/`no`) as a boolean: take it as the word the user wrote."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


# A setting that is `auto`, `on` or `off`, however YAML typed it.
Switch = Annotated[Literal["auto", "on", "off"], BeforeValidator(_yaml_switch)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelSection(Section):
    name_or_path: str = Field(
        description="Base model: a local directory with config.json and safetensors weights, or a "
        "Hugging Face id already in the local HF cache (nothing is downloaded at run time)."
    )
    torch_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Compute/storage dtype of the frozen base. auto: bfloat16 on a CUDA GPU "
        "that supports it, float32 on CPU (CPU bf16 matmuls are slow)."
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2"] = Field(
        "auto", description="Attention kernel. sdpa picks flash/memory-efficient kernels on GPU; eager "
        "materialises the seq x seq matrix (quadratic memory). auto: sdpa, unless the model's attention computes what "
        "SDPA does not (logit soft-capping: Gemma-2; attention sinks: GPT-OSS) or transformers has no SDPA path for it: "
        "then flex_attention on a CUDA GPU, eager elsewhere."
    )
    trust_remote_code: bool = Field(
        False, description="Run Python code shipped with the model. Off: a model repo is data, not code."
    )


class SourceSection(Section):
    path: str = Field(description="A .jsonl/.json/.parquet/.csv/.arrow file, a folder of them, a dataset saved with datasets' "
                      "save_to_disk, or a hub dataset id already in the local HF cache (never downloaded).")
    weight: float = Field(1.0, gt=0, description="Samples taken per sample of this source: 0.5 a seeded half, 2 every sample twice.")
    split: str = Field("train", description="The split of a saved DatasetDict or hub dataset.")


class DataSection(Section):
    train_file: Path | None = Field(
        None, description="Training data: a .jsonl/.json/.parquet/.csv/.arrow file, a folder of them, a dataset saved with "
        "save_to_disk, or a hub dataset id in the local HF cache. Records in any of the forms `messages`, `prompt`/`completion`, "
        "Alpaca (`instruction`/`input`/`output`) or ShareGPT (`conversations` of `from`/`value`), detected per record."
    )
    sources: list[SourceSection] = Field(
        [], description="Instead of train_file: several sources mixed by weight, e.g. [{path: a.jsonl}, {path: b.parquet, weight: 0.5}]."
    )
    eval_file: Path | None = Field(
        None, description="Held-out data, any form train_file takes. Used for eval loss, the merge, fidelity and smoke checks."
    )
    eval_split: float | None = Field(
        None, gt=0, lt=0.5, description="Without an eval_file: this fraction of the training samples (seeded by training.seed) "
        "is held out instead, for eval loss, the merge, fidelity and smoke checks. null: no split."
    )
    max_length: int = Field(1024, gt=0, description="Token limit per sample after the chat template.")
    num_proc: int | None = Field(
        None, gt=0, description="Processes that tokenize the training data (once per content: the result is cached under "
        "<artifacts_dir>/cache/tokenized). null: one per CPU core."
    )
    long_sample_policy: Literal["error", "truncate", "drop"] = Field(
        "error", description="What to do with a sample longer than max_length: stop with its id "
        "(error), cut it (truncate), or leave it out (drop). Every affected id is reported."
    )
    special_tokens_in_content: Literal["error", "plain"] = Field(
        "error", description="Message text that holds the tokenizer's special-token text (`</s>`, ChatML's end-of-turn token: pasted "
        "chat logs, data made for another template), which the tokenizer would read as control tokens (a turn ending mid-answer, a second "
        "turn inside one). error: stop, naming each sample by file:line and the tokens. plain: encode that text as plain text "
        "(the tokenizer's split_special_tokens), so that only the chat template makes control tokens."
    )

    @model_validator(mode="after")
    def _one_training_input(self) -> DataSection:
        if (self.train_file is None) == (not self.sources):
            raise ValueError("give the training data as data.train_file or as data.sources (a list of {path, weight}), exactly one of them")
        return self


class LoraSection(Section):
    """peft.LoraConfig fields, passed through unchanged."""

    r: int = Field(16, gt=0, le=4096, description="Rank; higher adds capacity and memory.")
    lora_alpha: float = Field(32, gt=0, description="Scale = lora_alpha / r.")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter input; 0 skips a copy of each input.")
    target_modules: Annotated[list[str], Field(min_length=1)] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, e.g. [q_proj, v_proj, o_proj], or all-linear."
    )
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases train; none keeps the base frozen.")


class QuantizationSection(Section):
    """transformers.BitsAndBytesConfig fields. load_in_4bit: true makes the run QLoRA."""

    load_in_4bit: bool = Field(False, description="QLoRA: keep the frozen base in 4 bits (bitsandbytes).")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="NF4 is the QLoRA paper's data type for normal-distributed weights.")
    bnb_4bit_use_double_quant: bool = Field(True, description="Quantise the quantisation constants (~0.4 bit/param saved).")
    bnb_4bit_compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="auto follows model.torch_dtype."
    )


class TrainingSection(Section):
    """A subset of transformers.TrainingArguments, same names and meaning."""

    per_device_train_batch_size: int = Field(8, gt=0, description="Micro-batch; memory grows with it.")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Effective batch = micro-batch x this.")
    learning_rate: float = Field(2e-4, gt=0, le=1.0, description="Peak learning rate of the adapter.")
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field("linear", description="Decay after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 to learning_rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay on the adapter.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping; 0 disables.")
    max_steps: int = Field(100, gt=0, description="Optimizer steps.")
    gradient_checkpointing: bool = Field(True, description="Recompute activations in backward; saves memory, costs ~1/3 more compute.")
    launcher: Literal["inprocess", "accelerate"] = Field(
        "inprocess", description="accelerate: training runs as `accelerate launch --num_processes N -m stages.train` in a "
        "subprocess (DDP over N GPUs; on CPU torchrun with gloo), its output streamed into the Prefect logs."
    )
    num_processes: int = Field(1, gt=0, description="Processes per machine with launcher: accelerate (one per GPU).")
    distributed: Literal["ddp", "fsdp"] = Field(
        "ddp", description="How the processes of launcher: accelerate share the model. ddp: each holds the whole model "
        "(more speed, not more room). fsdp: FSDP2 through accelerate shards the frozen base (16-bit or NF4), the adapter, "
        "its gradients and optimizer states across all processes, so a model that does not fit one GPU fits N; the "
        "preflight sizes one GPU's share. Checkpoints are sharded; the adapter is gathered and saved once."
    )
    num_machines: int = Field(1, gt=0, description="Machines in a multi-node run (each runs num_processes processes).")
    machine_rank: int = Field(0, ge=0, description="This machine's index, 0 .. num_machines - 1; machine 0 writes the "
                              "adapter and continues the pipeline, the others only train (set per machine, e.g. --set).")
    main_process_ip: str | None = Field(None, description="Address of machine 0 (the rendezvous); needed with num_machines > 1.")
    main_process_port: int = Field(29500, gt=0, lt=65536, description="Rendezvous port on machine 0.")
    fit: Literal["auto", "memory", "speed"] = Field(
        "auto", description="memory: every layer checkpointed, checkpointed activations offloaded to CPU on a GPU "
        "(smallest footprint). speed: measured at start, as few layers checkpointed as fit preflight.gpu_memory_gib "
        "less the margin (fastest that fits); the choice and its measurements go to train/fit.json. auto: speed on a "
        "GPU where its estimate with every layer checkpointed fits the card, else memory (the preflight report and the "
        "train log say which and why); memory on CPU and with distributed: fsdp."
    )
    offload_activations: Switch = Field(
        "auto", description="Keep tensors saved for backward (the checkpointed layers' inputs) in pinned CPU memory, "
        "copied on a side stream (CUDA only). auto: on with fit: memory and checkpointing on a GPU."
    )
    offload_embeddings: Switch = Field(
        "auto", description="Keep the frozen input embedding table in pinned CPU memory and gather rows there "
        "(1.02 GiB for a 152k x 3584 table; CUDA, untied embeddings only). auto: on with fit: memory on a GPU."
    )
    tiled_mlp: Switch = Field(
        "auto", description="Run each MLP over sequence tiles, recomputed in backward (Liger's TiledMLP, CUDA): the "
        "tokens x intermediate activations stop growing with context, at the cost of one more MLP forward. "
        "auto: on with fit: memory when the widest micro-batch of the data holds >= 32768 tokens (packed: max_tokens_per_batch; "
        "padded: micro-batch x the longest sample after data.long_sample_policy); fit: speed keeps the activations instead."
    )
    fused_lora: Switch = Field(
        "auto", description="Each adapted linear layer's forward and backward in one autograd function "
        "(stages/train/fused_lora.py): the adapter's product accumulated into the base matmul's output instead of four "
        "more passes over it; the same maths. auto: on wherever the adapter is plain LoRA (not DoRA) and distributed "
        "is not fsdp."
    )
    fused_kernels: Switch = Field(
        "auto", description="Liger Triton kernels for RMSNorm, SwiGLU and RoPE (CUDA): less activation memory, faster "
        "steps. auto: on with a CUDA GPU and liger-kernel installed."
    )
    cross_entropy: Literal["auto", "plain", "chunked"] = Field(
        "auto", description="chunked never materialises the vocab x tokens logits: Liger's fused linear cross-entropy on "
        "a CUDA GPU for the families Liger has it for, else the project's own (stages/train/chunked_loss.py, any device; "
        "not for a forward that soft-caps its logits, Gemma-2 on CPU). With a 152k vocabulary it is the largest single "
        "saving. plain: the stock loss over the whole logits. auto: chunked wherever one of the two covers the model."
    )
    optim: Literal["auto", "adamw_torch", "adamw_torch_fused", "paged_adamw_8bit", "adamw_8bit", "sgd"] = Field(
        "auto", description="Optimizer (TrainingArguments.optim). 8-bit states take 2 bytes per adapter parameter instead of 8. "
        "auto: adamw_8bit with fit: memory on a GPU (bitsandbytes installed), adamw_torch_fused with fit: speed, "
        "adamw_torch on CPU (docs/training.md)."
    )
    packing: Switch = Field(
        "auto", description="on: micro-batches are samples laid end to end up to max_tokens_per_batch tokens, no padding, "
        "no token attending across samples (position ids restart per sample); the loss is normalised per loss-carrying token "
        "of the optimizer step, as unpacked. off: per_device_train_batch_size samples padded to the longest. auto: on where "
        "measured faster: CPU and CUDA GPUs with torch's varlen flash kernel (torch >= 2.10, Ampere or newer); off elsewhere "
        "(docs/training.md#packing-long-tailed-data-without-padding)."
    )
    max_tokens_per_batch: int | None = Field(
        None, gt=0, description="Packing: the most tokens in one micro-batch (at least the longest sample). null: "
        "per_device_train_batch_size x data.max_length (the padded run's worst micro-batch), at most the widest multiple of "
        "data.max_length up to 16384 tokens, under the width that switches the tiled MLP on; on a GPU with packed_step: "
        "samples, widened as far as a step's samples fill, up to 16384, where the estimate at that width fits the card "
        "(fewer kernel launches per token; the preflight's figure is measured at it; docs/training.md)."
    )
    packed_step: Literal["samples", "tokens"] = Field(
        "samples", description="Packed, what one optimizer step trains. samples: what a padded run's step trains, "
        "per_device_train_batch_size x gradient_accumulation_steps samples per process, laid end to end into as few micro-batches "
        "of at most max_tokens_per_batch tokens as hold them: the same samples per step, learning rate and epochs per max_steps as "
        "padded, without the padding. tokens: every micro-batch filled to max_tokens_per_batch tokens and a step "
        "gradient_accumulation_steps of them: many more samples per step than padded (the report says how many), so fewer "
        "optimizer updates per epoch; scale the learning rate and max_steps to it."
    )
    packed_attention: Literal["auto", "varlen", "flex_attention", "mask"] = Field(
        "auto", description="How packed samples are kept apart in attention. varlen: torch's variable-length flash kernel "
        "(torch.nn.attention.varlen, CUDA; on CPU the same attention one sample at a time); flex_attention: a block-sparse mask "
        "(compiled); mask: the model's own attention (model.attn_implementation) with transformers' block-diagonal causal mask "
        "(tokens x tokens memory). auto: varlen where torch has it (always on CPU), else mask."
    )
    train_sampling_strategy: Literal["random", "group_by_length", "sequential"] = Field(
        "random", description="group_by_length batches samples of similar length so padding is not paid for; "
        "on data with few distinct lengths its same-length batches can stall convergence (measured on the default)."
    )
    logging_steps: int = Field(10, gt=0, description="Loss is logged every N steps (memory is recorded every step).")
    eval_steps: int | None = Field(
        None, gt=0, description="Eval loss on the eval data (data.eval_file, or data.eval_split of the training data) every N "
        "optimizer steps. null: at every checkpoint (save_steps) when there is eval data, never otherwise."
    )
    early_stopping_patience: int | None = Field(
        None, gt=0, description="Stop after this many evaluations in a row without a lower eval loss. null: never stop early."
    )
    load_best: bool = Field(
        True, description="When eval loss is measured, the adapter kept (and merged) is the checkpoint with the lowest eval loss, "
        "not the last one."
    )
    report_to: list[Literal["tensorboard", "mlflow"]] = Field(
        [], description="Trackers that get params, losses, eval metrics, per-step memory and the plots. mlflow writes to "
        "MLFLOW_TRACKING_URI when set, else to a local file store under the run's train/ directory."
    )
    oom_retries: int = Field(
        2, ge=0, description="CUDA out of memory during training: resume from the last checkpoint with half the micro-batch (packed: "
        "half the token budget) and twice the accumulation, the same samples per optimizer step, up to this many times. 0: stop at the "
        "first one with its post-mortem."
    )
    memory_snapshot_steps: int = Field(
        0, ge=0, description="CUDA: record every allocation of the first N optimizer steps to train/memory_snapshot.pickle "
        "(drag into https://pytorch.org/memory_viz); an OOM while recording also dumps one next to its post-mortem. 0: off."
    )
    save_steps: int = Field(50, gt=0, description="Checkpoint every N steps; a crash loses at most N steps.")
    save_total_limit: int = Field(2, gt=0, description="Checkpoints kept on disk.")
    seed: int = Field(0, description="Seeds adapter init and data order.")

    @model_validator(mode="after")
    def _distributed(self) -> TrainingSection:
        if self.launcher == "inprocess" and (self.distributed == "fsdp" or self.num_processes > 1 or self.num_machines > 1):
            raise ValueError("distributed: fsdp, num_processes > 1 and num_machines > 1 need launcher: accelerate (one "
                             "process per GPU); set training.launcher: accelerate")
        if self.machine_rank >= self.num_machines:
            raise ValueError(f"machine_rank is {self.machine_rank}, but num_machines is {self.num_machines}: ranks are 0 .. "
                             f"{self.num_machines - 1}")
        if self.num_machines > 1 and not self.main_process_ip:
            raise ValueError("num_machines > 1 needs main_process_ip: the address of machine 0, which every machine can reach")
        if self.distributed == "fsdp" and self.optim in ("paged_adamw_8bit", "adamw_8bit"):
            raise ValueError(f"optim {self.optim} with distributed: fsdp: bitsandbytes' 8-bit optimizers do not take FSDP2's "
                             "sharded parameters; use auto or adamw_torch (the states are sharded across processes instead)")
        if self.distributed == "fsdp" and self.fit == "speed":
            raise ValueError("fit: speed measures on the unsharded model in one process; with distributed: fsdp use fit: memory")
        return self

    # The packed budget this card widened a null max_tokens_per_batch to, and why (stages/train/widen.py): set by the
    # preflight and the train stage on their own copies, never read from YAML.
    _card_budget: int | None = PrivateAttr(None)
    _card_reason: str = PrivateAttr("")
    # What fit: auto became on this card and why (stages/train/widen.py), set the same way.
    _card_fit: str | None = PrivateAttr(None)
    _fit_reason: str = PrivateAttr("")

    @property
    def planned_fit(self) -> str:
        """memory or speed: the config's fit, or what fit: auto was decided to be on this card (memory where undecided)."""
        return self.fit if self.fit != "auto" else self._card_fit or "memory"

    @property
    def world_size(self) -> int:
        """All processes of the run, on every machine."""
        return self.num_processes * self.num_machines

    @property
    def shards(self) -> int:
        """Processes the base weights and adapter states are split across: the world with fsdp, else 1."""
        return self.world_size if self.distributed == "fsdp" else 1


class PreflightSection(Section):
    gpu_memory_gib: float | None = Field(
        None, gt=0, description="Memory budget of the training card. null: the device's total on GPU; "
        "on CPU the check uses the machine's available RAM."
    )
    margin: float = Field(0.10, ge=0, lt=1, description="Fraction of the budget kept free (allocator, other processes).")
    probe: bool = Field(
        True, description="On a CUDA device, also run two real optimizer steps on the worst micro-batch with the process "
        "capped at the budget; the verdict is then measured, not estimated."
    )


class MergeSection(Section):
    base: Literal["auto", "16bit", "dequantized-nf4"] = Field(
        "auto", description="QLoRA only: merge into the original 16-bit weights or into the NF4 weights the adapter "
        "trained against, dequantized. auto: whichever is closer (mean KL on held-out texts) to the adapter on NF4."
    )
    samples: int = Field(8, gt=0, description="Held-out samples for the merge checks.")


MAX_MEAN_KL = {**dict.fromkeys(UNQUANTIZED, 0.01), **{q.name: q.max_mean_kl for q in TYPES.values() if q.max_mean_kl},
               "default": 0.10}
MIN_TOP1 = {**dict.fromkeys(UNQUANTIZED, 0.99), **{q.name: q.min_top1 for q in TYPES.values() if q.min_top1}, "default": 0.85}


def _over(defaults: dict[str, float]):
    """A threshold map as given laid over its defaults: `{Q5_K_S: 0.05}` (YAML or --set) changes Q5_K_S's entry, and
    leaves f16's strict gate as it was instead of dropping it to `default`."""
    return lambda v: defaults | v if isinstance(v, dict) else v


class FidelitySection(Section):
    """The gate between export and hand-off: each GGUF vs the merged model on held-out texts."""

    samples: int = Field(20, gt=0, description="Held-out samples compared (every position of each).")
    max_mean_kl: Annotated[dict[str, float], BeforeValidator(_over(MAX_MEAN_KL))] = Field(
        MAX_MEAN_KL, description="Per file type, the largest mean KL(merged || GGUF) allowed; `default` for types not listed. "
        "The types given change those entries only; the others keep these defaults. "
        "For scale, llama.cpp on Llama-3-8B: 0.031 at Q4_K_M, 0.017 at Q5_K_S.",
    )
    min_top1: Annotated[dict[str, float], BeforeValidator(_over(MIN_TOP1))] = Field(
        MIN_TOP1, description="Per file type, the smallest fraction of positions where GGUF and merged model pick the same "
        "next token (llama.cpp on Llama-3-8B Q4_K_M: 91.9%); the types given change those entries only.",
    )

    @model_validator(mode="after")
    def _known_file_types(self) -> FidelitySection:
        known = {*TYPES, *UNQUANTIZED, "default"}
        by_lower = {k.lower(): k for k in known}
        bad = []
        for name in ("max_mean_kl", "min_top1"):
            for key in getattr(self, name):
                if key not in known:
                    near = by_lower.get(key.lower()) or next(iter(difflib.get_close_matches(key, sorted(known), n=1)), None)
                    bad.append(f"{name}.{key}" + (f" (did you mean {near}?)" if near else ""))
        if bad:  # an unknown key would be silently ignored and that file held to `default`
            raise ValueError(f"unknown file type(s) {', '.join(bad)}; keys are {', '.join(sorted(known))}")
        return self

    def thresholds(self, quant: str) -> tuple[float, float]:
        return (self.max_mean_kl.get(quant, self.max_mean_kl.get("default", 0.1)),
                self.min_top1.get(quant, self.min_top1.get("default", 0.85)))


# Words that mean a setting of export.imatrix rather than a file name, however they are written.
IMATRIX_WORDS = {"auto": "auto", "off": "off", "none": "off", "null": "off", "no": "off", "false": "off", "disabled": "off",
                 "on": "auto", "yes": "auto", "true": "auto"}


class ExportSection(Section):
    outtype: Literal["f16", "bf16", "f32", "auto"] = Field(
        "f16", description="Precision of the unquantised GGUF the quantised files are made from."
    )
    quant_types: list[str] = Field(["Q4_K_M", "Q5_K_S"], min_length=1, description=f"Any of {sorted(TYPES)}.")
    imatrix: Annotated[str, BeforeValidator(lambda v: {False: "off", True: "auto"}.get(v, v) if isinstance(v, bool) else v)] = Field(
        "auto", description="Importance-matrix quantization. auto: computed from the run's own training samples (chat template, "
        "never the held-out texts) on the merged model, each type quantized with and without it, and the fidelity gate keeps the "
        "file with the lower mean KL to the merged model; the bundle holds imatrix.gguf and the model card both figures. A path: "
        "that imatrix.gguf (llama-imatrix's or an earlier bundle's) instead of computing one, compared the same way. off: plain "
        "quantization only."
    )
    imatrix_tokens: int = Field(16384, gt=0, description="Training tokens the importance matrix is computed on (export.imatrix: auto).")
    fidelity: FidelitySection = FidelitySection()

    @field_validator("quant_types")
    @classmethod
    def _each_type_once(cls, v: list[str]) -> list[str]:
        # two entries of one type are one output file: the second overwrites the first, and the export's cleanup of
        # one removes the other's file, after training
        repeated = [q for q in dict.fromkeys(v) if v.count(q) > 1]
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed more than once ({v}); each type makes one GGUF file: remove the "
                             f"repeat (quant_types: [{', '.join(dict.fromkeys(v))}])")
        return v

    @model_validator(mode="after")
    def _known_quants(self) -> ExportSection:
        bad = [q for q in self.quant_types if q not in TYPES]
        if bad:
            raise ValueError(f"unknown quant type(s) {bad}; choose from {sorted(TYPES)}")
        return self

    @field_validator("imatrix")
    @classmethod
    def _setting_or_file(cls, v: str) -> str:
        word = v.strip().lower()
        if v not in ("auto", "off") and word in IMATRIX_WORDS:  # a setting mistyped would be read as a file name
            raise ValueError(f"{v!r} reads as the setting `{IMATRIX_WORDS[word]}`, not a file; set export.imatrix: "
                             f"{IMATRIX_WORDS[word]} (the settings are lower-case auto and off), or give the path of an imatrix.gguf")
        if not v.strip():
            raise ValueError("empty; set export.imatrix: auto, off, or the path of an imatrix.gguf")
        return v


class SmokeSection(Section):
    gpu_memory_gib: float | None = Field(
        None, gt=0, description="Memory of the smaller serving card (e.g. 8, 12, 16, 24). null: CPU only."
    )
    n_ctx: int = Field(512, gt=0, description="Context the serving team will run with (sizes the KV cache).")
    max_tokens: int = Field(64, gt=0, description="Generation limit per prompt; a model that never stops fails.")
    max_prompts: int = Field(50, gt=0, description="Held-out prompts run per GGUF file.")
    check: Literal["exact", "stops"] = Field(
        "exact", description="exact: the answer must equal the held-out completion (a deterministic skill); "
        "stops: non-empty and ends with EOS within max_tokens (real models)."
    )
    min_accuracy: float = Field(0.8, ge=0, le=1, description="Fraction of prompts that must pass, per GGUF.")
    serve: bool = Field(True, description="Also ask the held-out prompts through llama.cpp's OpenAI-compatible server (llama_cpp.server "
                        "on loopback, the official openai client's chat completions: the GGUF's own template, stops at its end-of-turn "
                        "token), as the serving team calls it; latency and tokens/s go to smoke_result.json and the model card.")


class PromotionSection(Section):
    """When a retrain becomes `latest`: no worse than the bundle `latest` points at (stages/champion.py)."""

    compare: bool = Field(True, description="Compare each new bundle with the one `latest` points at before switching `latest`. "
                          "false: every bundle that passes the gates becomes `latest`.")
    smoke_accuracy_drop: float = Field(0.02, ge=0, le=1, description="How much lower (absolute) a GGUF's smoke accuracy may be.")
    eval_loss_rise: float = Field(0.03, ge=0, description="How much higher (relative) the eval loss may be, on the same held-out data ...")
    eval_loss_floor: float = Field(0.01, ge=0, description="... plus this much (absolute).")
    kl_rise: float = Field(1.0, ge=0, description="How much higher (relative) a GGUF's mean KL to its merged model may be ... (it moves "
                           "with the weights: a retrain on one more sample of the tiny default took Q4_K_M from 0.011 to 0.016)")
    kl_floor: float = Field(0.01, ge=0, description="... plus this much (absolute): KLs near zero differ by noise.")


class HandoffSection(Section):
    dir: Path = Field(Path("artifacts/handoff"), description="Bundles go to <dir>/<model_name>/<version>/.")
    model_name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Name the serving team knows the model by "
                            "(also each GGUF's general.name).")
    adapter: Literal["auto", "off"] = Field("auto", description="auto: the bundle also holds the LoRA adapter for servers that "
                                            "hot-swap it (adapter/ in PEFT format, and an adapter GGUF from llama.cpp's "
                                            "convert_lora_to_gguf.py), where llama.cpp proves the base GGUF with it is the merged "
                                            "model (KL and top-1 as export.fidelity holds the merged files, then served through "
                                            "llama.cpp's server); else the manifest says why it is not there. off: merged GGUFs only.")
    promotion: PromotionSection = PromotionSection()


class RunConfig(Section):
    model: ModelSection
    data: DataSection
    lora: LoraSection = LoraSection()
    quantization: QuantizationSection = QuantizationSection()
    training: TrainingSection = TrainingSection()
    preflight: PreflightSection = PreflightSection()
    merge: MergeSection = MergeSection()
    export: ExportSection = ExportSection()
    smoke: SmokeSection = SmokeSection()
    handoff: HandoffSection
    artifacts_dir: Path = Field(Path("artifacts"), description="Run outputs go to <artifacts_dir>/runs/<run-id>/<stage>/.")

    def fingerprint(self) -> str:
        """Short hash of the resolved config: two runs with the same config share it."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:12]

    def to_yaml(self) -> str:
        return yaml.safe_dump(json.loads(self.model_dump_json()), sort_keys=False)


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML run config, apply `section.key=value` overrides, validate it against the schema. Whether its
    inputs exist (the model, the data, writable directories) is stages.inputs.load's question.

    Args:
        path: the YAML file.
        overrides: dotted assignments, values parsed as YAML (`training.max_steps=20`).

    Raises:
        ConfigError: listing every problem at once, each with the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path.resolve()} does not exist; pass --config with a file from configs/")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}; fix it there (indentation, an unclosed bracket or quote, a key given twice)") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, lora:, training:, ...), got "
                          f"{type(raw).__name__}; use configs/default.yaml as the pattern")
    for item in overrides or []:
        _apply_override(raw, item)
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_explain(path, e)) from None
    return cfg


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping: YAML keeps the last one silently."""


def _no_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"`{key}` is given twice in the same mapping (lines {seen[key] + 1} and {key_node.start_mark.line + 1}); "
                "YAML would keep only the last one: merge them into one", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{item}' must look like section.key=value, e.g. training.max_steps=20")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as e:
        problem = str(getattr(e, "problem", None) or e).splitlines()[0]
        raise ConfigError(f"override '{item}': the value {value!r} is not plain YAML ({problem}); quote it "
                          f"(--set '{key}=\"...\"') or give a number, a word, [a, list] or {{key: value}}") from None
    node = raw
    *parents, leaf = key.strip().split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{item}': '{part}' is not a section")
    node[leaf] = parsed


def _explain(path: Path, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            parent = _section_at(e["loc"][:-1])
            valid = list(parent.model_fields) if parent else []
            key = str(e["loc"][-1])
            near = [ALIASES[key]] if ALIASES.get(key) in valid else difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f"did you mean `{near[0]}`?" if near else f"valid keys here: {', '.join(valid)}"
            lines.append(f"{loc}: unknown key; {hint}")
        elif e["type"] == "missing":
            lines.append(f"{loc}: required, but missing; add it to the YAML")
        elif e["type"] == "value_error":  # the schema's own check: its message names the problem and the fix
            lines.append(f"{loc}: {e['msg'].removeprefix('Value error, ')}")
        else:
            about = _field_at(e["loc"])
            lines.append(f"{loc}: {e['msg']} (got {e.get('input')!r}); set a value that is"
                         + (f": {about.rstrip('.')}" if about else " valid there (configs/default.yaml shows one)"))
    return f"{path}: config is not well-formed, found the following errors:\n" + "\n".join(f"  - {x}" for x in lines)


def _field_at(loc: tuple) -> str | None:
    """The schema's description of the field at `loc` (what a valid value is), if there is one."""
    parent = _section_at(loc[:-1])
    field = parent.model_fields.get(str(loc[-1])) if parent else None
    return field.description if field else None


def _section_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = RunConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def reference_markdown() -> str:
    """The config reference table of docs/config.md, generated from the schema itself."""
    lines = ["| key | default | meaning |", "|---|---|---|"]

    def walk(prefix: str, model: type[BaseModel]) -> None:
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(f"{prefix}{name}.", ann)
                continue
            default = "required" if f.is_required() else f"`{json.dumps(f.default, default=str)}`"
            lines.append(f"| `{prefix}{name}` | {default} | {(f.description or '').replace('|', '/')} |")

    walk("", RunConfig)
    return "\n".join(lines)


def update_docs(page: Path) -> None:
    """Rewrite the table between the config-reference markers of docs/config.md."""
    text = page.read_text()
    head, rest = text.split("<!-- config-reference:start -->\n", 1)
    _, tail = rest.split("<!-- config-reference:end -->", 1)
    page.write_text(f"{head}<!-- config-reference:start -->\n{reference_markdown()}\n<!-- config-reference:end -->{tail}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--update-docs"]:
        update_docs(Path(__file__).resolve().parents[1] / "docs" / "config.md")
    else:
        print(reference_markdown())
