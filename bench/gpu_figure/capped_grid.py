"""The estimate as a card size: the whole train stage capped at it completes, capped 5% lower it fails (issue 21).

    python3 bench/gpu_figure/capped_grid.py need --rows F1 F2 ... --out $OUT/need.json --parallel 4 --max-seconds 420
    python3 bench/gpu_figure/capped_grid.py validate --rows all --out $OUT/validate.json --parallel 4 --max-seconds 480
    python3 bench/gpu_figure/capped_grid.py pages --rows all --out $OUT/pages.json --parallel 8 --max-seconds 480
    python3 bench/gpu_figure/capped_grid.py bracket --rows H12 F10 F17 F18 H8 H10 F13 H5 H15 H4 --out $OUT/bracket.json --parallel 10 --max-seconds 440
    python3 bench/gpu_figure/capped_grid.py spread --rows F18 F10 F17 H8 H15 F13 --from bench/gpu_figure/results/bracket_run3.json --repeats 3 \
        --out $OUT/spread.json --parallel 14 --max-seconds 300
    python3 bench/gpu_figure/capped_grid.py validate --rows T1 T2 --out /tmp/v.json --cpu      # CPU dry run of the plumbing

Each row is a user's run: a random-init checkpoint of a real model's shapes (memory depends on
shapes, not values) with the tiny default's tokenizer, a JSONL file of long-tailed lengths
(log-normal, a few samples over data.max_length, truncated to it), every training default
(packed or padded as the row says, Liger, offloads, 8-bit paged AdamW), 20 optimizer steps with an
eval every 10 and checkpoints, through the stage's own entry points (`stages.preflight.run`, then
`stages.train.run`) in one process per row, the process capped with
`torch.cuda.set_per_process_memory_fraction`. `training.oom_retries: 0`, so an OOM fails the row
instead of being recovered.

  need      the smallest cap the whole stage completes under: one uncapped run (peak allocated A, peak
            reserved R), then a bisection of the cap between A and R (R always completes: an uncapped run
            never reserved more). `need_gib` is the smallest cap seen completing, `fail_gib` the largest
            seen failing. These rows fit the estimate's allocator terms (bench/gpu_figure/fit_capped.py).
  validate  the preflight's estimate E (probe off: the estimate is what is checked here); the stage capped
            at E must complete and capped at 0.95 E must fail.
  pages     the GPU's own figure (probe on): the need the probe measures (PreflightResult.need_gib: its bisected
            step need, scaled) checked the same way, with the whole stage's page figure recorded beside it.
  bracket   the whole stage's need bisected (as `need`, from 1.09x the probe's step need down, 0.5% apart), beside the
            probe's figures: how far apart the two are, row by row.
  spread    the same run at the same cap in separate fresh processes (--repeats each), at 3 caps around a bracket's
            boundary (--from a bracket JSON: 1.5% under its largest failing cap, between, 1.5% over its smallest
            completing one) or at --caps: whether the need is one number at all. --set KEY=VALUE changes every
            run's config (a control: training.offload_activations=off).

Rows run `--parallel` at a time, one process each (their own CUDA context and allocator); a row's line is
appended to <out>.jsonl as it ends, so a call stopped by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "gpu_figure"))

QVO = ["q_proj", "v_proj", "o_proj"]
# Shapes of real models (config.json values), beside bench/gpu_figure/random_checkpoints.py's SHAPES.
MOE_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
NEW_SHAPES = {
    # q/k-norm attention, tied 152k table, 2:1 GQA, head_dim 128 (Qwen3-1.7B)
    "qwen3-1.7b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=True),
    # Qwen3-4B: width 2560, 36 layers, 4:1 GQA
    "qwen3-4b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=True),
    # fused qkv_proj and gate_up_proj, untied 32k, no GQA (Phi-3-mini)
    "phi3-mini": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                      max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=0),
    # fused, tied 200k table, 3:1 GQA, partial rotary (Phi-4-mini)
    "phi4-mini": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192,
                      num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, vocab_size=200064,
                      max_position_embeddings=131072, rope_theta=10000.0, partial_rotary_factor=0.75, tie_word_embeddings=True,
                      pad_token_id=0),
    # q/k norms over the whole projection, untied 100k table, no GQA (OLMo-2-1B)
    "olmo2-1b": dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"], hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, vocab_size=100352,
                     max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=False, pad_token_id=1),
    # Llama-3.2-1B: tied 128k, 4:1 GQA, head_dim 64
    "llama-1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                     max_position_embeddings=131072, rope_theta=5e5, tie_word_embeddings=True),
    # SmolLM2-1.7B: tied 49k, no GQA
    "smollm2-1.7b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=130000.0, tie_word_embeddings=True),
    # Qwen2.5-3B: tied 152k, 8:1 GQA
    "qwen2.5-3b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=2048, intermediate_size=11008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True),
    # Qwen3-0.6B: q/k norms, tied 152k, 2:1 GQA, width 1024 (fit rows F13, F15)
    "qwen3-0.6b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=True),
    # TinyLlama-1.1B: untied 32k, 8:1 GQA (fit rows F14, F16)
    "tinyllama-1.1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=5632,
                           num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                           max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False),
    # SmolLM2-135M: tied 49k, 3:1 GQA, width 576, 30 layers (fit rows F17, F18)
    "smollm2-135m": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    # held out after the constants were validated (session 2026-12-03, sixth): shapes no row had
    # Gemma-2-2B: logit soft-capping, 256k tied table, head_dim 256 over width 2304, 2:1 GQA, sliding window
    "gemma2-2b": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_size=2304, intermediate_size=9216,
                      num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                      max_position_embeddings=8192, rope_theta=10000.0, tie_word_embeddings=True, final_logit_softcapping=30.0,
                      attn_logit_softcapping=50.0, query_pre_attn_scalar=256, sliding_window=4096,
                      hidden_activation="gelu_pytorch_tanh", **MOE_IDS),   # the tiny default tokenizer's ids (the model checks compare them)
    # Mistral-Nemo-12B: heads x head_dim (4096) narrower than the width (5120), untied 131k table, 4:1 GQA, 40 layers
    "mistral-nemo-12b": dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=5120,
                             intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=128, vocab_size=131072, max_position_embeddings=131072, rope_theta=1e6,
                             tie_word_embeddings=False),
    # Granite-3.3-2B (dense, model_type granite): Granite's four multipliers, tied 49k table, 4:1 GQA, 40 layers;
    # Liger has no kernels for it (issue 34: the defaults must train it)
    "granite-3.3-2b": dict(model_type="granite", architectures=["GraniteForCausalLM"], hidden_size=2048, intermediate_size=8192,
                           num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, vocab_size=49159,
                           max_position_embeddings=131072, rope_theta=1e7, tie_word_embeddings=True, embedding_multiplier=12.0,
                           logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.015625, **MOE_IDS),
    # mixtures of experts (issue 34): the released models' config.json shapes; ids those of the tiny default's tokenizer
    # OLMoE-1B-7B: 64 experts top-8, no shared expert, q/k-norm over all heads
    "olmoe-1b-7b": dict(model_type="olmoe", architectures=["OlmoeForCausalLM"], hidden_size=2048, intermediate_size=1024,
                        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                        num_experts_per_tok=8, vocab_size=50304, max_position_embeddings=4096, rope_theta=1e4,
                        tie_word_embeddings=False, **MOE_IDS),
    # Granite-3.0-3B-A800M: 40 experts top-8 under block_sparse_moe, Granite's multipliers; Liger has no kernels for it
    "granitemoe-3b": dict(model_type="granitemoe", architectures=["GraniteMoeForCausalLM"], hidden_size=1536,
                          intermediate_size=512, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
                          num_local_experts=40, num_experts_per_tok=8, vocab_size=49155, max_position_embeddings=4096,
                          tie_word_embeddings=True, embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22,
                          attention_multiplier=0.015625, **MOE_IDS),
    # Qwen3-30B-A3B's layers (128 experts top-8, moe_intermediate 768, 152k untied table), 12 of its 48: a checkpoint
    # of the whole model (57 GiB) does not fit the device's disk beside the rest
    "qwen3-30b-a3b-12l": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                              intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=12, num_attention_heads=32,
                              num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                              vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                              tie_word_embeddings=False, **MOE_IDS),
    # the whole of Qwen3-30B-A3B: its checkpoint written sparse (bench/gpu_figure/sparse_checkpoint.py), read by the real
    # loader, the weights then randomized in place
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, **MOE_IDS),
    # GPT-OSS-20B (32 experts top-4 with biases and a clamped SwiGLU, attention sinks, 128-token sliding windows on every
    # other layer, a 201k table): bf16 (the releases' MXFP4 dequantized), written sparse like the 30B
    "gpt-oss-20b": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
                        tie_word_embeddings=False, attention_bias=True, **MOE_IDS),
    # DeepSeek-V2-Lite (issue 52): latent attention with queries not low-rank (q_lora_rank null: q_proj heads x (nope 128
    # + rope 64), values 128 wide), 64 routed experts top-6 plus 2 shared, the first layer dense, yarn; written sparse
    "deepseek-v2-lite": dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], hidden_size=2048,
                             intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                             first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, head_dim=64, vocab_size=102400, rope_theta=10000,
                             rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                           "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
                             max_position_embeddings=163840, topk_method="greedy", n_group=1, topk_group=1,
                             routed_scaling_factor=1.0, norm_topk_prob=False, rms_norm_eps=1e-6, tie_word_embeddings=False,
                             **MOE_IDS),
    # Mixtral-shaped (8 experts top-2, SwiGLU experts, 4:1 GQA), scaled to width 1024 and 16 layers
    "mixtral-1.5b-8e": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=1024, intermediate_size=3584,
                          num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
                          num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768, rope_theta=1e6,
                          tie_word_embeddings=False, **MOE_IDS),
    "tiny-moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64, intermediate_size=160,
                     moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_experts=4, num_experts_per_tok=2, vocab_size=1000, tie_word_embeddings=False, **MOE_IDS),
    # CPU dry runs
    "tiny-qk": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000, tie_word_embeddings=True),
    "tiny-fused": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=False, pad_token_id=0),
    "tiny-gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_size=64, intermediate_size=160,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
                        tie_word_embeddings=True, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                        query_pre_attn_scalar=16, sliding_window=128, pad_token_id=0),
}

# name: (shape, quant, packing, max_length, micro-batch, r, targets). F rows: the shapes the allocator terms are fitted on;
# H rows: shapes never fitted on (held out); T rows: CPU dry run.
ROWS = {
    "F1": ("qwen2.5-1.5b", "bf16", "off", 2048, 4, 64, QVO),
    "F2": ("qwen2.5-1.5b", "nf4", "on", 4096, 4, 64, QVO),
    "F3": ("llama-3b", "nf4", "off", 4096, 2, 64, QVO),
    "F4": ("llama-3b", "bf16", "on", 2048, 4, 64, QVO),
    "F5": ("qwen3-1.7b", "bf16", "off", 4096, 2, 64, QVO),
    "F6": ("qwen3-1.7b", "nf4", "on", 2048, 8, 64, QVO),
    "F7": ("phi3-mini", "nf4", "off", 2048, 4, 64, QVO),
    "F8": ("phi3-mini", "bf16", "on", 4096, 2, 64, QVO),
    "F9": ("smollm2-1.7b", "bf16", "off", 4096, 2, 16, "all-linear"),
    "F10": ("olmo2-1b", "nf4", "on", 4096, 2, 64, QVO),
    "F11": ("qwen2.5-3b", "nf4", "off", 2048, 4, 64, QVO),
    "F12": ("llama-3b", "nf4", "on", 4096, 4, 16, "all-linear"),
    # fitted in a second round (need_run3): small models, where the allocator's slack is a large share
    "F13": ("qwen3-0.6b", "nf4", "off", 4096, 4, 64, QVO),
    "F14": ("tinyllama-1.1b", "nf4", "off", 2048, 8, 64, QVO),
    "F15": ("qwen3-0.6b", "bf16", "on", 4096, 4, 16, "all-linear"),
    "F16": ("tinyllama-1.1b", "bf16", "on", 4096, 4, 64, QVO),
    "F17": ("smollm2-135m", "nf4", "on", 2048, 4, 64, QVO),
    "F18": ("smollm2-135m", "bf16", "off", 4096, 2, 64, QVO),
    "F19": ("qwen2.5-1.5b", "nf4", "off", 4096, 4, 32, "all-linear"),
    "H1": ("qwen3-4b", "nf4", "off", 2048, 4, 64, QVO),
    "H2": ("qwen3-4b", "bf16", "on", 4096, 2, 64, QVO),
    "H3": ("phi4-mini", "nf4", "on", 4096, 2, 64, QVO),
    "H4": ("phi4-mini", "bf16", "off", 2048, 2, 64, QVO),
    "H5": ("llama-1b", "bf16", "off", 4096, 4, 64, QVO),
    "H6": ("llama-1b", "nf4", "on", 2048, 8, 32, "all-linear"),
    "H7": ("mistral-7b", "nf4", "on", 4096, 2, 64, QVO),
    "H8": ("qwen2.5-0.5b", "bf16", "on", 4096, 4, 64, QVO),
    "H9": ("smollm2-360m", "nf4", "off", 4096, 4, 64, QVO),
    "H10": ("olmo2-1b", "bf16", "off", 2048, 4, 64, QVO),
    "H11": ("qwen2-7b", "nf4", "off", 2048, 2, 64, QVO),
    "H12": ("qwen3-1.7b", "nf4", "off", 4096, 4, 32, "all-linear"),
    "H13": ("qwen2.5-0.5b", "nf4", "off", 2048, 8, 64, QVO),
    "H14": ("llama-1b", "bf16", "on", 4096, 4, 16, "all-linear"),
    "H15": ("smollm2-360m", "bf16", "on", 4096, 4, 64, QVO),
    # N rows: held out from everything, after the 34 above were validated
    # (the project's LoRA defaults: r 16, all-linear)
    "N1": ("llama-8b", "nf4", "on", 4096, 2, 16, "all-linear"),
    "N2": ("mistral-nemo-12b", "nf4", "off", 2048, 2, 16, "all-linear"),
    "N3": ("gemma2-2b", "bf16", "on", 4096, 2, 16, "all-linear"),
    "N4": ("gemma2-2b", "nf4", "off", 2048, 4, 16, "all-linear"),
    # M rows: mixtures of experts, the project's LoRA defaults (r 16, all-linear: attention and every expert stack)
    "M1": ("olmoe-1b-7b", "nf4", "on", 2048, 4, 16, "all-linear"),
    "M2": ("olmoe-1b-7b", "bf16", "off", 2048, 2, 16, "all-linear"),
    "M3": ("granitemoe-3b", "nf4", "off", 2048, 4, 16, "all-linear"),
    "M4": ("granitemoe-3b", "bf16", "on", 4096, 2, 16, "all-linear"),
    "M5": ("qwen3-30b-a3b-12l", "nf4", "on", 2048, 4, 16, "all-linear"),
    "M6": ("qwen3-30b-a3b-12l", "bf16", "off", 2048, 2, 16, "all-linear"),
    "M7": ("mixtral-1.5b-8e", "nf4", "on", 4096, 2, 16, "all-linear"),
    "M8": ("mixtral-1.5b-8e", "bf16", "off", 2048, 4, 16, "all-linear"),
    # the issue's QLoRA goal: the whole Qwen3-30B-A3B, 2 x 2048 tokens per micro-batch, attention + every expert stack
    "M9": ("qwen3-30b-a3b", "nf4", "on", 2048, 2, 16, "all-linear"),
    # GPT-OSS: sinks and sliding windows, which SDPA and the varlen kernel do not compute (flex_attention on a GPU)
    "M10": ("gpt-oss-20b", "nf4", "on", 2048, 2, 16, "all-linear"),
    # a step of 16 samples (gradient accumulation 8, ACCUMULATION): the packed budget the card widens the default to
    # (stages/train/widen.py), 16,384 tokens on an H200, is what the figure must hold at
    "M11": ("qwen3-30b-a3b-12l", "nf4", "on", 2048, 2, 16, "all-linear"),
    "M12": ("qwen3-30b-a3b", "nf4", "on", 2048, 2, 16, "all-linear"),
    # D rows: DeepSeek-V2-Lite whole (latent attention, values narrower than queries and keys), packed and padded, NF4
    # and bf16, the project's LoRA defaults (attention, the dense layer, shared experts and every routed expert stack)
    "D1": ("deepseek-v2-lite", "nf4", "on", 2048, 4, 16, "all-linear"),
    "D2": ("deepseek-v2-lite", "bf16", "off", 4096, 2, 16, "all-linear"),
    "D3": ("deepseek-v2-lite", "nf4", "off", 4096, 2, 16, "all-linear"),
    "D4": ("deepseek-v2-lite", "bf16", "on", 2048, 4, 16, "all-linear"),
    # G rows: a dense family Liger has no kernels for, at the project's defaults
    "G1": ("granite-3.3-2b", "nf4", "on", 4096, 2, 16, "all-linear"),
    "G2": ("granite-3.3-2b", "bf16", "off", 2048, 4, 16, "all-linear"),
    "T1": ("tiny-qk", "bf16", "on", 256, 4, 8, QVO),
    "T2": ("tiny-fused", "bf16", "off", 128, 4, 8, QVO),
    "T3": ("tiny-gemma2", "bf16", "on", 256, 4, 8, "all-linear"),
    "T4": ("tiny-moe", "nf4", "on", 256, 4, 8, "all-linear"),
}
ACCUMULATION = {"M11": 8, "M12": 8}   # training.gradient_accumulation_steps where not the default (1)
STEPS, EVAL_EVERY = 20, 10
SPARSE = {"qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v2-lite"}   # shapes whose checkpoint would not fit the device's disk (sparse_checkpoint.py)
BELOW = 0.95  # validate: the stage capped at this fraction of the estimate must run out


def shapes() -> dict:
    from random_checkpoints import SHAPES

    return SHAPES | NEW_SHAPES


def checkpoint(shape: str, root: Path) -> Path:
    """The shape's checkpoint (written once); a SPARSE one's load, in this process, randomizes the weights it reads."""
    from random_checkpoints import make_checkpoint

    if shape in SPARSE:
        import sparse_checkpoint

        from stages.train import model as train_model

        if not hasattr(train_model.load_base, "__wrapped__"):
            train_model.load_base = sparse_checkpoint.randomized(train_model.load_base)
    return make_checkpoint(shape, root, shapes(), sparse=shape in SPARSE)


def make_data(root: Path, max_length: int, micro_batch: int, packed: bool, seed: int = 0) -> tuple[Path, Path]:
    """Train and eval JSONL of long-tailed lengths (log-normal, median max_length / 6), 3% over max_length
    (truncated to it by the policy), enough samples for STEPS optimizer steps of full micro-batches."""
    from stages.config import ModelSection
    from stages.model.load import load_tokenizer

    out = root / f"data-{max_length}-{micro_batch}-{'packed' if packed else 'padded'}"
    train, held = out / "train.jsonl", out / "eval.jsonl"
    if train.is_file():
        return train, held
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(ModelSection(name_or_path=str(REPO / "assets" / "tiny-llama")))
    words = "sun moon cat bird dog red green blue river stone light rain tree house road book".split()
    rng = random.Random(seed)
    sample = " ".join(rng.choice(words) for _ in range(2000))
    per_word = len(tok(sample, add_special_tokens=False)["input_ids"]) / 2000

    def record(tokens: int) -> dict:
        n = max(4, int(tokens / per_word))
        text = [rng.choice(words) for _ in range(n)]
        cut = max(1, int(0.3 * n))
        return {"prompt": " ".join(text[:cut]), "completion": " ".join(text[cut:])}

    def lengths(total_tokens: int) -> list[int]:
        out, got = [], 0
        while got < total_tokens:
            n = max_length + 64 if rng.random() < 0.03 else int(min(max_length, math.exp(rng.gauss(math.log(max_length / 6), 0.9))))
            out.append(max(16, n))
            got += min(out[-1], max_length)
        return out

    # packed: every micro-batch is a full budget of tokens; padded: micro-batch samples each
    need = STEPS * micro_batch * max_length if packed else STEPS * micro_batch * max_length // 3
    train_lengths = lengths(need) if packed else [max(16, int(min(max_length, math.exp(rng.gauss(math.log(max_length / 6), 0.9)))))
                                                  for _ in range(STEPS * micro_batch)]
    if not packed:  # the longest sample in every few micro-batches, as long-tailed data has it over an epoch
        for i in range(0, len(train_lengths), 4 * micro_batch):
            train_lengths[i] = max_length + 64
    train.write_text("".join(json.dumps(record(n)) + "\n" for n in train_lengths))
    held.write_text("".join(json.dumps(record(n)) + "\n" for n in lengths(4 * max_length)[:24]))
    return train, held


def row_config(name: str, model_dir: Path, train: Path, held: Path, work: Path, cpu: bool, probe: bool = False):
    from stages.config import RunConfig

    shape, quant, packing, max_length, mb, r, targets = ROWS[name]
    return RunConfig.model_validate({
        "model": {"name_or_path": str(model_dir)},
        "data": {"train_file": str(train), "eval_file": str(held), "max_length": max_length, "long_sample_policy": "truncate",
                 "num_proc": 1},
        # MoE: the default dropout, which becomes 0 where experts are adapted (peft has none on them)
        "lora": {"r": r, "lora_alpha": 32, "target_modules": targets} | ({} if name[0] in "MD" or shape == "tiny-moe" else {"lora_dropout": 0.05}),
        "quantization": {"load_in_4bit": quant == "nf4"},
        # every memory setting at its default; only the run's length and the failure mode are the bench's
        "training": {"per_device_train_batch_size": mb, "gradient_accumulation_steps": ACCUMULATION.get(name, 1),
                     "packing": packing, "max_steps": STEPS, "eval_steps": EVAL_EVERY,
                     "save_steps": EVAL_EVERY, "logging_steps": 5, "oom_retries": 0, "learning_rate": 1e-4},
        "preflight": {"probe": probe},
        "smoke": {"check": "stops", "max_prompts": 4, "n_ctx": 2 * max_length + 128},  # held-out prompts are as long as training's
        "export": {"fidelity": {"samples": 4}},
        "handoff": {"model_name": "bench"},
        "artifacts_dir": str(work / "artifacts"),
    })


def trial(cfg, out: Path, cap_gib: float | None, pages: bool = False) -> dict:
    """The train stage under a cap (None: uncapped); what it peaked at, and whether it completed."""
    import gc
    import traceback

    import torch

    from stages import memory, train
    from stages.memory import GIB

    cuda = torch.cuda.is_available()
    memory.free_gpu()
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total) if cap_gib else 1.0)
    t0 = time.perf_counter()
    row = {"cap_gib": round(cap_gib, 4) if cap_gib else None}
    need = memory.page_need() if pages else None  # no figure off CUDA (page_need says None there)
    try:
        with need or contextlib.nullcontext():
            r = train.run(cfg, out)
        row |= {"ok": True, "steps": r.steps, "evals": len(r.eval_curve), "tokens_per_s": r.tokens_per_s}
    except Exception as e:  # the OOM a cap causes (TrainOOMError), or anything else: recorded, the row goes on
        row |= {"ok": False, "error": f"{type(e).__name__}: {str(e)[:240]}"}
        traceback.clear_frames(e.__traceback__)
        del e
    finally:
        gc.collect()
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    for pm in sorted(out.glob("oom-postmortem-*.json")):  # where it ran out: a training step or an eval pass
        report = json.loads(pm.read_text())
        row |= {"oom_step": report.get("step"), "oom_phase": report.get("phase")}
    mem = json.loads((out / "memory.json").read_text()) if (out / "memory.json").is_file() else {}
    row |= {k: mem.get(k) for k in ("peak_alloc_gib", "peak_reserved_gib")} | {"seconds": round(time.perf_counter() - t0, 1)}
    if need and need.gib:
        row["pages_gib"] = round(need.gib, 4)  # the whole stage's page figure (memory.page_need), beside the probe's
    memory.free_gpu()
    if cuda:
        row["left_alloc_gib"] = round(torch.cuda.memory_allocated() / GIB, 4)
    return row


def spread_job(name: str, cap: float, rep: int, work: Path, cpu: bool, overrides: list[str] = ()) -> dict:
    """One fresh process, one run of the row's train stage capped at `cap` (no preflight, no probe before it).
    `overrides`: KEY=VALUE config changes (e.g. training.offload_activations=off, a control)."""
    import yaml

    shape, quant, packing, max_length, mb, r, targets = ROWS[name]
    model_dir = checkpoint(shape, work / "models")
    train_file, held = make_data(work, max_length, mb, packing == "on")
    job_dir = work / "rows" / f"{name}-{cap:.4f}-{rep}"
    cfg = row_config(name, model_dir, train_file, held, job_dir, cpu)
    for item in overrides:
        key, value = item.split("=", 1)
        section, field = key.split(".")
        cfg = cfg.model_copy(update={section: getattr(cfg, section).model_copy(update={field: yaml.safe_load(value)})})
    t = trial(cfg, job_dir / "train", None if cpu else cap)
    # cpu: the cap named, none applied (t's cap_gib)
    return t | {"name": name, "cap_gib": round(cap, 4), "rep": rep, "overrides": list(overrides)}


def spread_caps(bracket: dict) -> list[float]:
    """1.5% under the bracket's largest failing cap, the middle, 1.5% over its smallest completing one."""
    lo, hi = bracket["run_fail_gib"], bracket["run_need_gib"]
    return [round(c, 4) for c in (0.985 * lo, (lo + hi) / 2, 1.015 * hi)]


def bisect_cap(go, lo: float, hi: float, need: float | None, fail: float | None, tries: int, deadline: float,
               finer_than: float = 0.0) -> tuple[float | None, float | None]:
    """Halve [lo, hi] `tries` times with go(cap) (a trial: its "ok"); returns (smallest cap seen completing, largest
    seen failing). Stops early past the deadline, once hi - lo < finer_than x hi, or with no completing cap to start from."""
    for _ in range(tries):
        if need is None or time.time() > deadline or hi - lo < finer_than * hi:
            break
        mid = (lo + hi) / 2
        if go(mid)["ok"]:
            hi = need = mid
        else:
            lo = fail = mid
    return need, fail


def run_row(mode: str, name: str, work: Path, cpu: bool, deadline: float) -> dict:
    import torch

    from stages import preflight
    from stages.train import memory_model

    shape, quant, packing, max_length, mb, r, targets = ROWS[name]
    model_dir = checkpoint(shape, work / "models")
    train_file, held = make_data(work, max_length, mb, packing == "on")
    row_dir = work / "rows" / name
    cfg = row_config(name, model_dir, train_file, held, row_dir, cpu, probe=mode in ("pages", "bracket"))
    spec = {"name": name, "shape": shape, "quant": quant, "packing": packing, "max_length": max_length, "micro_batch": mb,
            "r": r, "targets": targets, "held_out": name.startswith("H"), "config_json": json.loads((model_dir / "config.json").read_text())}
    pre = preflight.run(cfg, row_dir / "preflight", train_only=True)  # the train stage only: no export tools here
    est = pre.estimate.total_gib
    spec |= {"estimate_gib": est, "estimate_items": pre.estimate.items_gib, "longest": pre.lengths.max,
             "worst_batch_tokens": pre.lengths.worst_batch_tokens, "packed": pre.lengths.packed, "n_samples": pre.lengths.n_samples,
             "targets_resolved": memory_model.Shapes.from_config(spec["config_json"]).targets(targets).summary(r)}
    trials = []

    def go(cap, pages=False):
        t = trial(cfg, row_dir / f"train-{len(trials)}", cap, pages)
        trials.append(t)
        print(name, json.dumps(t), flush=True)
        return t

    if not torch.cuda.is_available():  # CPU: the plumbing only
        go(None)
        return spec | {"trials": trials}
    if mode == "bracket":  # the run's need bisected beside the probe's step need
        p = pre.probe
        spec |= {"need_gib": pre.need_gib, "probe_step_need_gib": p and p.step_need_gib,
                 "probe_pages_gib": p and p.pages_gib, "probe_build_pages_gib": p and p.build_pages_gib,
                 "probe_seconds": pre.memory.wall_s if pre.memory else None}
        if not (p and p.step_need_gib):
            return spec | {"trials": trials, "error": f"no step need from the probe ({p and p.error})"}
        step = p.step_need_gib
        lo, hi, fail, need = 0.95 * step, 1.09 * step, None, None
        if go(hi)["ok"]:
            need = hi
        else:  # over 9%: one look further up, then the bracket is what it is
            lo = fail = hi
            hi = 1.2 * step
            if time.time() < deadline and go(hi)["ok"]:
                need = hi
        need, fail = bisect_cap(go, lo, hi, need, fail, 5, deadline)
        return spec | {"trials": trials, "run_need_gib": need and round(need, 4), "run_fail_gib": fail and round(fail, 4)}
    if mode == "pages":  # the GPU figure: the probe's step need, scaled (PreflightResult.need_gib), checked like the estimate
        p = pre.probe
        spec |= {"need_gib": pre.need_gib, "probe_pages_gib": p and p.pages_gib, "probe_build_pages_gib": p and p.build_pages_gib,
                 "probe_step_need_gib": p and p.step_need_gib, "probe_eval_need_gib": p and p.eval_need_gib, "probe_peak_alloc_gib": p and p.peak_alloc_gib,
                 "probe_peak_reserved_gib": p and p.peak_reserved_gib, "probe_seconds": pre.memory.wall_s if pre.memory else None}
        if not pre.need_gib:
            return spec | {"trials": trials, "error": f"no page figure from the probe ({p and p.error})"}
        at = go(pre.need_gib, pages=True)
        below = go(BELOW * pre.need_gib) if time.time() < deadline else None
        return spec | {"trials": trials, "completes_at_need": at["ok"], "fails_below": None if below is None else not below["ok"]}
    if mode == "validate":
        at = go(est)
        below = go(BELOW * est) if time.time() < deadline else None
        return spec | {"trials": trials, "completes_at_estimate": at["ok"], "fails_below": None if below is None else not below["ok"]}
    free = go(None)
    lo, hi = free["peak_alloc_gib"], free["peak_reserved_gib"]
    # stops at 1%: finer than the +5% window the estimate must land in
    need, fail = bisect_cap(go, lo, hi, hi, None, 4, deadline, finer_than=0.01)
    return spec | {"trials": trials, "alloc_gib": free["peak_alloc_gib"], "reserved_gib": free["peak_reserved_gib"],
                   "need_gib": round(need, 4), "fail_gib": round(fail, 4) if fail else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["need", "validate", "pages", "bracket", "spread"])
    ap.add_argument("--from", dest="source", type=Path, help="spread: the bracket JSON whose boundaries it tests")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--caps", type=float, nargs="+", help="spread: these caps (GiB) for every row instead of --from's")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spread: a config change for every run")
    ap.add_argument("--cap", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--rep", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rows", nargs="+", required=True, help="row names, or all (every F and H row)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/capped-grid"))
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--max-seconds", type=float, default=420)
    ap.add_argument("--cpu", action="store_true", help="CPU dry run (no caps)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    rows = [n for n in ROWS if n[0] in "FH"] if a.rows == ["all"] else a.rows
    lines = a.out.with_suffix(".jsonl")
    if a.child:
        try:
            result = (spread_job(a.child, a.cap, a.rep, a.work, a.cpu, a.set) if a.mode == "spread"
                      else run_row(a.mode, a.child, a.work, a.cpu, a.deadline))
        except Exception as e:
            import traceback

            result = {"name": a.child, "error": f"{type(e).__name__}: {str(e)[:400]}", "traceback": traceback.format_exc()[-2000:]}
        with lines.open("a") as f:
            f.write(json.dumps(result) + "\n")
        return
    deadline = time.time() + a.max_seconds
    # the checkpoints first, one per shape, so parallel rows never write the same model
    import torch

    t0 = time.perf_counter()
    made = {}
    for shape in dict.fromkeys(ROWS[n][0] for n in rows):
        s = time.perf_counter()
        checkpoint(shape, a.work / "models")
        made[shape] = round(time.perf_counter() - s, 1)
    for n in rows:  # the data too: rows of one length and micro-batch share a file, written before any reads it
        make_data(a.work, ROWS[n][3], ROWS[n][4], ROWS[n][2] == "on")
    print(f"checkpoints: {made}", flush=True)
    env = os.environ | {"OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}

    jobs = [(n, None, None) for n in rows]
    if a.mode == "spread":  # every (row, cap) --repeats times, the repeats of one cap far apart in the queue
        brackets = {r["name"]: r for r in json.loads(a.source.read_text())["rows"]} if a.source else {}
        jobs = [(n, c, k) for k in range(a.repeats) for n in rows for c in (a.caps or spread_caps(brackets[n]))]

    def child(job) -> int:
        name, cap, rep = job
        if time.time() > deadline:
            return -1
        cmd = [sys.executable, __file__, a.mode, "--rows", name, "--out", str(a.out), "--work", str(a.work), "--child", name,
               "--deadline", str(deadline)] + (["--cpu"] if a.cpu else []) + ([] if cap is None else ["--cap", str(cap), "--rep", str(rep)])
        cmd += [x for item in a.set for x in ("--set", item)]
        tag = name if cap is None else f"{name}-{cap:.4f}-{rep}"
        with (a.work / f"{tag}.log").open("w") as log:
            try:
                return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=max(30, deadline - time.time() + 90)).returncode
            except subprocess.TimeoutExpired:
                return -2

    with concurrent.futures.ThreadPoolExecutor(a.parallel) as pool:
        codes = {"/".join(str(x) for x in job if x is not None): code for job, code in zip(jobs, pool.map(child, jobs), strict=True)}
    results = [json.loads(x) for x in lines.read_text().splitlines()] if lines.is_file() else []
    a.out.write_text(json.dumps({"mode": a.mode, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                 "torch": torch.__version__, "checkpoint_seconds": made, "exit_codes": codes,
                                 "wall_s": round(time.perf_counter() - t0, 1), "rows": results}, indent=1))
    if a.mode == "spread":  # outcomes per (row, cap): the same run, the same cap, fresh processes
        by: dict = {}
        for r in results:
            by.setdefault((r["name"], r.get("cap_gib")), []).append(r.get("ok"))
        summary = [{"name": n, "cap_gib": c, "outcomes": v} for (n, c), v in sorted(by.items(), key=lambda x: (x[0][0], x[0][1] or 0))]
        data = json.loads(a.out.read_text())
        a.out.write_text(json.dumps(data | {"summary": summary}, indent=1))
        results = summary
    for r in results:
        keep = ("need_gib", "fail_gib", "run_need_gib", "run_fail_gib", "cap_gib", "outcomes", "alloc_gib", "reserved_gib", "estimate_gib", "probe_pages_gib", "probe_step_need_gib", "completes_at_estimate",
                "completes_at_need", "fails_below", "error")
        print(r.get("name"), {k: r.get(k) for k in keep if k in r})


if __name__ == "__main__":
    main()
