"""One tiny random-init model of every decoder family that transformers 5.17 and llama.cpp's converter share,
through preflight -> train -> merge -> GGUF -> llama.cpp smoke on CPU, with the project's defaults (Liger where it
has the family's kernels, the plain loss elsewhere; all-linear, routed experts included). Each family gets the
tokenizer files its releases ship: SentencePiece (the default's tiny-llama) or byte-level BPE (tiny-chatml), a
tokenizer.json beside tokenizer.model where transformers picks a generic class for the model_type, Phi-3's own
special tokens. Where the files are not what the family's releases ship, the preflight refuses, naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages import merge, preflight, smoke
from stages.config import load_config
from stages.export import stage as export_stage
from stages.export.vocab import TokenizerMismatch
from stages.train import stage as train_stage
from tests.conftest import REPO, write_config
from tests.tiny_models import random_model

SHAPE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=1024, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2)
# family -> (tokenizer asset, what the family's config needs beyond SHAPE)
FAMILIES = {
    "llama": ("tiny-llama", dict(intermediate_size=512)),
    "mistral": ("tiny-llama", dict(intermediate_size=512)),
    "mixtral": ("tiny-llama", dict(intermediate_size=256, num_local_experts=4, **MOE)),
    "phi3": ("tiny-llama", dict(intermediate_size=512)),
    "gemma2": ("tiny-llama", dict(intermediate_size=768)),
    "gemma3_text": ("tiny-llama", dict(intermediate_size=512)),
    "qwen2": ("tiny-chatml", dict(intermediate_size=512)),
    "qwen3": ("tiny-chatml", dict(intermediate_size=512)),
    "qwen3_moe": ("tiny-chatml", dict(intermediate_size=512, moe_intermediate_size=128, num_experts=4, **MOE)),
    "granite": ("tiny-chatml", dict(intermediate_size=512)),
    "granitemoe": ("tiny-chatml", dict(intermediate_size=256, num_local_experts=4, **MOE)),
    "olmo2": ("tiny-chatml", dict(intermediate_size=512)),
    # llama.cpp's OLMoE applies k_norm over all heads' width: its releases have as many KV heads as query heads
    "olmoe": ("tiny-chatml", dict(intermediate_size=256, num_experts=4, num_key_value_heads=4, **MOE)),
    "smollm3": ("tiny-chatml", dict(intermediate_size=512)),
    # DeepSeek-V2-Lite's latent attention: queries not low-rank (q_lora_rank null), queries and keys nope + rope wide,
    # values narrower; llama.cpp reads a deepseek2 GGUF without q_lora_rank only at 26 or 27 layers (its is_lite)
    "deepseek_v2": ("tiny-chatml", dict(num_hidden_layers=26, intermediate_size=256, moe_intermediate_size=64,
                                        n_routed_experts=4, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=64,
                                        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, head_dim=16,
                                        num_key_value_heads=4, first_k_dense_replace=1, topk_method="greedy", n_group=1,
                                        topk_group=1, **MOE)),
}
MOE_FAMILIES = {f for f, (_, extra) in FAMILIES.items() if "num_experts_per_tok" in extra}


def tiny_model(family: str, out: Path, *, released_tokenizer: bool = True) -> tuple[Path, str]:
    """A random-init `family` model in `out` with a tokenizer as the family's releases ship it (or, with
    released_tokenizer=False, only the asset's files)."""
    asset, extra = FAMILIES[family]
    return random_model(family, SHAPE | extra, asset, out, released_tokenizer=released_tokenizer), asset


def _config(tmp_path: Path, model_dir: Path, asset: str, *, quant_types: tuple[str, ...] = ("Q4_K_M",), imatrix: str = "off"):
    base = REPO / "configs" / ("chatml.yaml" if asset == "tiny-chatml" else "default.yaml")
    # random weights: the export's fidelity and the smoke's accuracy have nothing to hold; that they run is the point
    # one K-quant per family keeps 15 families inside CI's time; both are the default's, tested elsewhere
    loose = dict.fromkeys(("f16", *quant_types), 1.0)
    return load_config(write_config(
        tmp_path, base=base, model={"name_or_path": str(model_dir)},
        training={"max_steps": 4, "save_steps": 4, "eval_steps": 4},
        export={"imatrix": imatrix, "quant_types": list(quant_types),
                "fidelity": {"samples": 4, "max_mean_kl": loose, "min_top1": dict.fromkeys(loose, 0.0)}},
        smoke={"min_accuracy": 0.0, "max_prompts": 3, "max_tokens": 8, "serve": False}))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_merges_exports_and_runs_under_llama_cpp(family, tmp_path):
    model_dir, asset = tiny_model(family, tmp_path / "model")
    cfg = _config(tmp_path, model_dir, asset)

    pre = preflight.run(cfg, tmp_path / "preflight")
    assert ("routed experts" in pre.adapted) == (family in MOE_FAMILIES), pre.adapted

    trained = train_stage.run(cfg, tmp_path / "train")
    assert trained.steps == 4 and trained.final_loss == trained.final_loss   # finite, not NaN
    lora = load_file(trained.adapter_dir / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in lora.items()), "the adapter did not train"
    if family in MOE_FAMILIES:   # the experts' adapter is saved and trained, not only attention's
        experts = [v for k, v in lora.items() if ".experts." in k and "lora_B" in k]
        assert experts and all(v.abs().sum() > 0 for v in experts), sorted(lora)[:8]

    merged = merge.run(cfg, trained.adapter_dir, tmp_path / "merge")
    exported = export_stage.run(cfg, merged.merged_dir, tmp_path / "export")
    assert [f.quant for f in exported.files] == cfg.export.quant_types
    smoked = smoke.run(cfg, [(f.quant, f.path) for f in exported.files], tmp_path / "smoke")
    assert [f.quant for f in smoked.files] == cfg.export.quant_types
    assert all(f.n_prompts == 3 and f.load_s > 0 for f in smoked.files)


def test_a_qlora_moe_trains_on_nf4_experts_and_merges_into_both_bases(tmp_path):
    from stages.model.experts import nf4 as expert_nf4
    from stages.model.load import load_base

    model_dir, asset = tiny_model("qwen3_moe", tmp_path / "model")
    cfg = _config(tmp_path, model_dir, asset)
    cfg = cfg.model_copy(update={"quantization": cfg.quantization.model_copy(update={"load_in_4bit": True})})
    base = load_base(cfg.model, cfg.quantization)
    assert sum(map(len, expert_nf4.stacks(base).values())) == 4   # gate_up_proj and down_proj of both layers
    del base

    trained = train_stage.run(cfg, tmp_path / "train")
    lora = load_file(trained.adapter_dir / "adapter_model.safetensors")
    experts = [v for k, v in lora.items() if ".experts." in k and "lora_B" in k]
    assert len(experts) == 4 and all(v.abs().sum() > 0 for v in experts)

    merged = merge.run(cfg, trained.adapter_dir, tmp_path / "merge")   # auto: the 16-bit and the dequantized NF4 base
    assert set(merged.kl) == {"16bit", "dequantized-nf4"} and merged.base in merged.kl
    # the adapter ran on NF4 experts: merged into those same experts, dequantized, it is the closer of the two
    assert merged.kl["dequantized-nf4"]["mean_kl"] < merged.kl["16bit"]["mean_kl"]
    exported = export_stage.run(cfg, merged.merged_dir, tmp_path / "export")
    assert [f.quant for f in smoke.run(cfg, [(f.quant, f.path) for f in exported.files], tmp_path / "smoke").files] == ["Q4_K_M"]


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_a_family_without_the_tokenizer_its_releases_ship_is_refused_at_preflight_with_the_fix(family, tmp_path):
    """The SentencePiece model alone: transformers reads it for these model_types with a generic class that does
    not read `legacy` (so that switch, which the message used to advise, is no fix)."""
    model_dir, asset = tiny_model(family, tmp_path / "model", released_tokenizer=False)
    cfg = _config(tmp_path, model_dir, asset)
    with pytest.raises(TokenizerMismatch, match=r"tokenizes differently .* TokenizersBackend, the class transformers picks for "
                       r"this model_type, does not read \"legacy\": give .*model the tokenizer.json the model was released with"):
        preflight.run(cfg, tmp_path / "preflight")
    assert not (tmp_path / "train").exists()
