"""The project's own chunked cross-entropy (stages/train/chunked_loss.py): the stock loss's value and gradients without
the logits, on the family's own forward, and chosen where Liger's fused loss is not there (every CPU run)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from stages.config import ConfigError, load_config
from stages.train import chunked_loss, kernels
from tests.conftest import write_config

SMALL = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# a linear logit scale (Granite), a mixture of experts whose forward adds its router's auxiliary loss (Qwen3-MoE)
CASES = {"llama": {}, "granite": {"logits_scaling": 4.0},
         "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "output_router_logits": True, "router_aux_loss_coef": 0.05}}


def _pair(family: str):
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **SMALL, **CASES[family]))
    chunked = copy.deepcopy(stock)
    chunked_loss.use(chunked)
    return stock, chunked


@pytest.mark.parametrize("family", list(CASES))
def test_the_chunked_loss_and_its_gradients_are_the_stock_ones(family, monkeypatch):
    stock, chunked = _pair(family)
    assert chunked_loss.unsupported(type(stock)) is None and chunked_loss.installed(chunked)
    monkeypatch.setattr(chunked_loss, "chunk_rows", lambda *_: 7)   # chunks that do not divide the rows
    ids = torch.randint(0, SMALL["vocab_size"], (2, 40))
    with torch.no_grad():   # without labels the forward returns the logits, as before
        torch.testing.assert_close(chunked(input_ids=ids).logits, stock(input_ids=ids).logits)
    labels = ids.clone()
    labels[0, :15] = -100   # a masked prompt: those rows never meet the output layer
    for extra in ({}, {"num_items_in_batch": torch.tensor(50)}):   # the mean, and the Trainer's sum over a step's tokens
        losses = []
        for model in (stock, chunked):
            model.zero_grad()
            loss = model(input_ids=ids, labels=labels, **extra).loss
            loss.backward()
            losses.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        (a, ga), (b, gb) = losses
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        assert ga.keys() == gb.keys() and "lm_head.weight" in gb   # the output layer's gradient too, where it trains
        for name in ga:
            torch.testing.assert_close(gb[name], ga[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_micro_batch_without_loss_tokens_gives_what_the_stock_loss_gives():
    stock, chunked = _pair("llama")
    ids = torch.randint(0, SMALL["vocab_size"], (1, 12))
    none = torch.full_like(ids, -100)
    with torch.no_grad():
        assert torch.isnan(chunked(input_ids=ids, labels=none).loss) and torch.isnan(stock(input_ids=ids, labels=none).loss)
        assert chunked(input_ids=ids, labels=none, num_items_in_batch=torch.tensor(5)).loss == 0


def test_a_forward_that_soft_caps_its_logits_keeps_the_stock_loss(tmp_path):
    from transformers import BambaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, OlmoeForCausalLM

    assert "final_logit_softcapping" in chunked_loss.unsupported(Gemma2ForCausalLM)
    assert chunked_loss.unsupported(OlmoeForCausalLM) is None
    # Gemma-3's soft-cap is off by default: its block is not run, and only a config that sets it is refused
    gemma3 = AutoConfig.for_model("gemma3_text")
    assert chunked_loss.unsupported(Gemma3ForCausalLM, gemma3) is None
    gemma3.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in chunked_loss.unsupported(Gemma3ForCausalLM, gemma3)
    # Bamba adds a z-loss of the logits after the loss: with the hidden states in their place it would be another loss
    assert "after the loss" in chunked_loss.unsupported(BambaForCausalLM)
    torch.manual_seed(0)
    gemma = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma2", **SMALL, head_dim=8))
    model_dir = tmp_path / "gemma2"
    gemma.save_pretrained(model_dir)
    cfg = load_config(write_config(tmp_path, model={"name_or_path": str(model_dir)}))
    assert kernels.cross_entropy(cfg) == "plain"   # auto: no chunked loss covers it on this CPU
    with pytest.raises(ConfigError, match="chunked.*final_logit_softcapping.*set training.cross_entropy: auto"):
        kernels.cross_entropy(load_config(write_config(tmp_path, model={"name_or_path": str(model_dir)},
                                                       training={"cross_entropy": "chunked"})))


def test_the_default_run_takes_the_chunked_loss_and_plain_or_fsdp_keep_the_stock_one(tmp_path):
    assert kernels.cross_entropy(load_config(write_config(tmp_path))) == "chunked-torch"
    assert kernels.cross_entropy(load_config(write_config(tmp_path, training={"cross_entropy": "plain"}))) == "plain"
    fsdp = load_config(write_config(tmp_path, training={"distributed": "fsdp", "launcher": "accelerate", "num_processes": 2}))
    assert kernels.own_loss_refusal(fsdp).startswith("distributed: fsdp") and kernels.cross_entropy(fsdp) == "plain"
    on_head = load_config(write_config(tmp_path, lora={"target_modules": ["q_proj", "lm_head"]}))
    assert "output layer" in kernels.own_loss_refusal(on_head)


def test_the_train_stage_model_computes_the_chunked_loss(tmp_path):
    from stages.train.model import build_model

    model = build_model(load_config(write_config(tmp_path)))
    assert chunked_loss.installed(model)


def test_a_plan_with_the_cards_room_takes_chunks_the_output_layer_is_not_read_for_a_few_rows(tmp_path, monkeypatch):
    # Qwen1.5-MoE's head (151,936 x 2,048) at 8,192 tokens: half Liger's chunk is 64 rows, 128 reads of the layer a step
    assert chunked_loss.chunk_rows(8192, 151_936, 2048) == 64
    wide = chunked_loss.chunk_rows(8192, 151_936, 2048, chunked_loss.WIDE_CHUNK_LOGITS)
    assert wide >= 1024 and 6 * wide * 151_936 <= 1.6 * 2**30   # the logits a chunk holds at its peak, 6 bytes each
    assert chunked_loss.chunk_rows(8192, 262_144, 2048, chunked_loss.WIDE_CHUNK_LOGITS) == 1024
    cfg = load_config(write_config(tmp_path, training={"fit": "speed"}))
    assert kernels.resolve_auto(cfg, on_gpu=True)["loss_chunk_logits"] == chunked_loss.WIDE_CHUNK_LOGITS
    memory = load_config(write_config(tmp_path, training={"fit": "memory"}))
    assert kernels.resolve_auto(memory, on_gpu=True)["loss_chunk_logits"] == chunked_loss.MIN_CHUNK_LOGITS
    assert kernels.resolve_auto(cfg, on_gpu=False)["loss_chunk_logits"] == chunked_loss.MIN_CHUNK_LOGITS
    # the chunk the model computes with is the one the settings name: the same loss whatever the chunk
    stock, chunked = _pair("llama")
    seen = []
    real = chunked_loss.chunk_rows
    monkeypatch.setattr(chunked_loss, "chunk_rows", lambda *a: seen.append(a[-1]) or real(*a))
    ids = torch.randint(0, SMALL["vocab_size"], (2, 40))
    for min_logits in (chunked_loss.MIN_CHUNK_LOGITS, chunked_loss.WIDE_CHUNK_LOGITS):
        chunked_loss.use(chunked, min_logits)
        with torch.no_grad():
            torch.testing.assert_close(chunked(input_ids=ids, labels=ids).loss, stock(input_ids=ids, labels=ids).loss)
    assert seen == [chunked_loss.MIN_CHUNK_LOGITS, chunked_loss.WIDE_CHUNK_LOGITS]


def test_under_autocast_the_chunks_compute_in_its_dtype_and_nothing_else_is_cast(monkeypatch):
    # a Trainer's bf16 autocast over an fp32 residual stream: the output layer is cast to bf16 once, not for each
    # chunk's two matmuls, and the chunks compute what the same loss computes on bf16 inputs outside autocast (on CUDA
    # the softmaxes then read the 16-bit logits themselves: log_softmax's half-to-float kernel), near the fp32 loss
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                self.shapes.append((tuple(args[0].shape), args[0].dtype, (kwargs or {}).get("dtype")))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    monkeypatch.setattr(chunked_loss, "chunk_rows", lambda *_: 7)   # six chunks
    hidden = torch.randn(40, 32, requires_grad=True)
    weight = torch.randn(300, 32) * 0.2
    targets = torch.randint(0, 300, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16), Casts() as casts:
        auto = chunked_loss._LinearCrossEntropy.apply(hidden, weight, None, targets, True, chunked_loss.MIN_CHUNK_LOGITS)
    assert casts.shapes.count(((300, 32), torch.float32, torch.bfloat16)) == 1, casts.shapes
    auto.backward()
    h16 = hidden.detach().bfloat16().requires_grad_()
    plain = chunked_loss._LinearCrossEntropy.apply(h16, weight.bfloat16(), None, targets, True, chunked_loss.MIN_CHUNK_LOGITS)
    plain.backward()
    assert auto.item() == plain.item() and hidden.grad.dtype == torch.float32
    torch.testing.assert_close(hidden.grad, h16.grad.float())
    exact = torch.nn.functional.cross_entropy(hidden.detach() @ weight.T, targets, reduction="sum")
    assert abs(auto.item() - exact.item()) < 0.01 * exact.item()
