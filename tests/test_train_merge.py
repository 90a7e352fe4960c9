"""Train (LoRA and QLoRA on CPU) and merge, on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel

from stages import merge, train
from stages.config import load_config
from stages.model.load import load_base, load_tokenizer
from stages.train import model as lora_model
from tests.conftest import write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    """A short QLoRA run (bitsandbytes NF4 on CPU) with checkpoints every 3 steps."""
    tmp = tmp_path_factory.mktemp("qlora")
    cfg = load_config(write_config(tmp, quantization={"load_in_4bit": True},
                                   training={"max_steps": 6, "save_steps": 3, "logging_steps": 1, "per_device_train_batch_size": 8}))
    return cfg, train.run(cfg, tmp / "train")


def test_model_is_set_up_the_way_that_saves_memory(tmp_path):
    cfg = load_config(write_config(tmp_path, quantization={"load_in_4bit": True}))
    model = lora_model.build_model(cfg)
    base = model.get_base_model()
    assert model.training and base.training  # checkpointing is a no-op in eval mode
    assert base.is_gradient_checkpointing
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # QLoRA: matrices in 4 bits, embeddings and head not upcast to fp32 by a prepare step
    import bitsandbytes as bnb

    assert isinstance(base.model.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    assert base.model.embed_tokens.weight.dtype == base.lm_head.weight.dtype != torch.float64


def test_qlora_trains_checkpoints_and_records_memory(qlora):
    cfg, r = qlora
    out = r.adapter_dir.parent
    assert r.steps == 6 and r.first_loss > r.final_loss
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-3", "checkpoint-6"]
    steps = [json.loads(line) for line in (out / "memory_steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6] and all(s["peak_rss_gib"] > 0 for s in steps)
    assert json.loads((out / "memory.json").read_text())["stage"] == "train"
    assert r.loss_png.is_file()


def test_train_resumes_from_the_last_checkpoint(qlora, tmp_path):
    cfg, r = qlora
    out = r.adapter_dir.parent
    # As after a crash at step 6 (before the adapter was written): only checkpoints remain.
    import shutil

    work = tmp_path / "train"
    shutil.copytree(out / "checkpoints" / "checkpoint-3", work / "checkpoints" / "checkpoint-3")
    resumed = train.run(cfg, work)
    assert resumed.resumed_from.endswith("checkpoint-3") and resumed.steps == 6
    assert json.loads((work / "memory.json").read_text())["extra"]["steps_this_process"] == 3


def test_second_run_skips_a_finished_stage(qlora):
    cfg, r = qlora
    again = train.run(cfg, r.adapter_dir.parent)
    assert again.skipped and again.steps == r.steps


def test_qlora_adapter_merges_into_the_unquantized_base(qlora, tmp_path):
    cfg, r = qlora
    m = merge.run(cfg, r.adapter_dir, tmp_path / "merge")
    saved = json.loads((m.merged_dir / "config.json").read_text())
    assert "quantization_config" not in saved and saved["dtype"] == "bfloat16"
    assert {"tokenizer.model", "tokenizer_config.json", "model.safetensors", "generation_config.json"} <= {p.name for p in m.merged_dir.iterdir()}
    assert m.max_abs_logit_diff < 1e-3
    # both merges measured against the adapter on the NF4 base it trained with; the closer one kept
    assert set(m.kl) == {"16bit", "dequantized-nf4"} and m.base == min(m.kl, key=lambda k: m.kl[k]["mean_kl"])
    assert m.kl["dequantized-nf4"]["mean_kl"] < m.kl["16bit"]["mean_kl"]


def test_merged_logits_equal_adapter_logits_and_differ_from_base(tmp_path):
    # no warmup: three steps at the full learning rate move the adapter well past bf16 rounding
    cfg = load_config(write_config(tmp_path, training={"max_steps": 3, "per_device_train_batch_size": 8, "save_steps": 100, "warmup_steps": 0}))
    r = train.run(cfg, tmp_path / "train")
    m = merge.run(cfg, r.adapter_dir, tmp_path / "merge")
    tok = load_tokenizer(cfg.model)
    x = tok("[INST] Translate to French: red cat [/INST]", return_tensors="pt")
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(m.merged_dir, dtype=torch.float32)(**x).logits
        adapter = PeftModel.from_pretrained(load_base(cfg.model, cfg.quantization), r.adapter_dir)(**x).logits
        base = load_base(cfg.model, cfg.quantization)(**x).logits
    # merged weights are stored in bf16, like the base: equal up to bf16 rounding
    assert torch.allclose(merged, adapter, rtol=0.03, atol=0.05), (merged - adapter).abs().max()
    assert torch.equal(merged.argmax(-1), adapter.argmax(-1))
    # ...while training moved them well beyond that rounding
    assert (merged - base).abs().max() > 5 * (merged - adapter).abs().max()


def test_merge_points_at_the_stage_that_makes_its_input(tmp_path):
    cfg = load_config(write_config(tmp_path))
    with pytest.raises(FileNotFoundError, match="written by the train stage"):
        merge.run(cfg, tmp_path / "no-adapter", tmp_path / "merge")
