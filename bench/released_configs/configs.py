"""Released models' config.json values, as their users have them: every key that decides a tensor's shape, the
attention or the loss (queries not low-rank, head_dim other than hidden / heads, partial rotary, soft-capping, tied
embeddings, multipliers, per-layer types, expert counts), copied from the release named in `source`. Token ids
(bos/eos/pad) are left out: each copy takes its tokenizer's.

Read by tests/test_released_configs.py and bench/released_configs/sweep.py: checkpoint() writes a release at full
size as a header-only checkpoint (the preflight's input); model() its narrowest copy that keeps every ratio, random-init
(narrow(): the release's widths and ratios at a few layers), for every stage."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

YARN_V2_LITE = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                "mscale": 0.707, "mscale_all_dim": 0.707}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

# family name -> (source release, config.json values)
RELEASES: dict[str, tuple[str, dict]] = {
    # --- dense ---
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B", dict(  # tied embeddings, head_dim 64
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=32.0), max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True)),
    "mistral-7b-v0.3": ("mistralai/Mistral-7B-v0.3", dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32768, rope_theta=1000000.0, max_position_embeddings=32768,
        sliding_window=None, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "mistral-nemo-12b": ("mistralai/Mistral-Nemo-Base-2407", dict(  # head_dim 128, not 5120 / 32 = 160
        model_type="mistral", hidden_size=5120, intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=131072, rope_theta=1000000.0, max_position_embeddings=1024000,
        sliding_window=None, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0, max_position_embeddings=131072,
        rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False)),
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B", dict(  # tied, 14 heads of 64
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3-8b": ("Qwen/Qwen3-8B", dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", dict(  # head_dim 128 over a 1024 hidden size: queries 2048 wide; tied
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "gemma-2-2b": ("google/gemma-2-2b", dict(  # soft-capping, a 4096-token window every other layer, head_dim 256
        model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, query_pre_attn_scalar=256, sliding_window=4096,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "gemma-3-1b": ("google/gemma-3-1b-pt", dict(  # one global layer in six, a 512-token window, one KV head
        model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, query_pre_attn_scalar=256, sliding_window=512,
        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=32768,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "phi-3-mini-4k": ("microsoft/Phi-3-mini-4k-instruct", dict(  # fused qkv and gate_up projections
        model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, sliding_window=2047,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "granite-3.3-2b": ("ibm-granite/granite-3.3-2b-base", dict(  # multipliers and a linear logit scale; tied
        model_type="granite", hidden_size=2048, intermediate_size=8192, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=49159, embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
        attention_multiplier=0.015625, rope_theta=10000000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True)),
    "olmo-2-7b": ("allenai/OLMo-2-1124-7B", dict(  # q/k norms over all heads, norms after the sublayers
        model_type="olmo2", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=100352, rope_theta=500000.0, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "smollm3-3b": ("HuggingFaceTB/SmolLM3-3B-Base", dict(  # no RoPE in every fourth layer; tied
        model_type="smollm3", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=128256, rope_theta=5000000.0, max_position_embeddings=65536,
        no_rope_layer_interval=4, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "starcoder2-3b": ("bigcode/starcoder2-3b", dict(  # biases everywhere, LayerNorm, a 4096-token window
        model_type="starcoder2", hidden_size=3072, intermediate_size=12288, num_hidden_layers=30, num_attention_heads=24,
        num_key_value_heads=2, vocab_size=49152, sliding_window=4096, use_bias=True, norm_epsilon=1e-5,
        rope_theta=999999.4420358813, max_position_embeddings=16384, tie_word_embeddings=True)),
    "stablelm-2-1.6b": ("stabilityai/stablelm-2-1_6b", dict(  # a quarter of each head rotated, q/k/v biases, LayerNorm
        model_type="stablelm", hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=100352, partial_rotary_factor=0.25, use_qkv_bias=True, layer_norm_eps=1e-5,
        rope_theta=10000, max_position_embeddings=4096, tie_word_embeddings=False)),
    # --- mixtures of experts ---
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, rope_theta=1000000.0,
        max_position_embeddings=32768, sliding_window=None, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "qwen1.5-moe-a2.7b": ("Qwen/Qwen1.5-MoE-A2.7B", dict(  # 60 experts top-4 and a shared expert with its own gate
        model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, vocab_size=151936, rope_theta=1000000.0,
        max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, rope_theta=1000000.0,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "olmoe-1b-7b": ("allenai/OLMoE-1B-7B-0924", dict(
        model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304, rope_theta=10000.0,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "granite-3.0-3b-a800m": ("ibm-granite/granite-3.0-3b-a800m-base", dict(
        model_type="granitemoe", hidden_size=1536, intermediate_size=512, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, num_local_experts=40, num_experts_per_tok=8, vocab_size=49155, embedding_multiplier=12.0,
        logits_scaling=6.0, residual_multiplier=0.22, attention_multiplier=0.015625, rope_theta=10000.0,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "deepseek-v2-lite": ("deepseek-ai/DeepSeek-V2-Lite", dict(  # latent attention, queries not low-rank, yarn
        model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, head_dim=64, vocab_size=102400, rope_theta=10000,
        rope_scaling=YARN_V2_LITE, max_position_embeddings=163840, topk_method="greedy", n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=False, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "gpt-oss-20b": ("openai/gpt-oss-20b", dict(  # sinks, a 128-token window every other layer, expert biases
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
        rope_theta=150000, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096},
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
}

# the tokenizer asset a copy takes: SentencePiece (tiny-llama) where the family's releases ship one, else byte-level BPE
SENTENCEPIECE = {"llama-3.1-8b": False, "mistral-7b-v0.3": True, "mistral-nemo-12b": False, "gemma-2-2b": True,
                 "gemma-3-1b": True, "phi-3-mini-4k": True, "mixtral-8x7b": True}

# The fewest decoder layers that keep a release's per-layer pattern, or that llama.cpp reads the family at (else 2)
LAYERS = {
    "gemma-3-1b": 6,          # one global layer in six
    "smollm3-3b": 4,          # no RoPE in every fourth layer
    "deepseek-v2-lite": 26,   # llama.cpp reads a deepseek2 GGUF without q_lora_rank only at 26 or 27 layers (its is_lite)
}
INTERMEDIATE = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
# The copy's feed-forward weights, all layers together: a budget that keeps each copy's training, merge and export
# in a few GiB of a CPU's memory at the release's own hidden size (which its head count x head_dim fixes)
FFN_BUDGET = 64_000_000


def _experts(v: dict) -> int:
    return v.get("num_local_experts") or v.get("num_experts") or v.get("n_routed_experts") or 0


def _expert_width_key(v: dict) -> str | None:
    return ("moe_intermediate_size" if v.get("moe_intermediate_size") else "intermediate_size") if _experts(v) else None


def _ffn_params(v: dict) -> int:
    experts = _experts(v)
    if not experts:
        return 3 * v["hidden_size"] * v["intermediate_size"] * v["num_hidden_layers"]
    width = v[_expert_width_key(v)]
    shared = v.get("shared_expert_intermediate_size") or (v.get("n_shared_experts") or 0) * width
    dense = v.get("first_k_dense_replace") or 0
    return 3 * v["hidden_size"] * ((experts * width + shared) * (v["num_hidden_layers"] - dense) + v["intermediate_size"] * dense)


def narrow(name: str) -> tuple[str, dict, dict]:
    """The narrowest copy of a release that keeps every ratio: every key of its config.json as released (hidden size,
    head counts, head_dim, the latent attention's ranks and nope/rope split, expert counts and top-k, shared experts,
    partial rotary, soft-capping, windows, multipliers, tied tables) but the decoder layers (LAYERS, else 2; per-layer
    lists cut to them) and the intermediate sizes, all divided by one power of two (so their ratios stay) until the
    feed-forward weights fit FFN_BUDGET, or no larger one divides them all and leaves the experts' width a multiple of
    8. The vocabulary is the tokenizer asset's.
    Returns the model_type, the config values and what was changed: {key: [release, copy]}."""
    values = dict(RELEASES[name][1])
    model_type = values.pop("model_type")
    layers = LAYERS.get(name, 2)
    copy = dict(values, num_hidden_layers=layers)
    if "layer_types" in copy:
        copy["layer_types"] = copy["layer_types"][:layers]
    sizes = {k: copy[k] for k in INTERMEDIATE if copy.get(k)}
    expert = _expert_width_key(copy)

    def can_halve(d: int) -> bool:   # torch's grouped matmul, which runs the experts, needs rows of 16 bytes (8 bf16)
        return all(w % (2 * d) == 0 for w in sizes.values()) and (expert is None or sizes[expert] % (16 * d) == 0)

    divisor = 1
    while _ffn_params(copy | {k: w // divisor for k, w in sizes.items()}) > FFN_BUDGET and can_halve(divisor):
        divisor *= 2
    copy |= {k: w // divisor for k, w in sizes.items()}
    changed = {k: [values.get(k), copy[k]] for k in copy if copy[k] != values.get(k)}
    return model_type, copy, changed


def asset(name: str) -> str:
    return "tiny-llama" if SENTENCEPIECE.get(name) else "tiny-chatml"


def model(name: str, out: Path) -> tuple[Path, str, dict]:
    """The release's narrow copy (narrow()), random-init, with the asset tokenizer its family's releases ship; returns
    the directory, the asset's name and what was changed from the release (the vocabulary included)."""
    _ensure_repo_importable()
    from tests.tiny_models import random_model

    model_type, values, changed = narrow(name)
    random_model(model_type, values, asset(name), out)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    return out, asset(name), changed | {"vocab_size": [RELEASES[name][1]["vocab_size"], vocab]}


def _ensure_repo_importable() -> None:
    for path in (REPO, REPO / "bench" / "gpu_figure"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def checkpoint(name: str, out: Path) -> tuple[Path, str]:
    """The release's model at full size as safetensors headers (bench/gpu_figure/sparse_checkpoint.py: no disk, no
    weights), with the asset tokenizer its family's releases ship (SentencePiece or byte-level BPE) and that
    tokenizer's special token ids; returns the directory and the asset's name."""
    _ensure_repo_importable()
    import sparse_checkpoint
    from transformers import AutoConfig

    from tests.tiny_models import tokenizer_files

    spec = dict(RELEASES[name][1])
    model_type = spec.pop("model_type")
    _vocab, special = tokenizer_files(model_type, asset(name), out)
    sparse_checkpoint.write(AutoConfig.for_model(model_type, **spec, **special), out)
    return out, asset(name)
