"""What the families beyond the end-to-end set get right without a training run (bench/released_configs/families.py: a CPU sweep of
41 families through every stage): the attention each is trained with is the attention it is exported with, its
linear modules and experts are found or the run is refused by name, the merged config keeps the release's
architecture name, llama.cpp's per-layer settings and multi-token-prediction layers are handled."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from stages import merge, smoke
from stages.config import ConfigError, load_config
from stages.model import architecture
from stages.train import kernels, memory_model
from tests.conftest import REPO, write_config

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=512, max_position_embeddings=4096)


def arch_of(model_type: str, **extra) -> architecture.Architecture:
    return architecture.from_config(dict(SMALL, model_type=model_type) | extra)


def test_attention_is_the_one_the_model_computes():
    gpt_oss = arch_of("gpt_oss", num_local_experts=4, num_experts_per_tok=2)
    gemma2 = arch_of("gemma2")
    llama = arch_of("llama")
    assert gpt_oss.attention.extras == ("attention sinks",) and not gpt_oss.attention.sdpa
    assert gemma2.attention.extras == ("logit soft-capping",)
    assert llama.attention.extras == () and llama.attention.sliding_window is None
    # auto: SDPA where it computes the model, else flex_attention on a GPU and eager elsewhere
    assert architecture.attention_implementation("auto", llama, cuda=True) == "sdpa"
    assert architecture.attention_implementation("auto", gpt_oss, cuda=False) == "eager"
    assert architecture.attention_implementation("auto", gemma2, cuda=True) == "flex_attention"
    # an explicit sdpa on a soft-capping model is the user's trade, said by the preflight; on a class without an SDPA path, refused
    assert architecture.attention_implementation("sdpa", gemma2, cuda=True) == "sdpa"
    assert architecture.sdpa_skips("sdpa", gemma2) == ["logit soft-capping"] and architecture.sdpa_skips("auto", gemma2) == []
    with pytest.raises(ConfigError, match=r"sdpa: transformers has no SDPA path for GptOssForCausalLM \(attention sinks\); set it to auto"):
        architecture.attention_implementation("sdpa", gpt_oss, cuda=False)


def test_a_sliding_window_counts_only_where_the_model_uses_it_and_samples_pass_it():
    phi3 = arch_of("phi3", sliding_window=2047, pad_token_id=0)
    assert phi3.attention.varlen_misses(2047) == []
    assert phi3.attention.varlen_misses(4096) == ["a 2047-token sliding window (samples up to 4096 tokens)"]
    assert arch_of("qwen2", sliding_window=1024).attention.sliding_window is None   # carried, not used (use_sliding_window)
    assert arch_of("gemma2").attention.sliding_window == 4096


def model_dir(tmp_path, model_type: str, **extra):
    """config.json, the tiny default's tokenizer and a weights file's name: what the settings read."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    out = tmp_path / model_type
    AutoConfig.for_model(model_type, **(dict(SMALL) | extra)).save_pretrained(out)
    save_file({"placeholder": torch.zeros(1)}, str(out / "model.safetensors"))
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(REPO / "assets" / "tiny-llama" / f, out / f)
    return out


def test_packing_keeps_varlen_off_a_soft_capped_model_and_refuses_it_forced(tmp_path):
    gemma2 = model_dir(tmp_path, "gemma2", pad_token_id=0)
    cfg = load_config(write_config(tmp_path, model={"name_or_path": str(gemma2)}))
    assert kernels.resolve_auto(cfg, on_gpu=False)["packed_attention"] == "mask"
    assert kernels.resolve_auto(cfg, on_gpu=True)["packed_attention"] == "flex_attention"
    llama = load_config(write_config(tmp_path, model={"name_or_path": str(model_dir(tmp_path, "llama"))}))
    assert kernels.resolve_auto(llama, on_gpu=True)["packed_attention"] == "varlen"
    forced = load_config(write_config(tmp_path, model={"name_or_path": str(gemma2)}, training={"packed_attention": "varlen"}))
    with pytest.raises(ConfigError, match=r"varlen computes plain causal attention, without this model's logit soft-capping"):
        kernels.resolve_auto(forced, on_gpu=True)
    # sdpa chosen: the soft-capping is given up already, varlen gives up nothing more
    traded = load_config(write_config(tmp_path, model={"name_or_path": str(gemma2), "attn_implementation": "sdpa"}))
    assert kernels.resolve_auto(traded, on_gpu=True)["packed_attention"] == "varlen"


def test_linear_subclasses_are_adapted_and_a_model_with_none_is_refused():
    falcon = architecture.from_config(dict(model_type="falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           num_kv_heads=2, new_decoder_architecture=True, ffn_hidden_size=256, vocab_size=512))
    assert set(architecture.resolve_targets("all-linear", falcon).modules) == {"query_key_value", "dense", "dense_h_to_4h",
                                                                               "dense_4h_to_h"}
    assert "router" not in architecture.resolve_targets("all-linear", arch_of("phimoe", num_local_experts=4,
                                                                              num_experts_per_tok=2)).modules


def test_experts_all_linear_cannot_reach_are_refused_not_left_untrained():
    dbrx = architecture.from_config(dict(model_type="dbrx", d_model=64, n_heads=4, n_layers=2, vocab_size=512,
                                         attn_config=dict(kv_n_heads=2, rope_theta=10000.0),
                                         ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)))
    assert dbrx.declared_experts == 4 and not dbrx.experts.stacks
    with pytest.raises(ConfigError, match=r"all-linear would leave the 4 routed experts of DbrxForCausalLM untrained"):
        architecture.resolve_targets("all-linear", dbrx)
    assert architecture.resolve_targets(["Wqkv", "out_proj"], dbrx).modules == ["Wqkv", "out_proj"]


def test_per_layer_expert_counts_read_as_the_widest():
    s = memory_model.Shapes.from_config(dict(SMALL, model_type="qwen2_moe", num_experts=8, moe_topk=[2, 4], architectures=["X"]))
    assert s.top_k == 4 and s.experts == 8


def test_the_merged_config_keeps_the_release_architecture_name(tmp_path):
    base, merged = tmp_path / "base", tmp_path / "merged"
    base.mkdir(), merged.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "phimoe", "architectures": ["PhiMoEForCausalLM"],
                                                  "auto_map": {"AutoModelForCausalLM": "modeling_phimoe.PhiMoEForCausalLM"}}))
    (merged / "config.json").write_text(json.dumps({"model_type": "phimoe", "architectures": ["PhimoeForCausalLM"], "dtype": "bfloat16"}))
    merge.keep_release_names(base, merged)
    kept = json.loads((merged / "config.json").read_text())
    assert kept["architectures"] == ["PhiMoEForCausalLM"] and kept["auto_map"]["AutoModelForCausalLM"].endswith("PhiMoEForCausalLM")
    assert kept["dtype"] == "bfloat16"


def test_the_serving_plan_reads_per_layer_kv_heads():
    """A hybrid's GGUF (Jamba, LFM2) gives head_count_kv per layer, 0 on its recurrent layers: the KV cache counts those."""
    info = {"fields": {"general.architecture": "jamba", "jamba.block_count": 4, "jamba.embedding_length": 64,
                       "jamba.attention.head_count": 4, "jamba.attention.head_count_kv": [0, 2, 0, 0]},
            "tensor_bytes": {f"blk.{i}.w": 2**20 for i in range(4)} | {"token_embd.weight": 2**20}}
    plan = smoke.plan_offload(info, n_ctx=1024, gpu_memory_gib=None, gpu_offload=False)
    uniform = smoke.plan_offload(info | {"fields": info["fields"] | {"jamba.attention.head_count_kv": 2}}, 1024, None, False)
    assert plan.kv_cache_gib == pytest.approx(uniform.kv_cache_gib / 4)


@pytest.mark.filterwarnings("ignore")
def test_the_converter_is_never_asked_for_multi_token_prediction_layers(tmp_path):
    """transformers drops Qwen3-Next's mtp.* at load, so a merged one has none, and the converter asserted it must."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.export import llamacpp, vocab

    out = tmp_path / "qwen3_next"
    config = AutoConfig.for_model("qwen3_next", **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
                                  linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "assets" / "tiny-chatml" / f, out / f)
    job = vocab.start(out, llamacpp.converter_dir())
    assert job.wait().is_file()
