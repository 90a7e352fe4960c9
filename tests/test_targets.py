"""LoRA adapts what was asked, or the run is refused by name: target modules resolved against the model itself,
fused projections (Phi-3's qkv_proj / gate_up_proj) mapped with one line saying so, and the estimate counting
exactly what is adapted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from stages import preflight, train
from stages.config import ConfigError, load_config
from stages.model import architecture
from stages.train import memory_model
from stages.train import model as lora_model
from tests.conftest import REPO, write_config

TINY_PHI3 = dict(model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=False)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    """A random-init model with fused projections and the tiny default's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("phi3")
    spec = dict(TINY_PHI3)
    config = AutoConfig.for_model(spec.pop("model_type"), **{k: v for k, v in spec.items() if k != "architectures"})
    config.architectures = spec["architectures"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(REPO / "assets" / "tiny-llama" / f, out / f)
    return out


def test_fused_projections_take_the_names_they_fuse():
    arch = architecture.from_config(TINY_PHI3)
    assert arch.model_class == "Phi3ForCausalLM" and set(arch.linears) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    t = architecture.resolve_targets(["q_proj", "v_proj", "o_proj"], arch)
    assert t.modules == ["o_proj", "qkv_proj"]
    assert t.notes == ["lora.target_modules: q_proj, v_proj are fused into qkv_proj in Phi3ForCausalLM: adapting qkv_proj "
                       "(its adapter also covers k_proj)"]
    # r x (in + out) per instance: qkv 64 -> 64 + 2 x 32, o 64 -> 64, two layers
    assert t.params(8) == 2 * 8 * ((64 + 128) + (64 + 64))
    mlp = architecture.resolve_targets(["gate_proj", "up_proj", "down_proj"], arch)
    assert mlp.modules == ["gate_up_proj", "down_proj"] and "gate_proj, up_proj are fused into gate_up_proj" in mlp.notes[0]
    with pytest.raises(ConfigError, match=r"\['c_fc'\] match no linear module of Phi3ForCausalLM; its linear modules are"):
        architecture.resolve_targets(["q_proj", "c_fc"], arch)


def test_the_estimate_counts_the_adapted_modules():
    s = memory_model.Shapes.from_config(TINY_PHI3)
    from tests.test_preflight import cfg as make_cfg

    c = make_cfg(lora={"r": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]})
    est = memory_model.estimate(c, s, 16, on_gpu=False)
    lora = next(v for k, v in est.items_bytes.items() if k.startswith("LoRA"))
    assert lora == 2 * 8 * ((64 + 128) + (64 + 64)) * 16  # fp32 weight + grad + AdamW's two states
    assert "0.0 M params" in next(k for k in est.items_bytes if k.startswith("LoRA"))


def test_a_fused_model_trains_its_fused_modules_and_says_so(phi3_dir, tmp_path, capsys):
    cfg = load_config(write_config(tmp_path, model={"name_or_path": str(phi3_dir)},
                                   lora={"r": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]},
                                   training={"max_steps": 3, "save_steps": 3, "packing": "off"}))
    r = train.run(cfg, tmp_path / "train")
    out = capsys.readouterr().out
    assert "train: lora.target_modules: q_proj, v_proj are fused into qkv_proj in Phi3ForCausalLM: adapting qkv_proj" in out
    assert r.steps == 3 and r.trainable_params == 2 * 8 * ((64 + 128) + (64 + 64))
    adapter = json.loads((tmp_path / "train" / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["o_proj", "qkv_proj"]
    # train_only: llama.cpp cannot read this made-up Phi-3 with a Llama tokenizer (the next test shows it refused)
    pre = preflight.run(cfg, tmp_path / "pre", train_only=True)
    assert "LoRA adapts o_proj x2, qkv_proj x2: 0.01 M LoRA parameters at r=8. lora.target_modules: q_proj, v_proj are fused" in \
        pre.report_md.read_text()


def test_a_vocabulary_llama_cpp_reads_otherwise_is_refused_before_training(phi3_dir, tmp_path):
    """A made-up Phi-3 with a Llama tokenizer: its GGUF is not named as a Phi-3 (its tokenizer does not strip after
    Phi-3's chat tokens), so llama.cpp loads the vocabulary, and tokenizes it otherwise than transformers does."""
    from stages.export.vocab import TokenizerMismatch

    cfg = load_config(write_config(tmp_path, model={"name_or_path": str(phi3_dir)}))
    with pytest.raises(TokenizerMismatch, match=r"tokenizes differently from the HF tokenizer of .*phi3.* give .* the "
                       r"tokenizer.json the model was released with"):
        preflight.run(cfg, tmp_path / "pre")


def test_all_linear_adapts_every_linear_but_the_output_layer(phi3_dir, tmp_path):
    cfg = load_config(write_config(tmp_path, model={"name_or_path": str(phi3_dir)}, lora={"r": 4, "target_modules": "all-linear"}))
    model = lora_model.build_model(cfg)
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_a_module_the_model_lacks_is_refused_by_the_preflight_cli_before_loading(tmp_path):
    cfg = write_config(tmp_path, lora={"target_modules": ["q_proj", "qkv_proj"]})
    p = subprocess.run([sys.executable, "-m", "stages.preflight", "--config", str(cfg)], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if "stopped" in x]
    assert len(lines) == 1 and "['qkv_proj'] match no linear module of LlamaForCausalLM" in lines[0] and "Traceback" not in p.stderr
    assert "set lora.target_modules" in lines[0]
