"""The 8-bit optimizer's one wait per step (stages/train/optimizer.py): the same updates as bitsandbytes' own step."""

import inspect

import torch

from stages.train.optimizer import one_sync_per_step


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    # one above bitsandbytes' 4096-element floor for 8-bit states (blockwise), one below it (32-bit states)
    return [torch.nn.Parameter(torch.randn(256, 512, generator=g)), torch.nn.Parameter(torch.randn(64, generator=g))]


def test_one_wait_per_step_updates_exactly_as_bitsandbytes_does():
    import bitsandbytes as bnb

    theirs, ours = _params(0), _params(0)
    opt_theirs, opt_ours = bnb.optim.AdamW8bit(theirs, lr=1e-2), bnb.optim.AdamW8bit(ours, lr=1e-2)
    assert one_sync_per_step(opt_ours) and not one_sync_per_step(torch.optim.AdamW(_params(1)))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(theirs, ours, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt_theirs.step()
        opt_ours.step()
    assert not torch.equal(theirs[0], _params(0)[0])   # it trained
    for a, b in zip(theirs, ours, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(theirs, ours, strict=True):
        for k, v in opt_theirs.state[a].items():
            assert torch.equal(v, opt_ours.state[b][k]) if torch.is_tensor(v) else v == opt_ours.state[b][k]


def test_the_stage_trainer_waits_once_per_step(tmp_path):
    from stages.config import RunConfig
    from stages.train import batches, hf_trainer
    from stages.train import model as lora_model
    from tests.conftest import REPO

    cfg = RunConfig.model_validate({
        "model": {"name_or_path": str(REPO / "assets" / "tiny-llama")},
        "data": {"train_file": str(REPO / "assets/data/translate_train.jsonl")},
        "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}, "handoff": {"model_name": "t"},
        "training": {"per_device_train_batch_size": 2, "max_steps": 1, "optim": "adamw_8bit", "packing": "off"}})
    model = lora_model.build_model(cfg)
    rows = [{"input_ids": list(range(3, 40)), "labels": list(range(3, 40))} for _ in range(2)]
    trainer = hf_trainer.make_trainer(cfg, model, rows, batches.Collator(0), tmp_path / "out", save_strategy="no", disable_tqdm=True)
    trainer.train()
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert inspect.unwrap(inner.step.__func__).__module__ == "stages.train.optimizer"   # under the LR scheduler's step counter
    assert trainer.state.global_step == 1
    hf_trainer.release(trainer)
