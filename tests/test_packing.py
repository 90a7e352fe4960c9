"""Padding-free packing on the real tiny model: the plan, exactness against unpacked rows,
isolation between samples of one packed row, the same optimizer step, and the preflight's
packed worst step."""

from __future__ import annotations

import math
import random

import pytest
import torch

from stages import preflight
from stages.config import ConfigError, load_config
from stages.train import batches, hf_trainer, kernels, packing
from stages.train import model as lora_model
from tests.conftest import write_config


def lognormal_lengths(n: int, median: float = 512, sigma: float = 0.89, cap: int = 8192, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [max(8, min(cap, round(median * math.exp(rng.gauss(0, sigma))))) for _ in range(n)]


def test_the_plan_packs_every_sample_once_per_epoch_within_the_budget_and_is_seeded():
    lengths = lognormal_lengths(4000)
    budget = 16384
    e0, e1 = packing.plan_epoch(lengths, budget, 0, 0), packing.plan_epoch(lengths, budget, 0, 1)
    for epoch in (e0, e1):
        assert sorted(i for b in epoch for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= budget for b in epoch)
    assert e0 == packing.plan_epoch(lengths, budget, 0, 0)  # the same seed and epoch: the same micro-batches
    assert e0 != e1 and e0 != packing.plan_epoch(lengths, budget, 1, 0)
    # the longest samples are not all at the start: windows are shuffled after packing
    firsts = [max(lengths[i] for i in b) for b in e0[:10]]
    assert min(firsts) < max(lengths)
    # long-tailed data (median 512, sigma 0.89, as the issue measured): packing fills the budget, padding does not
    assert packing.efficiency(lengths, e0, budget) > 0.97
    assert packing.padded_efficiency(lengths, 4) < 0.6
    epochs = packing.plan(lengths, budget, 0, micro_batches=len(e0) + 1)
    assert len(epochs) == 2 and epochs[0] == e0 and epochs[1] == e1


def test_a_sample_longer_than_the_budget_is_refused_by_name(tmp_path):
    with pytest.raises(packing.PackingError, match="longer than the token budget 10"):
        packing.plan_epoch([5, 11], 10, 0, 0)
    cfg = load_config(write_config(tmp_path, training={"packing": "on", "max_tokens_per_batch": 16}))
    with pytest.raises(ConfigError, match=r"max_tokens_per_batch is 16, shorter than the longest sample \(\d+ tokens.*set it to at least"):
        preflight.run(cfg, tmp_path / "preflight")


def _rows(cfg, n: int) -> list[dict]:
    from stages import data
    from stages.model.load import load_tokenizer

    tok = data.tokenize(data.read_jsonl(cfg.data.train_file)[:n], load_tokenizer(cfg.model), cfg.data.max_length, "error")
    return batches.rows(tok)


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy of the next token (0 where the label is -100)."""
    return torch.nn.functional.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="none")


@pytest.mark.parametrize("attention", ["mask", "varlen"])
def test_packed_rows_give_each_sample_the_loss_it_has_alone_and_never_see_each_other(tmp_path, attention):
    cfg = load_config(write_config(tmp_path, training={"packing": "on", "packed_attention": attention}))
    model = lora_model.build_model(cfg).eval()
    rows = _rows(cfg, 6)
    packed = packing.collate(rows, varlen=attention == "varlen")
    with torch.no_grad():
        flat = model(**{k: v for k, v in packed.items() if k != "labels"}).logits[0]
        start = 0
        for r in rows:
            n = len(r["input_ids"])
            alone = model(input_ids=torch.tensor([r["input_ids"]])).logits[0]
            torch.testing.assert_close(flat[start:start + n], alone, atol=2e-5, rtol=1e-4)
            labels = torch.tensor(r["labels"])
            torch.testing.assert_close(_token_losses(flat[start:start + n], labels), _token_losses(alone, labels), atol=2e-5, rtol=1e-4)
            start += n
        # change every token of sample 2: no logit of any other sample moves
        changed = [dict(r) for r in rows]
        changed[2] = {**rows[2], "input_ids": [(t * 7 + 3) % 400 + 5 for t in rows[2]["input_ids"]]}
        again = model(**{k: v for k, v in packing.collate(changed, varlen=attention == "varlen").items() if k != "labels"}).logits[0]
    bounds = [0]
    for r in rows:
        bounds.append(bounds[-1] + len(r["input_ids"]))
    for k in range(len(rows)):
        a, b = bounds[k], bounds[k + 1]
        if k == 2:
            assert not torch.allclose(again[a:b], flat[a:b])
        else:
            assert torch.equal(again[a:b], flat[a:b]) or torch.allclose(again[a:b], flat[a:b], atol=1e-6, rtol=0)
    # packed labels: the first token of every sample is never a target (of the previous sample's last token)
    assert all(packed["labels"][0, s].item() == -100 for s in bounds[:-1])


def test_packed_samples_of_one_length_attend_as_a_batch_of_causal_rows_with_the_same_losses_and_gradients(tmp_path):
    """Full rows (every sample data.max_length long) and one long sample take scaled_dot_product_attention over a batch
    of equal rows (cuDNN's kernel on Hopper) instead of the varlen kernel: the same logits, loss and LoRA gradients
    as each sample alone, and the path is taken only where the host knows every sample has the longest length."""
    from stages.train import attention

    cfg = load_config(write_config(tmp_path, training={"packing": "on", "packed_attention": "varlen"}))
    model = lora_model.build_model(cfg)
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(5, 400, (48,), generator=gen).tolist()), "labels": ids} for _ in range(3)]
    packed = packing.collate(rows, varlen=True)
    q = torch.zeros(1, 4, 144, 8)
    assert attention._equal_rows(q, q, packed["cu_seq_lens_q"], packed["cu_seq_lens_k"], 48, 48) == 3
    assert attention._equal_rows(q, q, packed["cu_seq_lens_q"], packed["cu_seq_lens_k"], 50, 50) is None   # not all longest
    lora = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads(batches):
        model.zero_grad()
        total = sum(model(**b).loss for b in batches)
        total.backward()
        return total.detach(), [p.grad.clone() for p in lora]

    together, g_together = loss_and_grads([packed])
    alone, g_alone = loss_and_grads([packing.collate([r], varlen=True) for r in rows])
    torch.testing.assert_close(together * 3, alone, atol=1e-4, rtol=1e-4)   # the packed loss is the mean over 3 samples
    for a, b in zip(g_together, g_alone, strict=True):
        torch.testing.assert_close(a * 3, b, atol=1e-5, rtol=1e-3)


def test_one_optimizer_step_packed_equals_the_same_step_padded(tmp_path):
    """The loss of a step is normalised per loss-carrying token over the whole step, packed or padded:
    the same samples in the same step give the same update (plain SGD, where a scale error would show)."""
    rows = None
    adapters = {}
    for mode in ("padded", "packed", "positions-only"):
        (tmp_path / mode).mkdir()
        cfg = load_config(write_config(tmp_path / mode, training={
            "packing": "off" if mode == "padded" else "on", "optim": "sgd", "learning_rate": 0.5, "warmup_steps": 0,
            "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 1, "max_grad_norm": 0.0,
            "train_sampling_strategy": "sequential"}))
        rows = rows or _rows(cfg, 4)
        model = lora_model.build_model(cfg)
        # micro-batches of unequal loss-token counts, so a per-micro-batch mean would differ from the step's mean
        if mode == "padded":
            train_data, collator = rows, batches.Collator(0)
        else:
            # the collator the model's packed attention reads (stages/train/stage.py pairs them the same way); positions-only:
            # no cu_seq_lens, as transformers' DataCollatorWithFlattening gives, so varlen reads the restarting positions
            collator = batches.PackedCollator(varlen=mode == "packed" and kernels.settings(cfg).packed_attention == "varlen")
            train_data = packing.PackedRows(rows, [[0, 1], [2, 3]])
        trainer = hf_trainer.make_trainer(cfg, model, train_data, collator, tmp_path / mode / "out", save_strategy="no", disable_tqdm=True)
        trainer.train()
        adapters[mode] = ({n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n},
                          trainer.state.log_history[0]["loss"])
        hf_trainer.release(trainer)
    pad, pad_loss = adapters["padded"]
    for mode in ("packed", "positions-only"):
        pack, pack_loss = adapters[mode]
        assert pad_loss == pytest.approx(pack_loss, rel=1e-5), mode
        for name, w in pad.items():
            torch.testing.assert_close(pack[name], w, atol=1e-6, rtol=1e-4)
    assert all(w.abs().sum() > 0 for n, w in pad.items() if "lora_B" in n)  # B starts at zero: the step moved it


def test_tiled_mlp_auto_follows_the_widest_micro_batch_the_data_can_make(tmp_path):
    """Issue 13: micro-batch 4 x max_length 8192 switched the tiled MLP on although the longest sample
    was ~4k tokens (no padded micro-batch over 16,468 tokens), costing 24% tokens/s."""
    cfg = load_config(write_config(tmp_path, data={"max_length": 8192},
                                   training={"per_device_train_batch_size": 4, "packing": "off", "max_tokens_per_batch": None}))
    on = lambda c, longest: kernels.resolve_auto(c, on_gpu=True, longest=longest)["tiled_mlp"]  # noqa: E731
    assert not on(cfg, 4117) and on(cfg, 8192)
    packed = cfg.model_copy(update={"training": cfg.training.model_copy(update={"packing": "on"})})
    # the default packed budget stays under the switch (16,384 here): no data turns the tiled MLP on
    assert batches.token_budget(packed) == 16384 and not on(packed, 100) and not on(packed, 8192)
    wide = packed.model_copy(update={"training": packed.training.model_copy(update={"max_tokens_per_batch": 32768})})
    # packed by samples: a micro-batch holds at most a step's 4 samples, so short data never reaches 32,768 tokens
    assert not on(wide, 100) and on(wide, 8192)
    by_tokens = wide.model_copy(update={"training": wide.training.model_copy(update={"packed_step": "tokens"})})
    assert on(by_tokens, 100)  # packed by tokens: every micro-batch fills the 32,768-token budget
    small = wide.model_copy(update={"training": wide.training.model_copy(update={"max_tokens_per_batch": 16384})})
    assert not on(small, 4117)


def test_preflight_sizes_a_packed_run_by_the_heaviest_micro_batch_its_plan_holds(tmp_path):
    """The plan is fixed by the data, the seed, the budget and max_steps: the preflight estimates (and probes) the
    micro-batch the run will actually train, not a full budget of the longest samples it may never meet."""
    import json

    from stages import data
    from stages.model.directory import resolve_model_dir
    from stages.model.load import load_tokenizer
    from stages.train.memory_model import Shapes, estimate

    # no eval data: the eval's own micro-batches are the test below
    cfg = load_config(write_config(tmp_path, training={"packing": "on", "max_tokens_per_batch": 512, "max_steps": 6},
                                   data={"eval_file": None}, smoke={"check": "stops"}))
    r = preflight.run(cfg, tmp_path / "preflight")
    lengths = data.training_set(cfg, load_tokenizer(cfg.model)).lengths
    steps = packing.plan_steps(lengths, 512, batches.samples_per_step(cfg), cfg.training.seed, 6)
    heaviest = max((b for s in steps for b in s), key=lambda b: sum(lengths[i] for i in b))
    assert r.lengths.packed and r.lengths.worst_batch_tokens == sum(lengths[i] for i in heaviest) <= 512
    assert sorted(r.lengths.planned) == sorted(lengths[i] for i in heaviest)
    assert f"Worst micro-batch: packed, {r.lengths.worst_batch_tokens} tokens ({len(heaviest)} samples)" in r.report_md.read_text()
    # a longer run meets heavier micro-batches, never one over the budget
    longer = preflight.run(cfg.model_copy(update={"training": cfg.training.model_copy(update={"max_steps": 60})}), tmp_path / "p2")
    assert r.lengths.worst_batch_tokens <= longer.lengths.worst_batch_tokens <= 512
    shapes = Shapes.from_config(json.loads((resolve_model_dir(cfg.model.name_or_path) / "config.json").read_text()))
    at = estimate(cfg, shapes, r.lengths.max, on_gpu=False, packed_tokens=r.lengths.worst_batch_tokens)
    assert r.estimate.total_gib == at.total_gib
    assert estimate(cfg, shapes, r.lengths.max, on_gpu=False).total_gib >= at.total_gib  # None: the full budget
    # the worst packed rows the data could make: the longest samples first, topped up to exactly the budget
    assert packing.worst_rows([30, 20, 20, 5], 64) == [30, 20, 5, 9]
    assert sum(packing.worst_rows(r.lengths.longest, 512)) == 512


def test_packing_is_on_by_default_where_varlen_attention_runs():
    """auto packs on CPU and on a GPU with torch's varlen kernel (measured faster on both), never on a GPU without it,
    where the only packed attention left would be a tokens x tokens mask."""
    from tests.conftest import DEFAULT

    c = load_config(DEFAULT, ["training.max_tokens_per_batch=null", "training.per_device_train_batch_size=4"])
    gpu = kernels.resolve_auto(c, on_gpu=True)
    assert gpu["packing"] and gpu["packed_attention"] == "varlen" and gpu["widest_micro_batch"] == 4 * c.data.max_length
    assert not kernels.resolve_auto(c, on_gpu=True, varlen=False)["packing"]
    assert kernels.resolve_auto(c, on_gpu=False, varlen=False)["packing"]  # CPU: the per-sample loop needs no kernel
    off = load_config(DEFAULT, ["training.packing=off"])
    assert not kernels.resolve_auto(off, on_gpu=True)["packing"]


def test_a_packed_step_trains_the_samples_a_padded_step_does():
    """packed_step: samples (the default): every step holds micro-batch x accumulation samples per process, whatever the
    budget; halving the budget (the OOM recovery) keeps each step's samples and only splits them into more micro-batches."""
    rng = random.Random(1)
    lengths = [min(700, max(8, int(rng.lognormvariate(4.5, 0.9)))) for _ in range(997)]
    steps = packing.plan_steps(lengths, 2048, 12, seed=3, steps=200, world=2)
    assert len(steps) == 400 and all(sum(map(len, s)) == 12 for s in steps[:82])  # 41 full steps an epoch of 2 processes
    assert all(sum(lengths[i] for i in b) <= 2048 for s in steps for b in s)
    assert all(len(steps[2 * k]) == len(steps[2 * k + 1]) for k in range(200))  # as many micro-batches on each process
    halved = packing.plan_steps(lengths, 1024, 12, seed=3, steps=200, world=2)
    assert [sorted(i for b in s for i in b) for s in halved] == [sorted(i for b in s for i in b) for s in steps]
    assert sum(map(len, halved)) > sum(map(len, steps))


@pytest.mark.slow
def test_packed_and_padded_reach_the_same_loss_after_the_same_samples(tmp_path):
    """The default packing keeps what a step means: after the same number of samples, at the same learning rate, the
    loss is the padded run's within noise (issue 22: by tokens it was 11.4 against 1.7 after 400 samples)."""
    import json

    from stages import train

    curves = {}
    for packing_mode in ("off", "on"):
        out = tmp_path / packing_mode
        out.mkdir()
        cfg = load_config(write_config(out, training={"packing": packing_mode, "per_device_train_batch_size": 8, "max_steps": 40,
                                                      "max_tokens_per_batch": None, "save_steps": 40, "logging_steps": 1,
                                                      "warmup_steps": 5}))
        r = train.run(cfg, out / "train")
        assert r.batches["samples_per_step"] == 8 and r.steps == 40
        curves[packing_mode] = [x["loss"] for x in map(json.loads, (out / "train" / "loss.jsonl").read_text().splitlines()) if "loss" in x]
    last = {k: sum(v[-10:]) / 10 for k, v in curves.items()}
    assert curves["off"][0] > 2 * last["off"], curves["off"]  # it learned something
    assert abs(last["on"] - last["off"]) < 0.1 * last["off"], last


def test_preflight_sizes_a_packed_run_by_an_eval_micro_batch_fuller_than_any_it_trains(tmp_path):
    """Eval packs the held-out rows end to end to the training budget; a short run's plan can hold no micro-batch as
    full (bench/gpu_figure's MoE rows: OLMoE and Granite-MoE packed ran out in the eval at step 10, under the figure of a
    probe sized by the training plan alone). The probe's rows are then the eval micro-batch's, and the report says so."""
    from stages.model.load import load_tokenizer
    from stages.train import eval_loss

    cfg = load_config(write_config(tmp_path, training={"packing": "on", "max_tokens_per_batch": 512, "max_steps": 1,
                                                        "eval_steps": 1, "save_steps": 1}))
    r = preflight.run(cfg, tmp_path / "preflight")
    tokenizer = load_tokenizer(cfg.model)
    trained = preflight.planned_worst(cfg, tokenizer)
    evaluated = preflight.eval_worst(cfg, eval_loss.rows(cfg, tokenizer))
    assert sum(evaluated) > sum(trained), "the case under test: an eval micro-batch fuller than the one step trains"
    # the training rows are still the step's; the eval rows are probed beside them and size the estimate
    assert sorted(r.lengths.planned) == sorted(trained) and sorted(r.lengths.eval_planned) == sorted(evaluated)
    assert r.lengths.worst_batch_tokens == sum(evaluated) <= 512
    assert f"the fullest eval micro-batch holds {sum(evaluated)} tokens, more than the {sum(trained)}" in r.report_md.read_text()
    # the need is the larger of the step's and the eval's (measured on a GPU)
    step = preflight.ProbeResult(True, 3.0, 2.5, 10.0, trained, step_need_gib=2.0, eval_need_gib=2.4)
    assert preflight.PreflightResult.need_of(step) == round(2.4 * preflight.NEED_SCALE + preflight.NEED_PLUS_GIB, 4)
    # with no eval data only the training plan's own heaviest is probed
    no_eval = cfg.model_copy(update={"data": cfg.data.model_copy(update={"eval_file": None}),
                                     "smoke": cfg.smoke.model_copy(update={"check": "stops"})})
    alone = preflight.run(no_eval, tmp_path / "p2").lengths
    assert sorted(alone.planned) == sorted(trained) and alone.eval_planned == [] and alone.worst_batch_tokens == sum(trained)
