"""The fused LoRA layer (stages/train/fused_lora.py): peft's outputs and gradients from one autograd function, on
16-bit and 4-bit bases, with and without dropout; peft's own forward wherever the call is not a plain one; and the
train stage's model uses it by default."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from stages.config import ConfigError, load_config
from stages.train import fused_lora, kernels
from tests.conftest import write_config

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attention_bias=True)   # a bias on q/k/v: addmm's bias path


def _pair(dropout: float, nf4: bool, where=None, **lora):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SMALL))
    if nf4:   # the 4-bit base as QLoRA loads it: bitsandbytes' NF4 layers, on the CPU
        from transformers import BitsAndBytesConfig

        base.save_pretrained(where)
        base = AutoModelForCausalLM.from_pretrained(where, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
        assert type(base.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules="all-linear", **lora))
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:   # B starts at zero: give the adapter something to add
            torch.nn.init.normal_(p, std=0.05)
    fused = copy.deepcopy(peft_model)
    return peft_model, fused, fused_lora.use(fused)


def _loss_and_grads(model, ids, seed: int):
    model.zero_grad()
    torch.manual_seed(seed)   # the same dropout masks in both
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("nf4", [False, True], ids=["16bit", "nf4"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_fused_layer_computes_what_peft_computes(nf4, dropout, tmp_path):
    peft_model, fused, n = _pair(dropout, nf4, tmp_path)
    assert n == 2 * 7   # every adapted linear layer of both decoder layers
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24))
    for m in (peft_model, fused):
        m.train()
    (a, ga), (b, gb) = _loss_and_grads(peft_model, ids, 1), _loss_and_grads(fused, ids, 1)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert ga.keys() == gb.keys() and len(ga) == 4 * 7
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-4, atol=1e-6, msg=k)
    assert type(fused(input_ids=ids).logits.grad_fn).__name__ != ""   # a forward still returns the logits
    q = fused.base_model.model.model.layers[0].self_attn.q_proj
    y = q(torch.randn(3, SMALL["hidden_size"], requires_grad=True))
    assert type(y.grad_fn).__name__ == "LoRALinearBackward"


def test_peft_forward_where_the_call_is_not_a_plain_one():
    peft_model, fused, _ = _pair(0.0, False)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 12))
    q = fused.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 5, SMALL["hidden_size"])
    with fused.disable_adapter():   # the base alone
        assert q(x).grad_fn is None or type(q(x).grad_fn).__name__ != "LoRALinearBackward"
        with torch.no_grad():
            torch.testing.assert_close(q(x), q.base_layer(x))
    with torch.no_grad():   # merged into the base: the same logits as unmerged, through the base layer
        before = fused(input_ids=ids).logits
        fused.merge_adapter()
        torch.testing.assert_close(fused(input_ids=ids).logits, before, rtol=1e-4, atol=1e-5)
        fused.unmerge_adapter()
    dora = _pair(0.0, False, use_dora=True)[2]
    assert dora == 0   # DoRA's magnitude vector is not this function's maths


def test_the_stage_model_uses_it_and_it_can_be_switched_off(tmp_path):
    from stages.train.model import build_model

    cfg = load_config(write_config(tmp_path, training={"max_steps": 1}))
    assert kernels.settings(cfg).fused_lora
    model = build_model(cfg)
    fused = [m for m in model.modules() if "forward" in m.__dict__ and fused_lora.fusable(m)]
    assert len(fused) == 2 * 7
    off = load_config(write_config(tmp_path, training={"max_steps": 1, "fused_lora": "off"}))
    assert not kernels.settings(off).fused_lora
    fsdp = load_config(write_config(tmp_path, training={"launcher": "accelerate", "distributed": "fsdp", "num_processes": 2,
                                                        "fused_lora": "on"}))
    with pytest.raises(ConfigError, match="fused_lora: on .* FSDP2"):
        kernels.settings(fsdp)


def _qwen_moe(layers: int, **sizes):
    """A small Qwen2-MoE config: routed experts, a shared expert and its one-output gate (Linear(hidden, 1))."""
    small = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                 num_key_value_heads=2)
    return AutoConfig.for_model("qwen2_moe", num_hidden_layers=layers, **small | sizes)


def test_a_layer_of_one_output_computes_what_peft_computes():
    # Qwen-MoE's shared_expert_gate is Linear(hidden, 1): its backward takes the broadcast product, not a matmul over 1
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_qwen_moe(1))
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["shared_expert_gate", "q_proj"]))
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    fused = copy.deepcopy(peft_model)
    assert fused_lora.use(fused) == 2
    gate = fused.base_model.model.model.layers[0].mlp.shared_expert_gate
    assert gate.get_base_layer().out_features == 1 and "forward" in gate.__dict__
    ids = torch.randint(0, 300, (2, 16))
    (a, ga), (b, gb) = _loss_and_grads(peft_model, ids, 1), _loss_and_grads(fused, ids, 1)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert any("shared_expert_gate.lora_A" in k for k in ga) and ga.keys() == gb.keys()
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-4, atol=1e-6, msg=k)
    x = torch.randn(5, 64, requires_grad=True)
    gate(x).sum().backward()   # the input's gradient through the broadcast product: W + scaling * B A, per token
    w = gate.get_base_layer().weight + gate.scaling["default"] * gate.lora_B["default"].weight @ gate.lora_A["default"].weight
    torch.testing.assert_close(x.grad, w.expand(5, -1), rtol=1e-5, atol=1e-6)


def test_a_family_liger_has_no_kernels_for_gets_llamas_where_its_modules_are_llamas():
    # Qwen2-MoE: its RMSNorm, RoPE and shared-expert MLP are Llama's line for line; GPT-OSS's norm and MLP are not
    torch.manual_seed(0)
    qwen = AutoModelForCausalLM.from_config(_qwen_moe(2))
    norms, mlps, rope = kernels.llama_like(qwen)
    assert len(norms) == 2 * 2 + 1 and {type(m).__name__ for m in norms} == {"Qwen2MoeRMSNorm"}
    assert [type(m).__name__ for m in mlps] == ["Qwen2MoeMLP"] * 2 and rope   # the shared experts
    oss = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt_oss", vocab_size=300, hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    assert kernels.llama_like(oss) == ([], [], False)
    gemma = AutoModelForCausalLM.from_config(AutoConfig.for_model(   # Llama's MLP forward, a GELU activation
        "gemma", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16))
    assert kernels.llama_like(gemma)[1] == []


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
                    reason="Liger's kernels run on a CUDA GPU (bench/peers/loss.sh runs this there)")
def test_llamas_kernels_on_a_family_liger_lacks_compute_what_its_modules_compute():
    torch.manual_seed(0)
    config = _qwen_moe(2, vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                       shared_expert_intermediate_size=1024, num_experts=8, num_attention_heads=8, num_key_value_heads=4)
    exact = AutoModelForCausalLM.from_config(config).to("cuda").train()   # fp32: the reference both bf16 runs round from
    stock = copy.deepcopy(exact).to(torch.bfloat16)
    fused = copy.deepcopy(stock)
    ids = torch.randint(0, config.vocab_size, (2, 256), device="cuda")
    out = {}
    for name, model in (("exact", exact), ("stock", stock), ("liger", fused)):
        if name == "liger":   # after the stock passes: the family's RoPE function is replaced for the whole module
            assert kernels.llama_modules(fused) == {"rms_norm": 5, "swiglu": 2, "rope": 1}
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[name] = (loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    (e, ge), (a, ga), (b, gb) = out["exact"], out["stock"], out["liger"]
    assert abs(b - e) <= 2 * abs(a - e) + 1e-3 and ga.keys() == gb.keys() == ge.keys()
    for n in ge:   # as far from the fp32 gradients as the family's own bf16 modules, within twice their rounding
        assert (gb[n] - ge[n]).norm() <= 2 * (ga[n] - ge[n]).norm() + 1e-3 * ge[n].norm(), n
