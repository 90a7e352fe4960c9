"""Finding and loading the base model, the one way every stage does it.

Only local files are read: a directory, or a model already in the Hugging Face cache.
Weights load from safetensors only (a pickle can run code), and model code from the hub
runs only when the config says `trust_remote_code: true`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from stages.errors import ConfigError, ModelError
from stages.model import architecture
from stages.model.directory import config_text, language_config, resolve_model_dir
from stages.model.experts import lora as expert_lora
from stages.model.experts import nf4 as expert_nf4

if TYPE_CHECKING:  # annotations only: the config imports this module (to check the model), never the reverse
    from stages.config import ModelSection, QuantizationSection

# Read by torch at the first CUDA allocation, so set before any stage touches the GPU.
# Variable-length batches under the default allocator reserved 97.5 GiB for 30 GiB
# allocated; expandable segments 34.2 GiB; the often-advised max_split_size_mb:128
# 139 GiB (the Qwen2-7B baseline, R7 in docs/benchmarks.md, HF Trainer). A user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def device() -> torch.device:
    """This process's device: under `accelerate launch` / torchrun, the GPU of its LOCAL_RANK."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def compute_dtype(choice: str, cuda: bool | None = None) -> torch.dtype:
    """auto: bf16 on a GPU that has it, fp32 on CPU (bf16 matmuls are emulated there and slow).

    Args:
        cuda: the device to decide for (the preflight estimates for a GPU from a laptop);
            None: this machine's.
    """
    if choice != "auto":
        return getattr(torch, choice)
    if cuda is None:
        cuda = torch.cuda.is_available()
        if cuda and not torch.cuda.is_bf16_supported():
            return torch.float16
    return torch.bfloat16 if cuda else torch.float32


def load_tokenizer(model: ModelSection):
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(model.name_or_path)
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=model.trust_remote_code)
    problem = special_token_problem(tok, model_dir)
    if problem:
        raise ModelError(problem)
    if tok.pad_token is None:
        # Padding positions are masked out of attention and loss, so reusing EOS is safe.
        tok.pad_token = tok.eos_token
    if isinstance(tok.chat_template, dict):
        tok.chat_template = default_chat_template(tok, model_dir)
    if not tok.chat_template:
        raise ModelError(
            f"the tokenizer of {model.name_or_path} has no chat template; add `chat_template` to its "
            "tokenizer_config.json (the exported GGUF and the serving team need it)"
        )
    return tok


def default_chat_template(tok, model_dir: Path) -> str:
    """Of named chat templates (tokenizer_config.json's list of {name, template}, the form several releases ship with
    `tool_use` or `rag` beside `default`), the one transformers applies to a conversation without tools, which is also
    the one llama.cpp's converter writes as the GGUF's tokenizer.chat_template (the others under their names). Training
    renders with it, and the tokenizer carries it alone, so every stage after meets the template the GGUF serves."""
    try:
        return tok.get_chat_template()
    except ValueError:  # transformers' "multiple chat templates with no default"
        from stages.model.check import chat_template_file

        raise ModelError(
            f"the chat template in {chat_template_file(model_dir)} is a list of named templates ({', '.join(tok.chat_template)}), none "
            "named `default`: transformers renders a conversation without tools with `default`, and llama.cpp's converter makes "
            "it the GGUF's tokenizer.chat_template, so no template would render the training data or serve the model; rename "
            "the one for plain conversations to `default`") from None


def special_token_problem(tok, model_dir: Path) -> str | None:
    """Why the tokenizer's special tokens cannot train and serve this model: no EOS (answers that never end), an id past
    the embedding table (an IndexError at step 1), or config.json naming another EOS/BOS than the tokenizer (generation
    stops at one token, training teaches the other); None when they agree."""
    config = language_config(model_dir)
    rows = config.get("vocab_size")
    files = f"{Path(model_dir) / 'tokenizer_config.json'}"
    if tok.eos_token is None or tok.eos_token_id is None:
        return (f"the tokenizer of {model_dir} has no eos_token: trained answers would never end, and no server would know where to "
                f"stop; set \"eos_token\" in {files} to the token that ends a turn in its chat template (e.g. \"</s>\", "
                "\"<|im_end|>\", \"<|eot_id|>\")")
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        value, tid = getattr(tok, name, None), getattr(tok, f"{name}_id", None)
        if value is not None and tid is not None and rows and tid >= rows:
            return (f"the tokenizer's {name} {value!r} has id {tid}, outside the model's {rows}-row embedding table (config.json "
                    f"vocab_size): it is not in the vocabulary the model was trained with; set \"{name}\" in {files} to a token "
                    f"the model has (ids 0-{rows - 1}), e.g. the one its chat template ends a turn with")
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        ids = config.get(key)
        ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
        bad = [i for i in ids if not isinstance(i, int) or i < 0 or (rows and i >= rows)]
        if bad:
            tid = getattr(tok, key)
            return (f"{Path(model_dir) / 'config.json'}: {key} {config.get(key)} is outside the vocabulary (ids 0-{(rows or 1) - 1}); "
                    + (f"set it to the tokenizer's id, {tid}" if tid is not None and (not rows or tid < rows) else "remove it or set it to an id in range"))
    for key, name in (("eos_token_id", "eos_token"), ("bos_token_id", "bos_token")):
        ids = config.get(key)
        ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
        tid = getattr(tok, key)
        if ids and tid is not None and tid not in ids:
            return (f"{Path(model_dir) / 'config.json'}: {key} is {config.get(key)}, but the tokenizer's {name} is "
                    f"{getattr(tok, name)!r} (id {tid}): generation would stop at one and training teach the other; set {key} "
                    f"to {tid} in config.json, or \"{name}\" in {files} to the token config.json names")
    return None


def _check_bitsandbytes() -> None:
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            "quantization.load_in_4bit (QLoRA) needs bitsandbytes, which is not installed: `pip install bitsandbytes==0.50.2` "
            "(bash scripts/install.sh installs it), or set quantization.load_in_4bit: false"
        )
    if not torch.cuda.is_available() and torch.backends.mps.is_available():
        raise ConfigError("quantization.load_in_4bit: bitsandbytes NF4 runs on CUDA and CPU, not on Apple MPS; set it to false")


def attention_for(requested: str, arch) -> str:
    """model.attn_implementation for `arch` on this device (architecture.attention_implementation)."""
    return architecture.attention_implementation(requested, arch, device().type == "cuda")


def attention_of_dir(model_dir: Path) -> str | None:
    """The attention `auto` gives the model in `model_dir` (a merged model: what its reference logits are computed
    with); None, transformers' own choice, where the architecture cannot be built here."""
    arch = architecture.from_config_text(config_text(model_dir))
    return attention_for("auto", arch) if arch else None


def load_base(model: ModelSection, quant: QuantizationSection, *, quantized: bool | None = None, sharded: bool = False):
    """The frozen base, in train-ready form: 16-bit or (QLoRA) NF4, on the one device.

    Args:
        quantized: override `quant.load_in_4bit` (merge loads the unquantised base of a QLoRA run).
        sharded: FSDP will shard it (stages/train/sharding.py): loaded into host memory, from where each
            process moves only its shard to its GPU; NF4 stored in the compute dtype, which FSDP can
            flatten (the default uint8 storage cannot be sharded).
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = compute_dtype(model.torch_dtype)
    kwargs = {}
    if quant.load_in_4bit if quantized is None else quantized:
        _check_bitsandbytes()
        cdt = dtype if quant.bnb_4bit_compute_dtype == "auto" else getattr(torch, quant.bnb_4bit_compute_dtype)
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=quant.bnb_4bit_use_double_quant,
            bnb_4bit_compute_dtype=cdt,
            **({"bnb_4bit_quant_storage": cdt} if sharded else {}),
        )
    # QLoRA: the fused MoE expert stacks are quantized as they load, like the linear layers (stages.model.experts.nf4);
    # sharded, they stay 16-bit: FSDP gathers parameters it can flatten, not packed stacks read by their own forward
    nf4_experts = "quantization_config" in kwargs and not sharded
    with expert_nf4.quantized_at_load() if nf4_experts else contextlib.nullcontext():
        base = AutoModelForCausalLM.from_pretrained(
            resolve_model_dir(model.name_or_path),
            dtype=dtype,
            attn_implementation=attention_for(model.attn_implementation, architecture.of_model(model)),
            trust_remote_code=model.trust_remote_code,
            use_safetensors=True,
            # One device, never "auto": a silent CPU offload turns an OOM into a 50x slowdown.
            device_map={"": "cpu" if sharded else str(device())},
            **kwargs,
        )
    if expert_nf4.show_shapes(base):
        expert_lora.use_nf4_stacks(base)
    if sharded:
        # FSDP places each shard, not this map; accelerate would refuse an NF4 model mapped to the host
        base.__dict__.pop("hf_device_map", None)
    return base
