"""Mixture-of-experts models through the product: all-linear and named targets reach the fused expert stacks
(and leave the routers frozen), peft's refusals on experts become one message, the train stage trains the
experts (through the grouped LoRA) and the merge adds exactly each expert's B_e @ A_e. Tiny random-init
models of real MoE families with the default tiny tokenizer, on CPU."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from stages import merge
from stages.config import load_config
from stages.errors import ConfigError
from stages.model import architecture
from stages.train import stage as train_stage
from tests.conftest import REPO, killed_rerun_against_straight, write_config

VOCAB = 448   # the tiny tokenizer's
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=VOCAB, max_position_embeddings=512, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": dict(intermediate_size=128, moe_intermediate_size=32, num_experts=4),
    "granitemoe": dict(intermediate_size=32, num_local_experts=4),
}


def _save(family: str, out):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **COMMON, **FAMILIES[family])
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(REPO / "assets" / "tiny-llama" / f, out / f)
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe_dir(request, tmp_path_factory):
    return _save(request.param, tmp_path_factory.mktemp(request.param))


def _config(tmp_path, model_dir, **sections):
    """The default config on `model_dir`, lora_dropout left to its default (the YAML's 0.0 taken out)."""
    path = write_config(tmp_path, model={"name_or_path": str(model_dir)}, **sections)
    raw = yaml.safe_load(path.read_text())
    if "lora_dropout" not in sections.get("lora", {}):
        raw["lora"].pop("lora_dropout")
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_config(path)


def _arch(model_dir):
    return architecture.from_config_text((model_dir / "config.json").read_text())


def test_all_linear_adapts_the_routed_experts_and_not_the_router(moe_dir):
    arch = _arch(moe_dir)
    t = architecture.resolve_targets("all-linear", arch)
    assert t.modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert sorted(s.leaf for s in t.stacks) == ["down_proj", "down_proj", "gate_up_proj", "gate_up_proj"]
    assert t.parameters == ["experts.down_proj", "experts.gate_up_proj"]
    # 2 layers x 4 experts x r x ((64 + 64) + (32 + 64)) for gate_up [2I=64, H=64] and down [H, I=32]
    assert t.expert_params(8) == 2 * 4 * 8 * ((64 + 64) + (32 + 64))
    s = t.summary(8)
    assert "routed experts: gate_up_proj x2, down_proj x2 (4 experts each, rank 8 per expert): 0.01 M LoRA parameters" in s
    assert s.endswith("routers frozen")


def test_attention_only_says_the_experts_stay_frozen(moe_dir):
    t = architecture.resolve_targets(["q_proj", "v_proj"], _arch(moe_dir))
    assert t.stacks == [] and t.parameters == []
    assert "routed experts NOT adapted (4 stacks" in t.summary(8)


def test_mlp_names_reach_the_fused_experts_with_a_note(moe_dir):
    arch = _arch(moe_dir)
    t = architecture.resolve_targets(["q_proj", "gate_proj", "up_proj", "down_proj"], arch)
    assert t.modules == ["q_proj"] and {s.leaf for s in t.stacks} == {"gate_up_proj", "down_proj"}
    assert any("gate_proj is the routed experts' gate_up_proj" in n for n in t.notes)
    assert architecture.resolve_targets(["experts"], arch).parameters == ["experts.down_proj", "experts.gate_up_proj"]
    with pytest.raises(ConfigError, match=r"routed experts' stacks \['down_proj', 'gate_up_proj'\] \(or `experts` for all\)"):
        architecture.resolve_targets(["q_proj", "w9"], arch)


def test_dropout_on_experts_is_zero_by_default_and_refused_when_asked(moe_dir, tmp_path):
    arch = _arch(moe_dir)
    t = architecture.resolve_targets("all-linear", arch)
    cfg = _config(tmp_path, moe_dir)
    assert cfg.lora.lora_dropout == 0.05
    assert architecture.lora_kwargs(cfg.lora, t)["lora_dropout"] == 0.0
    assert architecture.dropout_note(cfg.lora, architecture.lora_kwargs(cfg.lora, t))
    asked = _config(tmp_path, moe_dir, lora={"lora_dropout": 0.1})
    with pytest.raises(ConfigError, match=r"lora.lora_dropout is 0.1, but the routed experts .* set lora.lora_dropout: 0"):
        architecture.lora_kwargs(asked.lora, t, arch.model_class)
    attention = architecture.resolve_targets(["q_proj"], arch)
    assert architecture.lora_kwargs(asked.lora, attention)["lora_dropout"] == 0.1   # no experts: dropout as asked


def test_the_train_stage_trains_the_experts_and_merge_adds_exactly_their_delta(moe_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    cfg = _config(tmp_path, moe_dir, lora={"r": 4, "lora_alpha": 8},
                  training={"max_steps": 3, "save_steps": 3, "learning_rate": 1e-2})
    r = train_stage.run(cfg, tmp_path / "train")
    out = capsys.readouterr().out
    assert "peft has no dropout on the fused expert weights" in out
    assert r.trainable_params == architecture.resolve_targets("all-linear", _arch(moe_dir)).params(4)
    weights = load_file(tmp_path / "train" / "adapter" / "adapter_model.safetensors")
    expert_b = {k: v for k, v in weights.items() if ".experts." in k and "lora_B" in k}
    assert len(expert_b) == 4 and all(v.abs().max() > 0 for v in expert_b.values())   # B starts at zero: trained
    assert not any(".gate." in k or ".router." in k for k in weights)                   # routers frozen

    m = merge.run(cfg, tmp_path / "train" / "adapter", tmp_path / "merge")
    base = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(m.merged_dir, dtype=torch.float32)
    scaling = 8 / 4
    for key, b in expert_b.items():
        # peft nests one wrapper per stack (...experts.lora_A, ...experts.base_layer.lora_A): A's input width says which
        a = weights[key.replace("lora_B", "lora_A")]
        module = key.removeprefix("base_model.model.").replace(".base_layer", "").replace(".lora_B.weight", "")
        name = f"{module}.{'gate_up_proj' if a.shape[1] == COMMON['hidden_size'] else 'down_proj'}"
        w0, w1 = base.get_parameter(name), merged.get_parameter(name)
        e = w0.shape[0]
        delta = torch.stack([scaling * b[:, i::e] @ a[i * 4:(i + 1) * 4] for i in range(e)])
        assert torch.allclose(w1 - w0, delta.to(w0.dtype), atol=2e-3 * delta.abs().max().item()), name
    assert json.loads((tmp_path / "merge" / "merge_result.json").read_text())["max_abs_logit_diff"] < 1e-2


def test_the_model_card_names_the_experts_rank():
    from stages.export import modelcard

    line = modelcard._adapted({"r": 16, "lora_alpha": 32, "target_modules": ["k_proj", "q_proj"],
                               "target_parameters": ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]})
    assert line == ["LoRA r 16 (alpha 32) on k_proj, q_proj; routed experts: mlp.experts.down_proj, mlp.experts.gate_up_proj, "
                    "rank 16 per expert, merged into every expert."]
    assert modelcard._adapted({"sha256": "x", "method": "lora"}) == []   # a manifest from before the field


def test_a_killed_moe_training_resumes_to_the_same_experts_bit_for_bit(tmp_path):
    """kill -9 after a checkpoint, then the same command: the rerun resumes from the checkpoint (peft's expert LoRA
    factors and their optimizer states loaded back onto the fused stacks) and ends where an uninterrupted run does."""
    model_dir = _save("qwen3_moe", tmp_path / "model")
    cfg_path = write_config(tmp_path, model={"name_or_path": str(model_dir)}, lora={"r": 4, "lora_alpha": 8},
                            training={"max_steps": 8, "save_steps": 2, "learning_rate": 1e-2, "warmup_steps": 0})
    result, a = killed_rerun_against_straight(cfg_path, tmp_path, 4)
    assert result["resumed_from"].endswith(("checkpoint-4", "checkpoint-6")) and result["steps"] == 8
    experts = [k for k in a if ".experts." in k]
    assert experts and all(a[k].abs().max() > 0 for k in experts if "lora_B" in k)


def test_the_best_checkpoint_kept_at_the_end_holds_its_experts(tmp_path):
    """training.load_best (load_best_model_at_end) on a MoE: a learning rate too small to lower the eval loss after
    the first eval, so the adapter written is step 1's, the expert factors included, not the last step's."""
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join((REPO / "assets/data/translate_eval.jsonl").read_text().splitlines(keepends=True)[:8]))
    cfg = _config(tmp_path, _save("qwen3_moe", tmp_path / "model"), data={"eval_file": str(eval_file)},
                  lora={"r": 4, "lora_alpha": 8},
                  training={"max_steps": 12, "save_steps": 1, "eval_steps": 1, "early_stopping_patience": 2,
                            "learning_rate": 1e-12, "warmup_steps": 0, "per_device_train_batch_size": 2,
                            "max_tokens_per_batch": 64})
    r = train_stage.run(cfg, tmp_path / "train")
    assert r.stopped_early and r.best_step == r.adapter_step == 1
    ckpt = tmp_path / "train" / "checkpoints"
    adapter = load_file(r.adapter_dir / "adapter_model.safetensors")
    best, last = (load_file(ckpt / f"checkpoint-{s}" / "adapter_model.safetensors") for s in (1, r.steps))
    experts = [k for k in best if ".experts." in k]
    assert experts and adapter.keys() == best.keys()
    assert all(torch.equal(adapter[k], best[k]) for k in best)
    assert any(not torch.equal(adapter[k], last[k]) for k in experts)   # the later steps did move the experts
