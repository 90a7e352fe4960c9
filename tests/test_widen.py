"""The default packed budget widened on a card with room (stages/train/widen.py): the same samples per step in fewer,
wider micro-batches, only as wide as the estimate fits, and the OOM recovery still narrows it."""

from __future__ import annotations

from stages.config import RunConfig
from stages.train import batches, packing, widen
from stages.train.memory_model import Shapes, estimate
from stages.train.oom import halve_micro_batch


def config(accumulation: int = 8, **training) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"name_or_path": "assets/tiny-llama"},
        "data": {"train_file": "assets/data/translate_train.jsonl", "max_length": 2048},
        "training": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": accumulation, **training},
        "handoff": {"model_name": "m"},
    })


def shapes(cfg: RunConfig) -> Shapes:
    return Shapes.of_run(cfg)


def need(cfg: RunConfig, tokens: int) -> float:
    return estimate(batches.with_card_budget(cfg, tokens, ""), shapes(cfg), 2048, on_gpu=True).total_gib


def test_a_card_with_room_gets_the_widest_budget_a_step_fills():
    cfg = config()
    assert batches.token_budget(cfg) == 4096  # 2 x 2048: the config's own
    wide = widen.on_card(cfg, shapes(cfg), 2048, usable_gib=1000.0, on_gpu=True)
    assert batches.token_budget(wide) == 16384  # 16 samples x 2048 would be 32768: the cap
    assert "widened on this card from 4096" in batches.token_budget_reason(wide)
    assert wide.fingerprint() == cfg.fingerprint() and wide.training.max_tokens_per_batch is None  # the YAML's fields unchanged
    # a step of 3 samples fills 6144 tokens at most: no wider
    three = config(accumulation=1, per_device_train_batch_size=3)
    assert batches.token_budget(widen.on_card(three, shapes(three), 2048, 1000.0, True)) == 6144


def test_only_as_wide_as_the_estimate_fits():
    cfg = config()
    at = {n: need(cfg, n) for n in (4096, 8192, 16384)}
    assert at[4096] < at[8192] < at[16384]
    between = (at[8192] + at[16384]) / 2
    mid = widen.on_card(cfg, shapes(cfg), 2048, between, True)
    assert batches.token_budget(mid) == 8192
    assert f"16384 tokens would need {at[16384]:.2f}" in batches.token_budget_reason(mid)
    tight = widen.on_card(cfg, shapes(cfg), 2048, (at[4096] + at[8192]) / 2, True)
    assert batches.token_budget(tight) == 4096
    assert "not widened on this card: 8192 tokens would need" in batches.token_budget_reason(tight)


def test_nothing_to_widen():
    cfg = config()
    s = shapes(cfg)
    kept = [
        (config(max_tokens_per_batch=4096), True),     # the user's own budget
        (config(packed_step="tokens"), True),          # the budget is what a step trains
        (config(packing="off"), True),                 # padded
        (config(accumulation=1), True),                # a step's two samples already fill one micro-batch
        (cfg, False),                                  # no CUDA: no launches to save
    ]
    for c, on_gpu in kept:
        assert widen.budget_on_card(c, s, 2048, 1000.0, on_gpu) is c
    assert widen.in_training(cfg, 2048) is cfg  # this machine has no CUDA


def test_wider_micro_batches_train_the_same_samples_per_step_and_the_recovery_narrows_them():
    cfg = config(max_steps=12)
    wide = widen.on_card(cfg, shapes(cfg), 2048, 1000.0, True)
    lengths = [2048, 300, 1500, 90, 700, 2048, 1200, 64] * 12
    base_plan = packing.plan_steps(lengths, batches.token_budget(cfg), batches.samples_per_step(cfg), 0, 12)
    wide_plan = packing.plan_steps(lengths, batches.token_budget(wide), batches.samples_per_step(wide), 0, 12)
    assert [sorted(i for b in s for i in b) for s in base_plan] == [sorted(i for b in s for i in b) for s in wide_plan]
    assert sum(map(len, wide_plan)) < sum(map(len, base_plan))
    assert all(sum(lengths[i] for i in b) <= 16384 for s in wide_plan for b in s)
    # out of memory at the widened budget: half of it, then half again, never below the longest sample
    smaller = halve_micro_batch(wide, True, 2048)
    assert batches.token_budget(smaller) == 8192 and batches.token_budget_reason(smaller) == "training.max_tokens_per_batch"
    assert batches.token_budget(halve_micro_batch(smaller, True, 2048)) == 4096


def test_training_goes_no_wider_than_its_preflight_measured():
    """A flow retried on a bigger card after its preflight was kept: the budget the preflight planned and probed."""
    cfg = config()
    wide = widen.on_card(cfg, shapes(cfg), 2048, 1000.0, True)
    narrow = widen.no_wider_than_measured(cfg, wide, {"steps": {"packed": True, "tokens_per_micro_batch": 8192}})
    assert batches.token_budget(narrow) == 8192 and "this run's preflight measured" in batches.token_budget_reason(narrow)
    for record in (None, {}, {"steps": {"packed": True, "tokens_per_micro_batch": 16384}}, {"steps": {"packed": False}}):
        assert widen.no_wider_than_measured(cfg, wide, record) is wide
    # several processes widen only to a budget the config states: each card would otherwise plan its own micro-batches
    ddp = config(launcher="accelerate", num_processes=2)
    assert widen.budget_on_card(ddp, shapes(ddp), 2048, 1000.0, True) is ddp
    stated = ddp.model_copy(update={"preflight": ddp.preflight.model_copy(update={"gpu_memory_gib": 80.0})})
    assert batches.token_budget(widen.on_card(stated, shapes(stated), 2048, 1000.0, True)) == 16384
    assert widen.on_card(wide, shapes(cfg), 2048, 1000.0, True) is wide  # chosen once


def test_fit_auto_is_the_fastest_plan_the_card_holds():
    from stages.train.kernels import resolve_auto

    cfg = config()
    assert cfg.training.fit == "auto" and cfg.training.planned_fit == "memory"   # undecided: the smallest footprint
    s = shapes(cfg)
    speed_need = estimate(widen._with_fit(cfg, "speed", ""), s, 2048, on_gpu=True).total_gib
    memory_need = estimate(cfg, s, 2048, on_gpu=True).total_gib
    assert memory_need < speed_need   # offloads and 8-bit states: the memory plan needs less
    roomy = widen.on_card(cfg, s, 2048, usable_gib=speed_need + 0.01, on_gpu=True)
    assert roomy.training.planned_fit == "speed" and "fit: auto is speed on this card" in roomy.training._fit_reason
    settings = resolve_auto(roomy, on_gpu=True)
    assert not settings["offload_activations"] and not settings["offload_embeddings"] and settings["optim"] == "adamw_torch_fused"
    assert roomy.fingerprint() == cfg.fingerprint()   # decided for the card, the YAML's fields unchanged
    tight = widen.on_card(cfg, s, 2048, usable_gib=(speed_need + memory_need) / 2, on_gpu=True)
    assert tight.training.planned_fit == "memory" and f"would need {speed_need:.2f} GiB" in tight.training._fit_reason
    assert resolve_auto(tight, on_gpu=True)["offload_activations"]
    assert widen.on_card(cfg, s, 2048, 1000.0, on_gpu=False).training.planned_fit == "memory"
    fsdp = config(launcher="accelerate", distributed="fsdp", num_processes=2)
    assert widen.on_card(fsdp, s, 2048, 1000.0, on_gpu=True).training.planned_fit == "memory"
    for explicit in ("memory", "speed"):   # what the config says stays
        c = config(fit=explicit)
        assert widen.on_card(c, s, 2048, 0.001 if explicit == "speed" else 1000.0, True).training.planned_fit == explicit
    # a speed plan keeps the activations: the tiled MLP (one more MLP forward per layer) only where memory comes first
    long = config(packed_step="tokens", max_tokens_per_batch=32768)
    assert resolve_auto(long, on_gpu=True)["tiled_mlp"]
    assert not resolve_auto(widen.on_card(long, shapes(long), 2048, 1000.0, True), on_gpu=True)["tiled_mlp"]
