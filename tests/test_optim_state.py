"""A checkpoint of one AdamW resumed by the other (the OOM fallback from fit: speed's fused AdamW to fit: memory's
8-bit AdamW): the moments, step count and learning rate carry over, and training goes on."""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from stages import data  # noqa: E402
from stages.config import load_config  # noqa: E402
from stages.model.load import load_tokenizer  # noqa: E402
from stages.train import batches, hf_trainer, optim_state  # noqa: E402
from stages.train import model as lora_model  # noqa: E402
from tests.conftest import write_config  # noqa: E402


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    # 8,192 values: 8-bit states in 32 blocks; 64 values: under bitsandbytes' min_8bit_size, 32-bit states
    return [torch.nn.Parameter(torch.randn(128, 64, generator=gen)), torch.nn.Parameter(torch.randn(64, generator=gen))]


def _steps(opt, params, grads) -> None:
    for g in grads:
        for p, x in zip(params, g, strict=True):
            p.grad = x.clone()
        opt.step()


def _grads(n: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(128, 64, generator=gen), torch.randn(64, generator=gen)] for _ in range(n)]


def test_torch_adamw_moments_become_8bit_states_and_back_within_the_quantization_step():
    grads = _grads(4)
    ref = _params(0)
    adam = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.0)
    _steps(adam, ref, grads[:3])
    saved = adam.state_dict()
    assert optim_state.layout(saved) == "torch"

    moved = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    eight = bnb.optim.AdamW8bit(moved, lr=1e-3, weight_decay=0.0)
    assert optim_state.own_layout(eight) == "bnb" and optim_state.own_layout(adam) == "torch"
    optim_state.adopt(eight, saved)
    big, small = (eight.state[p] for p in moved)
    assert big["step"] == small["step"] == 3 and big["state1"].dtype == torch.uint8 and small["state1"].dtype == torch.float32
    torch.testing.assert_close(small["state1"], saved["state"][1]["exp_avg"])
    for n, key in (("1", "exp_avg"), ("2", "exp_avg_sq")):
        back = bnb.functional.dequantize_blockwise(big["state" + n], absmax=big["absmax" + n], code=big["qmap" + n], blocksize=256)
        want = saved["state"][0][key]
        # bitsandbytes' dynamic 8-bit code: within a few percent of each 256-value block's largest moment
        assert ((back - want).abs().view(-1, 256).amax(1) <= 0.05 * want.abs().view(-1, 256).amax(1)).all()

    # the next step from the carried moments moves the weights as the uninterrupted 32-bit AdamW does, not as a fresh
    # 8-bit AdamW would (whose first step is lr x sign(grad))
    before = [p.detach().clone() for p in moved]
    _steps(adam, ref, grads[3:])
    _steps(eight, moved, grads[3:])
    for r, m, b in zip(ref, moved, before, strict=True):
        want, got = r.detach() - b, m.detach() - b
        assert torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0) > 0.99
    fresh = bnb.optim.AdamW8bit([q := torch.nn.Parameter(before[0].clone())], lr=1e-3, weight_decay=0.0)
    q.grad = grads[3][0].clone()
    fresh.step()
    assert torch.nn.functional.cosine_similarity((ref[0].detach() - before[0]).flatten(), (q.detach() - before[0]).flatten(), dim=0) < 0.95

    # and back: 8-bit states into torch's AdamW, exactly the values bitsandbytes dequantizes
    again = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in moved], lr=1e-3, weight_decay=0.0)
    optim_state.adopt(again, eight.state_dict())
    (p0, p1) = again.param_groups[0]["params"]
    s0 = eight.state[moved[0]]
    torch.testing.assert_close(again.state[p0]["exp_avg"], bnb.functional.dequantize_blockwise(
        s0["state1"], absmax=s0["absmax1"], code=s0["qmap1"], blocksize=256))
    assert float(again.state[p1]["step"]) == 4
    _steps(again, [p0, p1], grads[3:])   # torch's AdamW steps on the carried state


def test_a_checkpoint_of_32bit_adamw_resumes_under_8bit_adamw_from_its_step(tmp_path, capsys):
    """The OOM fallback's resume on a real model and the Trainer: 8-bit AdamW reads the checkpoint the 32-bit AdamW
    wrote (it raised KeyError 'state1' at its first step) and trains on from its step."""
    def trainer(optim: str, steps: int, model=None):
        cfg = load_config(write_config(tmp_path, training={"optim": optim, "max_steps": steps, "save_steps": 2, "packing": "off",
                                                           "per_device_train_batch_size": 2, "warmup_steps": 0,
                                                           "logging_steps": 1}))
        tok = data.tokenize(data.read_jsonl(cfg.data.train_file)[:8], load_tokenizer(cfg.model), cfg.data.max_length, "error")
        model = model or lora_model.build_model(cfg)
        return hf_trainer.make_trainer(cfg, model, batches.rows(tok), batches.Collator(0), tmp_path / "out", disable_tqdm=True)

    first = trainer("adamw_torch", 2)
    first.train()
    hf_trainer.release(first)
    ckpt = tmp_path / "out" / "checkpoints" / "checkpoint-2"
    assert optim_state.layout(torch.load(ckpt / "optimizer.pt", weights_only=True)) == "torch"

    second = trainer("adamw_8bit", 4)
    second.train(resume_from_checkpoint=str(ckpt))
    assert "checkpoint-2's AdamW moments carried over to adamw_8bit" in capsys.readouterr().out
    assert second.state.global_step == 4
    logged = {h["step"]: h["loss"] for h in second.state.log_history if "loss" in h}   # steps 1-2 from the checkpoint
    assert sorted(logged) == [1, 2, 3, 4] and torch.isfinite(torch.tensor([logged[3], logged[4]])).all()
    inner = second.optimizer.optimizer if hasattr(second.optimizer, "optimizer") else second.optimizer
    assert optim_state.own_layout(inner) == "bnb"
    assert all(s["step"] == 4 for s in inner.state.values())   # 2 carried + 2 trained
    assert second.lr_scheduler.last_epoch == 4                  # the schedule went on from the checkpoint's step
    hf_trainer.release(second)
