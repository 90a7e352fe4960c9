"""The random-init checkpoints the benches build (memory depends on shapes, not values): `make_checkpoint` writes one
of `SHAPES` (or of the `shapes` it is given) with the tiny default's SentencePiece tokenizer beside it, so the
pipeline's own loaders work. Its own grid (issue 3: estimate vs probe vs 20 steps) is superseded and in git history
(../README.md, "Removed (superseded)").
"""

from __future__ import annotations

import gc
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SHAPES = {
    # ../shared/anchors: R7
    "qwen2-7b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                     max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False),
    # Llama-3-8B shapes: 128k vocabulary
    "llama-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     max_position_embeddings=32768, rope_theta=5e5, tie_word_embeddings=False),
    # Qwen2.5-1.5B shapes: tied 152k table, 6:1 GQA
    "qwen2.5-1.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=131072, rope_theta=1e6, tie_word_embeddings=True),
    # Llama-3.2-3B shapes: tied 128k table, 3:1 GQA, head_dim 128
    "llama-3b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=3072, intermediate_size=8192,
                     num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                     max_position_embeddings=131072, rope_theta=5e5, tie_word_embeddings=True),
    # Mistral-7B shapes: untied 32k table, 4:1 GQA
    "mistral-7b": dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                       max_position_embeddings=131072, rope_theta=1e6, tie_word_embeddings=False, sliding_window=None),
    # held out of the fit: SmolLM2-360M shapes (width 960, not a multiple of 256; tied 49k table, 3:1 GQA)
    "smollm2-360m": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=960, intermediate_size=2560,
                         num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5, vocab_size=49152,
                         max_position_embeddings=131072, rope_theta=1e5, tie_word_embeddings=True),
    # held out of the fit: Qwen2.5-0.5B shapes (width 896, 7:1 GQA, tied 152k table)
    "qwen2.5-0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=131072, rope_theta=1e6, tie_word_embeddings=True),
    # tiny shapes for CPU dry runs of the GPU scripts
    "tiny-tied": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=160,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True),
    "tiny-untied": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=160,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False),
}


def make_checkpoint(shape: str, root: Path, shapes: dict | None = None, sparse: bool = False, **config_overrides) -> Path:
    """A random-init bf16 checkpoint of `shape` (from `shapes`, default SHAPES) with the tiny default's tokenizer;
    `sparse`: its data a hole that reads as zeros (sparse_checkpoint.py: a load then randomizes the weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / shape
    if (out / "config.json").is_file():
        return out
    spec = dict((shapes or SHAPES)[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **{k: v for k, v in spec.items() if k != "architectures"})
    config.architectures = spec["architectures"]
    for k, v in config_overrides.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    if sparse:
        import sparse_checkpoint

        sparse_checkpoint.write(config, out)
    else:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(out, max_shard_size="5GB")
        del model
    gc.collect()
    torch.cuda.empty_cache()
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(REPO / "assets" / "tiny-llama" / f, out / f)
    if config.model_type in ("mistral", "mixtral", "phi3"):   # read by a generic class: the tokenizer.json releases ship
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama").save_pretrained(out)
    return out
