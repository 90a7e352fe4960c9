"""The packed token budget a config gets by default, and why (issue 22: the fastest budget that fits, chosen)."""

from __future__ import annotations

import pytest

from stages.config import RunConfig
from stages.train import batches, kernels
from stages.train.batches import PACKED_BUDGET_DEFAULT_MAX, TILE_FROM_TOKENS


def config(micro_batch: int, max_length: int, **training) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"name_or_path": "assets/tiny-llama"},
        "data": {"train_file": "assets/data/translate_train.jsonl", "max_length": max_length},
        "training": {"per_device_train_batch_size": micro_batch, "gradient_accumulation_steps": 8, **training},
        "handoff": {"dir": "/tmp/tae-handoff", "model_name": "m"},
    })


@pytest.mark.parametrize(("micro_batch", "max_length", "budget"), [
    (4, 2048, 8192),      # the padded worst case, under the cap: unchanged
    (4, 4096, 16384),     # exactly the cap
    (4, 8192, 16384),     # 32768 would switch the tiled MLP on: two samples' worth instead
    (3, 8192, 16384),     # 24576, over the cap
    (2, 12000, 12000),    # one sample's worth: the widest multiple of max_length up to the cap
    (1, 40000, 40000),    # a sample longer than the cap: the budget must hold it
])
def test_default_budget_stays_under_the_cap(micro_batch, max_length, budget):
    cfg = config(micro_batch, max_length)
    assert batches.token_budget(cfg) == budget
    assert batches.token_budget(cfg) >= max_length
    assert batches.token_budget(cfg) <= max(PACKED_BUDGET_DEFAULT_MAX, max_length)
    assert batches.token_budget(cfg) % max_length == 0


def test_an_explicit_budget_or_tiled_mlp_on_is_kept():
    assert batches.token_budget(config(4, 8192, max_tokens_per_batch=32768)) == 32768
    assert batches.token_budget_reason(config(4, 8192, max_tokens_per_batch=32768)) == "training.max_tokens_per_batch"
    assert batches.token_budget(config(4, 8192, tiled_mlp="on")) == 32768


def test_the_default_budget_keeps_the_tiled_mlp_off_on_a_gpu():
    """R7's settings (micro-batch 4 x 8192): the padded worst case would tile the MLP, measured 1.4x slower."""
    assert TILE_FROM_TOKENS > PACKED_BUDGET_DEFAULT_MAX
    default = kernels.resolve_auto(config(4, 8192), on_gpu=True, longest=8192)
    wide = kernels.resolve_auto(config(4, 8192, max_tokens_per_batch=32768), on_gpu=True, longest=8192)
    assert default["packing"] and not default["tiled_mlp"]
    assert wide["tiled_mlp"]


def test_the_plan_says_why_this_budget():
    cfg = config(4, 8192)
    lengths = [300, 8000, 500, 7000, 120, 2500, 6000, 900] * 8
    rows = [{"input_ids": [5] * n, "labels": [5] * n} for n in lengths]
    _, plan = batches.dataset(cfg.model_copy(update={"training": cfg.training.model_copy(update={"max_steps": 4})}), rows, packed=True)
    text = plan.describe()
    assert "at most 16384 tokens" in text and "tiled MLP" in text, text
    assert plan.samples_per_step == 32
    padded = config(4, 2048)
    assert "per_device_train_batch_size x data.max_length (4 x 2048)" in batches.token_budget_reason(padded)
