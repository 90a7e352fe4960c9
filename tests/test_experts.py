"""LoRA on fused MoE experts, on real tiny random-init models: the expert stacks are found by walking the model,
peft trains them (and not the router) when named in target_parameters, merge adds exactly each expert's
B_e @ A_e, peft's refusals are recorded word for word, and the grouped LoRA prototype computes what peft's
ParamWrapper computes without forming a full-stack weight."""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from stages.model.experts import lora as experts
from stages.model.experts import structure

E, H, I, R = 4, 64, 32, 4     # experts, hidden, expert intermediate, LoRA rank; multiples of 4 for grouped_mm's alignment
COMMON = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=128, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen3_moe": dict(intermediate_size=128, moe_intermediate_size=I, num_experts=E),
    "olmoe": dict(intermediate_size=I, num_experts=E),
    "mixtral": dict(intermediate_size=I, num_local_experts=E),
    "granitemoe": dict(intermediate_size=I, num_local_experts=E),
    "gpt_oss": dict(intermediate_size=I, num_local_experts=E, layer_types=["sliding_attention", "full_attention"]),
    "qwen2_moe": dict(intermediate_size=128, moe_intermediate_size=I, shared_expert_intermediate_size=48, num_experts=E),
}
ROUTER = {"granitemoe": "block_sparse_moe.router.weight", "gpt_oss": "mlp.router.weight"}   # others: mlp.gate.weight
ATTENTION = ["q_proj", "v_proj"]


def tiny(family: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **COMMON, **FAMILIES[family], **extra))


def lora(model, targets: list[str], **kw):
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, LoraConfig(**{"r": R, "lora_alpha": 2 * R, "lora_dropout": 0.0, "target_modules": ATTENTION,
                                                   "target_parameters": targets, **kw}))


def wrappers(peft_model) -> dict[str, torch.nn.Module]:
    """Every ParamWrapper by the full name of the parameter it adapts (as in the unwrapped model)."""
    from peft.tuners.lora.layer import ParamWrapper

    out = {}
    for name, module in peft_model.base_model.model.named_modules():
        if isinstance(module, ParamWrapper):
            out[f"{name.replace('.base_layer', '')}.{module.parameter_name}"] = module
    return out


def expected_delta(w, stack: structure.ExpertStack) -> torch.Tensor:
    """Each expert's scaling * B_e @ A_e, laid out as the stack is stored, read off lora_A / lora_B by hand:
    A's rows e*r .. e*r+r-1 and B's columns e, e+E, e+2E, ... belong to expert e."""
    a, b, s = w.lora_A["default"].weight, w.lora_B["default"].weight, w.scaling["default"]
    deltas = []
    for e in range(stack.experts):
        d = s * b[:, e::stack.experts] @ a[e * R:(e + 1) * R]         # out x in
        deltas.append(d.T if stack.transposed else d)
    return torch.stack(deltas)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_experts_are_found_by_walking_the_model(family):
    model = tiny(family)
    parts = structure.fused_experts(model)
    block = "block_sparse_moe" if family == "granitemoe" else "mlp"
    assert parts.target_parameters == ["experts.down_proj", "experts.gate_up_proj"]
    assert [s.name for s in parts.stacks if s.leaf == "gate_up_proj"] == [f"model.layers.{i}.{block}.experts.gate_up_proj" for i in (0, 1)]
    # in/out as peft reads them: H -> 2I up, I -> H down, whichever way round the stack is stored
    assert {(s.leaf, s.experts, s.in_features, s.out_features) for s in parts.stacks} == {
        ("gate_up_proj", E, H, 2 * I), ("down_proj", E, I, H)}
    assert all(s.transposed == (family == "gpt_oss") for s in parts.stacks)
    assert f"model.layers.1.{ROUTER.get(family, 'mlp.gate.weight')}" in parts.routers
    assert parts.router_linears == []
    assert parts.shared_linears == ([f"model.layers.{i}.mlp.{n}" for i in (0, 1) for n in
                                     ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate")]
                                    if family == "qwen2_moe" else [])
    # biases are 2-D and stay out: a suffix target never matches gate_up_proj_bias
    assert parts.lora_params(R) == 2 * E * R * ((H + 2 * I) + (I + H))
    assert parts.summary(R)[0] == f"experts: gate_up_proj x 2 ({E} experts, rank {R} each) {2 * E * R * (H + 2 * I) / 1e6:.2f} M params"


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_lora_trains_and_merges_exactly(family):
    model = tiny(family)
    parts = structure.fused_experts(model)
    routers = {n: model.get_parameter(n).detach().clone() for n in parts.routers}
    base = {s.name: model.get_parameter(s.name).detach().clone() for s in parts.stacks}
    pm = lora(model, parts.target_parameters)
    found = wrappers(pm)
    assert sorted(found) == sorted(base)
    assert sum(p.numel() for w in found.values() for p in (w.lora_A["default"].weight, w.lora_B["default"].weight)) == parts.lora_params(R)

    torch.manual_seed(1)
    ids = torch.randint(3, COMMON["vocab_size"], (2, 16))
    opt = torch.optim.Adam([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        pm(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    for name, w in found.items():
        b = w.lora_B["default"].weight
        assert all(b[:, e::E].abs().sum() > 0 for e in range(E)), f"{name}: an expert's lora_B is still zero"
    for n, before in routers.items():
        assert not pm.base_model.model.get_parameter(n).requires_grad and torch.equal(pm.base_model.model.get_parameter(n), before), n

    pm.eval()
    with torch.no_grad():
        adapted = pm(input_ids=ids).logits
        deltas = {s.name: expected_delta(found[s.name], s) for s in parts.stacks}
    merged = pm.merge_and_unload()
    for s in parts.stacks:
        p = merged.get_parameter(s.name)
        assert type(p) is torch.nn.Parameter and not hasattr(merged.get_submodule(s.name.rpartition(".")[0]), "parametrizations")
        # fp32 sums of ~0.02-sized weights and deltas: a rounding or two, never an expert's delta in another's slot
        torch.testing.assert_close(p.detach(), base[s.name] + deltas[s.name], rtol=0, atol=1e-6)
        assert deltas[s.name].abs().amax(dim=(1, 2)).min() > 1e-4
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kw, message", [
    (dict(lora_dropout=0.05), "lora.ParamWrapper does not work with lora_dropout != 0."),
    (dict(use_dora=True), "lora.ParamWrapper does not work with use_dora=True."),
    (dict(lora_dropout=0.05, use_dora=True), "lora.ParamWrapper does not work with lora_dropout != 0."),  # dropout is checked first
    (dict(lora_bias=True), "lora.ParamWrapper does not work with lora_bias=True."),
])
def test_peft_refuses_dropout_and_dora_on_expert_parameters(kw, message):
    """Raised by get_peft_model for the whole adapter: dropout is one LoraConfig value, so a run that adapts the
    experts has lora_dropout 0 on its attention adapters too."""
    model = tiny("qwen3_moe")
    with pytest.raises(ValueError) as e:
        lora(model, ["experts.gate_up_proj"], **{"lora_dropout": 0.0, **kw})
    assert type(e.value) is ValueError and str(e.value) == message


def test_peft_rewrites_v4_expert_names_for_some_families():
    """peft 0.21 rewrites target_modules for transformers v5 families whose v4 experts were nn.Linear (the model
    types transformers maps onto mixtral / qwen2_moe conversions, not qwen2_moe itself): gate_proj / up_proj /
    down_proj become target_parameters with rank 2r on the fused gate_up_proj, `gate` becomes the router's
    gate.weight, and the dense nn.Linear MLPs of the same names are no longer adapted."""
    model = tiny("qwen3_moe", mlp_only_layers=[0])                 # layer 0: a dense MLP of nn.Linear
    found = wrappers(lora_model := lora(model, [], target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]))
    assert {n: w.r["default"] for n, w in found.items()} == {"model.layers.1.mlp.experts.gate_up_proj": 2 * R,
                                                             "model.layers.1.mlp.experts.down_proj": R}
    assert not hasattr(lora_model.base_model.model.model.layers[0].mlp.gate_proj, "lora_A")
    router = wrappers(lora(tiny("qwen3_moe"), [], target_modules=["q_proj", "gate"]))
    assert list(router) == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    untouched = lora(tiny("qwen2_moe"), [], target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    assert wrappers(untouched) == {} and hasattr(untouched.base_model.model.model.layers[0].mlp.shared_expert.gate_proj, "lora_A")


def _routed(family: str, r: int = R):
    """One MoE block of a tiny model with non-zero adapters on both stacks, and a routed batch for it."""
    model = tiny(family)
    pm = lora(model, structure.fused_experts(model).target_parameters, init_lora_weights=False, r=r)
    block = pm.base_model.model.model.layers[1].mlp
    torch.manual_seed(2)
    x = torch.randn(24, H, requires_grad=True)
    router = block.router if family == "gpt_oss" else block.gate
    with torch.no_grad():
        out = router(x)
    index, weights = out[2], out[1]      # (logits, weights, indices) from both routers
    return block.experts, x, index, weights


@pytest.mark.parametrize("family, r", [("qwen3_moe", R), ("gpt_oss", R), ("qwen3_moe", 2)])   # rank 2: the per-expert loop
def test_grouped_lora_matches_peft_forward_and_gradients(family, r):
    wrapper, x, index, weights = _routed(family, r)
    module, factors = experts.unwrap(wrapper)
    assert sorted(factors) == ["down_proj", "gate_up_proj"]
    grad = torch.randn(x.shape[0], H)

    def run(forward):
        x.grad = None
        wrapper.zero_grad()
        y = forward()
        (y * grad).sum().backward()
        return y.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in wrapper.named_parameters() if p.requires_grad}

    peft_y, peft_dx, peft_dw = run(lambda: wrapper(x, index, weights))
    ours_y, ours_dx, ours_dw = run(lambda: experts.grouped_lora_forward(module, x, index, weights, experts.unwrap(wrapper)[1]))
    assert len(peft_dw) == 4 and peft_dw.keys() == ours_dw.keys()
    torch.testing.assert_close(ours_y, peft_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_dx, peft_dx, rtol=1e-5, atol=1e-6)
    for n in peft_dw:
        torch.testing.assert_close(ours_dw[n], peft_dw[n], rtol=1e-4, atol=1e-6, msg=n)


def test_peft_keeps_a_full_stack_copy_for_backward_and_grouped_lora_does_not():
    wrapper, x, index, weights = _routed("qwen3_moe")
    module, _ = experts.unwrap(wrapper)
    params = {p.untyped_storage().data_ptr() for p in wrapper.parameters()}
    stacks = {tuple(module.gate_up_proj.shape), tuple(module.down_proj.shape)}

    def fresh_stacks(forward) -> set[tuple[int, ...]]:
        """Shapes of tensors autograd saves that are no parameter's storage and hold a whole stack."""
        seen = set()

        def pack(t):
            if t.untyped_storage().data_ptr() not in params and t.numel() >= min(a * b * c for a, b, c in stacks):
                seen.add(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
        return seen

    # W + scaling * lhs @ rhs for every expert, saved by grouped_mm (as [E, in, out], the transpose it multiplies by)
    assert fresh_stacks(lambda: wrapper(x, index, weights)) == {(E, H, 2 * I), (E, I, H)}
    assert fresh_stacks(lambda: experts.grouped_lora_forward(module, x, index, weights, experts.unwrap(wrapper)[1])) == set()


def _nf4_checkpoint(family: str, tmp_path):
    """A tiny `family` model saved, loaded back QLoRA through the stages' loader, and loaded back 16-bit."""
    from stages.config import ModelSection, QuantizationSection
    from stages.model.load import load_base

    kw = {"attn_implementation": "eager"} if family == "gpt_oss" else {}
    tiny(family).save_pretrained(tmp_path / family)
    section = ModelSection(name_or_path=str(tmp_path / family), torch_dtype="float32", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_base(section, QuantizationSection(load_in_4bit=True)), load_base(section, QuantizationSection())


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral", "granitemoe", "gpt_oss"])
def test_qlora_loads_every_expert_stack_in_nf4_and_computes_it_as_its_dequantized_weights(family, tmp_path):
    from stages.model.experts import nf4 as expert_nf4

    nf4, full = _nf4_checkpoint(family, tmp_path)
    stacks = structure.fused_experts(full).stacks
    packed = {n: getattr(nf4.get_submodule(n), leaf) for n, leaves in expert_nf4.stacks(nf4).items() for leaf in leaves}
    assert sum(len(v) for v in expert_nf4.stacks(nf4).values()) == len(stacks) == 4
    for s in stacks:   # half a byte per weight, the 3-D shape kept for peft and for the estimate
        p = nf4.get_parameter(s.name)
        assert p.dtype == torch.uint8 and p.numel() * 2 == s.experts * s.in_features * s.out_features
        assert p.ds_shape == full.get_parameter(s.name).shape
    assert [(s.name, s.in_features, s.out_features) for s in structure.fused_experts(nf4).stacks] == \
        [(s.name, s.in_features, s.out_features) for s in stacks]
    assert packed

    x = torch.randint(3, 128, (2, 12))
    with torch.no_grad():
        quantized = nf4(input_ids=x).logits
        assert expert_nf4.dequantize_all(nf4) == 4   # transformers' own experts forward on the same weights
        reference = nf4(input_ids=x).logits
        exact = full(input_ids=x).logits
    torch.testing.assert_close(quantized, reference, rtol=1e-4, atol=1e-5)
    assert (quantized - exact).abs().max() > 1e-4   # and they are 4-bit weights, not the 16-bit ones


def test_nf4_experts_train_their_lora_through_the_grouped_path_and_the_disabled_adapter_is_the_base(tmp_path):
    nf4, _ = _nf4_checkpoint("qwen3_moe", tmp_path)
    x = torch.randint(3, 128, (2, 12))
    with torch.no_grad():
        plain = nf4(input_ids=x).logits   # before peft wraps it
    pm = lora(nf4, structure.fused_experts(nf4).target_parameters, init_lora_weights=False)
    assert experts.use_grouped_lora(pm) == 2
    with torch.no_grad(), pm.disable_adapter():
        base = pm(input_ids=x).logits
    with torch.no_grad():
        adapted = pm(input_ids=x).logits
    torch.testing.assert_close(base, plain)
    assert (adapted - plain).abs().max() > 1e-3
    pm(input_ids=x, labels=x).loss.backward()
    grads = {n: p.grad for n, p in pm.named_parameters() if p.requires_grad and ".experts." in n}
    assert len(grads) == 8 and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    with pytest.raises(ValueError, match="NF4 expert stacks"):
        experts.use_grouped_lora(pm, on=False)


def test_nf4_grouped_matmul_input_gradient_is_that_of_the_dequantized_stack():
    import bitsandbytes as bnb

    from stages.model.experts import nf4 as expert_nf4

    torch.manual_seed(3)
    w = torch.randn(E, 2 * I, H) * 0.05
    p = bnb.nn.Params4bit(w, requires_grad=False, blocksize=64, quant_type="nf4")._quantize("cpu")
    dense = expert_nf4.dequantize(p)
    counts = torch.tensor([5, 0, 7, 4])
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), H, requires_grad=True)
    grad = torch.randn(x.shape[0], 2 * I)
    (experts._NF4GroupedMM.apply(x, p, offs, False) * grad).sum().backward()
    ours = x.grad.clone()
    x.grad = None
    (experts._gmm(x, dense.transpose(-2, -1), offs) * grad).sum().backward()
    torch.testing.assert_close(ours, x.grad)


def test_a_checkpointed_nf4_step_dequantizes_each_stack_twice_and_a_plain_forward_keeps_no_copy(monkeypatch):
    """Under non-reentrant checkpointing the recompute's dequantized stack serves the backward after it (two
    dequantizations, not three), and the gradient is the dense stack's; a forward outside checkpointing keeps no copy."""
    import bitsandbytes as bnb
    from torch.utils.checkpoint import checkpoint

    from stages.model.experts import nf4 as expert_nf4

    torch.manual_seed(4)
    p = bnb.nn.Params4bit(torch.randn(E, 2 * I, H) * 0.05, requires_grad=False, blocksize=64,
                          quant_type="nf4")._quantize("cpu")
    dense = expert_nf4.dequantize(p)
    offs = torch.tensor([5, 5, 12, 16], dtype=torch.int32)
    x = torch.randn(16, H, requires_grad=True)
    grad = torch.randn(16, 2 * I)
    calls = []
    real = expert_nf4.dequantize

    def counted(param):
        calls.append(1)
        return real(param)

    monkeypatch.setattr(expert_nf4, "dequantize", counted)
    y = checkpoint(lambda t: experts._NF4GroupedMM.apply(t, p, offs, False) * 1.0, x, use_reentrant=False)
    (y * grad).sum().backward()
    assert len(calls) == 2
    ours = x.grad.clone()
    x.grad = None
    (experts._gmm(x, dense.transpose(-2, -1), offs) * grad).sum().backward()
    torch.testing.assert_close(ours, x.grad)

    calls.clear()   # without checkpointing: the forward saves a one-element placeholder, backward dequantizes again
    x.grad = None
    y = experts._NF4GroupedMM.apply(x, p, offs, False)
    saved = [t for t in y.grad_fn.saved_tensors if t.dim() == 3]
    assert len(saved) == 1 and saved[0].untyped_storage().nbytes() == saved[0].element_size()
    (y * grad).sum().backward()
    assert len(calls) == 2
    torch.testing.assert_close(x.grad, ours)


def test_expert_offsets_are_the_cumulative_counts_of_the_sorted_groups():
    torch.manual_seed(5)
    for experts_n, slots in ((1, 3), (4, 0), (7, 50), (128, 1000)):
        groups = torch.sort(torch.randint(0, experts_n, (slots,)))[0]
        expected = torch.bincount(groups, minlength=experts_n).cumsum(0).to(torch.int32)
        assert torch.equal(experts.offsets(groups, experts_n), expected)


def test_dispatch_and_combine_backward_are_the_gathers_of_plain_indexing():
    torch.manual_seed(0)
    index = torch.randint(0, 5, (7, 3))
    hidden = torch.randn(7, 6, requires_grad=True)
    groups, order = torch.sort(index.reshape(-1))
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    g = torch.randn(21, 6)
    ours = torch.autograd.grad((experts._Dispatch.apply(hidden, order, inverse, 3) * g).sum(), hidden)[0]
    plain = torch.autograd.grad((hidden[order // 3] * g).sum(), hidden)[0]
    torch.testing.assert_close(ours, plain)
    y = torch.randn(21, 6, requires_grad=True)
    gy = torch.randn(7, 3, 6)
    ours = torch.autograd.grad((experts._Combine.apply(y, order, inverse, 3) * gy).sum(), y)[0]
    plain = torch.autograd.grad((y.index_select(0, inverse).view(7, 3, 6) * gy).sum(), y)[0]
    torch.testing.assert_close(ours, plain)
