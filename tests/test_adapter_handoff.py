"""The LoRA adapter in the bundle, for servers that hot-swap it (handoff.adapter: auto): shipped only once llama.cpp
has shown that the base GGUF with the adapter GGUF is the merged model, and served with it; else left out with the
reason in the manifest. The shipped case and a failed proof run on the default run's own adapter and GGUFs (the
session's `e2e`): no pipeline run of their own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stages import handoff, memory
from stages.config import load_config
from stages.export import adapter, llamacpp
from tests.conftest import write_config
from tests.test_handoff import gguf

ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors", "adapter-f16.gguf"}


def _publish_with(tmp_path, lora_config: dict, **sections):
    cfg = load_config(write_config(tmp_path, **sections))
    lora = tmp_path / "adapter"
    lora.mkdir()
    (lora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32, **lora_config}))
    (lora / "adapter_model.safetensors").write_bytes(b"never read: refused from its config")
    b = handoff.run(cfg, "v1", [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"one"))], tmp_path / "stage" / "v1", adapter_dir=lora,
                    data_fingerprint="f" * 64, smoke={}, memory={}, merged_gguf=gguf(tmp_path, "model-f16.gguf", b"merged"))
    return b, json.loads(b.manifest.read_text())["adapter"]["hot_swap"]


@pytest.mark.parametrize("lora_config, why", [
    ({"use_rslora": True}, "rsLoRA: peft scales it by lora_alpha / sqrt(r), llama.cpp applies an adapter GGUF's lora_alpha / r"),
    ({"target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}, "it adapts fused MoE expert stacks"),
    ({"alpha_pattern": {"q_proj": 64}}, "per-module alpha (alpha_pattern {'q_proj': 64}): the adapter GGUF holds one lora_alpha"),
    ({"use_dora": True}, "DoRA: its magnitude vectors"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
], ids=["rslora", "moe-experts", "alpha_pattern", "dora", "modules_to_save"])
def test_an_adapter_the_converter_would_misread_is_left_out_and_the_manifest_says_why(tmp_path, lora_config, why):
    b, hot = _publish_with(tmp_path, lora_config)
    assert hot["shipped"] is False and why in hot["reason"]
    assert not ADAPTER_FILES & {p.name for p in b.bundle_dir.iterdir()}  # the merged GGUFs only
    assert f"Not in this bundle: {hot['reason']}. Serve the merged GGUFs above." in (b.bundle_dir / "README.md").read_text()


def test_an_adapter_the_converter_maps_is_not_refused_for_what_llama_cpp_reads_right():
    """Per-module ranks with one alpha: llama.cpp scales each tensor by alpha / its own rank, as peft does."""
    assert adapter.unmappable({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "rank_pattern": {"q_proj": 8},
                               "alpha_pattern": {"k_proj": 32}, "use_rslora": False, "target_parameters": None}) is None


def test_handoff_adapter_off_ships_the_merged_ggufs_only(tmp_path):
    b, hot = _publish_with(tmp_path, {}, handoff={"adapter": "off"})
    assert hot == {"shipped": False, "reason": "handoff.adapter: off"} and not ADAPTER_FILES & {p.name for p in b.bundle_dir.iterdir()}


@pytest.mark.slow
def test_the_default_bundle_holds_the_adapter_proven_against_the_merged_gguf(e2e):
    result, _, _ = e2e
    bundle, run_dir = Path(result["bundle"]), Path(result["run_dir"])
    hot = json.loads((bundle / "manifest.json").read_text())["adapter"]["hot_swap"]
    assert hot["shipped"] and ADAPTER_FILES <= {p.name for p in bundle.iterdir()}
    parity = hot["parity"]
    assert parity["against"] == "model-f16.gguf" and parity["passed"] and parity["positions"] > 300
    assert parity["mean_kl"] <= 1e-3 and parity["top1_agreement"] >= 0.99  # measured: 4e-6, 100%
    assert hot["served"]["accuracy"] >= 0.9 and hot["served"]["n_prompts"] == 50  # measured 50/50 through llama.cpp's server
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # the PEFT files as training saved them
        assert (bundle / name).read_bytes() == (run_dir / "train" / "adapter" / name).read_bytes()
    info = llamacpp.read_gguf(bundle / "adapter-f16.gguf")
    f = info["fields"]
    assert (f["general.type"], f["adapter.type"], f["adapter.lora.alpha"], f["general.name"]) == ("adapter", "lora", 32.0, "tiny-llama-translate")
    assert len(info["tensor_types"]) == hot["gguf_tensors"] == 2 * 7 * 2  # lora_a and lora_b of 7 modules in 2 layers
    assert not list((run_dir / "handoff" / "adapter").glob("base-*.gguf"))  # the base GGUF is gone once measured
    card = (bundle / "README.md").read_text()
    assert "## The adapter, for servers that hot-swap" in card and "--lora adapter-f16.gguf" in card


@pytest.mark.slow
def test_the_bundle_s_peft_adapter_loads_with_peft_and_is_the_merged_model(e2e):
    """vLLM and peft load the bundle's folder as a PEFT adapter directory: peft on the base model gives the merged
    model's next-token distribution."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result, cfg_path, _ = e2e
    cfg = load_config(cfg_path)
    bundle, run_dir = Path(result["bundle"]), Path(result["run_dir"])
    ids = torch.tensor([list(range(1, 40))])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=torch.float32)
        tuned = PeftModel.from_pretrained(base, bundle).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "merge" / "model", dtype=torch.float32)(input_ids=ids).logits
    # the merged model is saved in the base's bf16: that rounding alone moves a log-probability of this tiny model by
    # 0.04-0.054, as the trained weights fall (two trainings equal to 2e-7 in their first gradients)
    assert torch.allclose(torch.log_softmax(tuned, -1), torch.log_softmax(merged, -1), atol=0.08)
    assert (tuned.argmax(-1) == merged.argmax(-1)).float().mean() >= 0.97


@pytest.mark.slow
def test_an_adapter_llama_cpp_scales_wrongly_fails_its_parity_and_is_not_shipped(e2e, tmp_path):
    """The gate, on a real misreading: the default's adapter with lora_alpha 8 written where it trained at 32 (the
    converter writes the alpha it reads, as it would an rsLoRA adapter's) is a quarter of the fine-tune. The proof
    measures it against the merged GGUF and leaves it out with the figures; the base GGUF is deleted either way."""
    result, cfg_path, _ = e2e
    run_dir = Path(result["run_dir"])
    misread = tmp_path / "adapter"
    shutil.copytree(run_dir / "train" / "adapter", misread)
    config = json.loads((misread / "adapter_config.json").read_text())
    (misread / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": 8.0}))
    with memory.track("handoff", tmp_path / "stage", gpu=False) as meter:
        proof = adapter.prove(load_config(cfg_path), misread, run_dir / "export" / "model-f16.gguf", tmp_path / "work", meter)
    assert not proof.record["shipped"] and proof.files == []
    assert "with adapter-f16.gguf on the base GGUF is not the merged model" in proof.record["reason"]
    parity = proof.record["parity"]
    assert not parity["passed"] and parity["mean_kl"] > parity["max_mean_kl"], parity
    assert not list((tmp_path / "work").glob("base-*.gguf"))


def test_an_adapter_proof_the_disk_cannot_hold_is_skipped_not_the_run(tmp_path):
    """The proof converts the base model to a GGUF as large as the merged one: where the filesystem has less free,
    the merged GGUFs ship and the manifest says how much the adapter would have needed."""
    lora = tmp_path / "adapter"
    lora.mkdir()
    (lora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32}))
    (lora / "adapter_model.safetensors").write_bytes(b"not read")
    merged = tmp_path / "model-f16.gguf"
    with merged.open("wb") as f:
        f.truncate(1 << 42)  # a sparse 4 TiB: larger than the free space here, and no bytes written
    with memory.track("handoff", tmp_path / "stage", gpu=False) as meter:
        proof = adapter.prove(load_config(write_config(tmp_path)), lora, merged, tmp_path / "work", meter)
    assert not proof.record["shipped"] and proof.files == []
    assert proof.record["reason"].startswith("the proof converts the base model to a GGUF as large as model-f16.gguf (4096.00 GiB)")
    assert "free space there to ship the adapter" in proof.record["reason"]
