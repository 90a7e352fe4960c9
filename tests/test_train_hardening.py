"""Training that survives: OOM post-mortem and recovery, exact resume after kill -9, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from stages import data, train
from stages.config import ConfigError, load_config
from stages.model.load import load_tokenizer
from stages.train import batches, hf_trainer, kernels, oom
from stages.train import model as lora_model
from stages.train import stage as train_stage
from tests.conftest import REPO, killed_rerun_against_straight, write_config

pytestmark = pytest.mark.slow
SHORT = {"max_steps": 8, "save_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 8, "warmup_steps": 0}


def test_memory_lines_and_timeline_plot(tmp_path):
    cfg = load_config(write_config(tmp_path, training=SHORT | {"max_steps": 3}))
    r = train.run(cfg, tmp_path / "train")
    lines = [json.loads(x) for x in (tmp_path / "train" / "memory_steps.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and all(x["rss_gib"] > 0.1 for x in lines)
    assert r.memory_png and r.memory_png.stat().st_size > 5000


@pytest.mark.parametrize("packing", ["off", "on"])
def test_injected_oom_writes_a_postmortem_and_resumes_with_half_the_micro_batch(tmp_path, packing):
    cfg = load_config(write_config(tmp_path, training=SHORT | {"packing": packing, "max_tokens_per_batch": 176}))
    r = train.run(cfg, tmp_path / "train", inject_oom_at=5)
    assert r.steps == 8
    (rec,) = r.oom_recoveries
    assert rec["step"] == 5 and rec["resumed_from"].endswith("checkpoint-4")
    pm = json.loads((tmp_path / "train" / "oom-postmortem-1.json").read_text())
    if packing == "off":
        assert (rec["per_device_train_batch_size"], rec["gradient_accumulation_steps"]) == (4, 2)  # same effective batch
        assert pm["batch"]["shape"][0] == 8 and len(pm["batch"]["ids"]) == 8
    else:  # half the token budget, the same accumulation: a step still trains its 8 samples, in more micro-batches
        assert (rec["max_tokens_per_batch"], rec["gradient_accumulation_steps"]) == (88, 1)
        assert pm["batch"]["shape"][0] == 1 and 0 < pm["batch"]["shape"][1] <= 176 and len(pm["batch"]["ids"]) > 1
    assert pm["step"] == 5
    assert all(".jsonl:" in i for i in pm["batch"]["ids"])  # sample ids, file:line
    assert pm["non_lora_params_requiring_grad"] == [] and "injected" in pm["error"]
    assert json.loads((tmp_path / "train" / "memory.json").read_text())["extra"]["oom_recoveries"][0]["step"] == 5


def test_nothing_of_the_failed_attempt_is_alive_when_the_model_is_built_again(tmp_path, monkeypatch):
    """The OOM recovery frees the failed attempt before the rebuild: on a GPU the old model still allocated made
    the rebuild itself run out of memory. Weak references to the failed model, its optimizer and dataloader
    must be dead when build_model is called again, without the test collecting anything."""
    built, checked = [], []
    real = lora_model.build_model

    def build(*a, **kw):
        if built:
            alive = [k for k, ref in hf_trainer.InjectOOM.failed.items() if ref() is not None]
            checked.append(alive)
        model = real(*a, **kw)
        # On a GPU Liger binds the model's forward to it (and the tiled MLP closes over each MLP): the model sits in
        # reference cycles that only the collector frees. Made here too, so that this CPU test sees what a GPU run does.
        model.cycle = [model]
        built.append(type(model).__name__)
        return model

    monkeypatch.setattr(train_stage, "build_model", build)  # the name train.run looks up
    cfg = load_config(write_config(tmp_path, training=SHORT | {"max_steps": 6, "packing": "off"}))
    r = train.run(cfg, tmp_path / "train", inject_oom_at=3)
    assert len(built) == 2 and sorted(hf_trainer.InjectOOM.failed) == ["model", "optimizer", "train_dataloader"]
    assert checked == [[]], f"still alive at the rebuild: {checked}"
    assert r.steps == 6 and r.oom_recoveries[0]["previous_attempt_freed"] is True


def test_oom_retries_zero_stops_at_the_first_oom(tmp_path):
    cfg = load_config(write_config(tmp_path, training=SHORT | {"packing": "off", "oom_retries": 0}))
    with pytest.raises(train.TrainOOMError, match=r"step 3 with micro-batch 8 .*training.oom_retries is 0.*oom-postmortem-1.json"):
        train.run(cfg, tmp_path / "train", inject_oom_at=3)


def test_oom_at_micro_batch_one_gives_up_with_the_postmortem(tmp_path):
    cfg = load_config(write_config(tmp_path, training=SHORT | {"per_device_train_batch_size": 1, "packing": "off"}))
    with pytest.raises(train.TrainOOMError, match=r"step 3 with micro-batch 1 .*no smaller micro-batch.*oom-postmortem-1.json"):
        train.run(cfg, tmp_path / "train", inject_oom_at=3)


@pytest.mark.parametrize("packing", ["on", "off"])
def test_kill_9_then_rerun_equals_an_uninterrupted_run_bit_for_bit(tmp_path, packing):
    """Killed mid-epoch (packed: 12 of ~56 micro-batches of the epoch's seeded plan), the rerun resumes
    from the last checkpoint and ends with the same adapter, bit for bit."""
    over = SHORT | {"max_steps": 12, "save_steps": 3, "packing": packing}
    result, _ = killed_rerun_against_straight(write_config(tmp_path, training=over), tmp_path, 6)
    assert result["resumed_from"].endswith(("checkpoint-6", "checkpoint-9")) and result["steps"] == 12


def test_target_modules_that_match_nothing_list_the_linear_modules(tmp_path):
    cfg = load_config(write_config(tmp_path, lora={"target_modules": ["query", "value"]}))
    with pytest.raises(ValueError, match=r"match no linear module of LlamaForCausalLM; its linear modules are .*'q_proj'.*'v_proj'"):
        lora_model.build_model(cfg)


def test_out_of_range_learning_rate_and_rank_fail_validation(tmp_path):
    with pytest.raises(ConfigError, match=r"training.learning_rate: Input should be less than or equal to 1"):
        load_config(write_config(tmp_path, training={"learning_rate": 3}))
    with pytest.raises(ConfigError, match=r"lora.r: Input should be greater than 0"):
        load_config(write_config(tmp_path, lora={"r": 0}))


def _grads(model, batch) -> dict:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_partial_checkpointing_gives_the_same_gradients_as_full(tmp_path):
    """fit: speed un-checkpoints layers; that must change memory and time, never the gradients."""
    cfg = load_config(write_config(tmp_path, lora={"lora_dropout": 0.0}, training={"packing": "off"}))  # a padded batch below
    model = lora_model.build_model(cfg)
    tok = load_tokenizer(cfg.model)
    rows = batches.rows(data.tokenize(data.read_jsonl(cfg.data.train_file)[:4], tok, 256, "error"))
    batch = batches.Collator(tok.pad_token_id)(rows)
    assert lora_model.checkpointed_layers(model) == (2, 2)
    full = _grads(model, batch)
    lora_model.checkpoint_only(model, 1)
    assert lora_model.checkpointed_layers(model) == (1, 2)
    partial = _grads(model, batch)
    lora_model.checkpoint_only(model, 0)
    none = _grads(model, batch)
    assert full.keys() == partial.keys() == none.keys() and len(full) == 28  # 2 layers x 7 linears x A,B
    for n in full:
        torch.testing.assert_close(partial[n], full[n])
        torch.testing.assert_close(none[n], full[n])


def test_gpu_only_settings_fail_clearly_on_cpu(tmp_path):
    for key in ("offload_activations", "offload_embeddings", "fused_kernels", "tiled_mlp"):
        cfg = load_config(write_config(tmp_path, training={key: "on"}))
        with pytest.raises(ValueError, match=rf"training\.{key}: on needs a CUDA GPU.*set it to auto"):
            lora_model.build_model(cfg) if key != "offload_activations" else hf_trainer.make_trainer(cfg, None, [], None, tmp_path)
    cfg = load_config(write_config(tmp_path))
    s = kernels.settings(cfg)
    assert s.optim == "adamw_torch" and not s.offload_activations and not s.offload_embeddings


def test_liger_gets_the_kernels_each_family_has():
    """Liger's apply functions name the MLP kernel by activation and take only their family's kernels: Gemma-2's
    has geglu and no swiglu (passing swiglu was a TypeError at the model build, found on a Gemma-2 shape). These
    are Liger 0.8.5's signatures (liger_kernel/transformers/monkey_patch.py)."""

    def llama(rope=True, cross_entropy=False, fused_linear_cross_entropy=None, rms_norm=True, swiglu=True, model=None): ...

    def gemma2(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True, model=None): ...

    def llava(cross_entropy=False, fused_linear_cross_entropy=True, model=None): ...

    assert kernels.liger_options(llama, loss=True, kernels=False) == {
        "fused_linear_cross_entropy": True, "cross_entropy": False, "rope": False, "rms_norm": False, "swiglu": False}
    assert kernels.liger_options(gemma2, loss=False, kernels=True) == {
        "fused_linear_cross_entropy": False, "cross_entropy": False, "rope": True, "rms_norm": True, "geglu": True}
    assert kernels.liger_options(llava, loss=True, kernels=True) == {"fused_linear_cross_entropy": True, "cross_entropy": False}
    if kernels._has_liger():  # where Liger is installed (the GPU image): every family it maps takes the loss we rely on
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        for model_type, apply in MODEL_TYPE_TO_APPLY_LIGER_FN.items():
            options = kernels.liger_options(apply, loss=True, kernels=True)
            assert options["fused_linear_cross_entropy"] == kernels.fused_loss_for(model_type), model_type


def test_what_liger_raises_for_is_never_asked_and_the_family_gets_the_plain_loss():
    """Liger 0.8.5's Granite function raises NotImplementedError for the fused loss (Granite scales its logits), its
    GLM-4 one for RoPE: read from the function's source, those options go as False (a Granite run on a GPU stopped
    at that NotImplementedError with the defaults), and the loss of such a family is the plain one."""

    def granite(rope=True, cross_entropy=True, fused_linear_cross_entropy=False, rms_norm=True, swiglu=True, model=None):
        if swiglu:
            pass
        if fused_linear_cross_entropy:
            raise NotImplementedError("LigerFusedLinearCrossEntropy is not available for Granite models.")

    def glm4(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None):
        if rope:
            raise NotImplementedError("liger_rotary_pos_emb is not available for Glm4 models.")

    assert kernels.refused(granite) == {"fused_linear_cross_entropy"} and kernels.refused(glm4) == {"rope"}
    assert kernels.liger_options(granite, loss=True, kernels=True) == {
        "fused_linear_cross_entropy": False, "cross_entropy": False, "rope": True, "rms_norm": True, "swiglu": True}
    assert kernels.liger_options(glm4, loss=True, kernels=True)["rope"] is False
    granite(**kernels.liger_options(granite, loss=True, kernels=True))   # what use_liger calls: no NotImplementedError


def test_fit_choice_is_recorded(tmp_path):
    cfg = load_config(write_config(tmp_path, training=SHORT | {"max_steps": 2, "fit": "speed"}))
    r = train.run(cfg, tmp_path / "train")
    fit = json.loads((tmp_path / "train" / "fit.json").read_text())
    assert fit == r.fit and fit["checkpointed_layers"] == fit["total_layers"] == 2
    # packed on CPU by default: the attention that keeps samples apart (stages/train/attention.py)
    assert "no CUDA device" in fit["reason"] and fit["attention"] == "tae_varlen (cpu)"


def test_tokens_per_second_counts_only_the_micro_batches_trained_on(tmp_path):
    """The Trainer collates ahead (a step's micro-batches plus one prefetched), and an epoch's last
    step has fewer micro-batches than the accumulation: train_tokens counts what was trained on.
    10 rows, micro-batch 2, accumulation 2: epoch 1 = 5 micro-batches in 3 steps, step 4 = 2 more."""
    from stages import data
    from stages.model.load import load_tokenizer

    rows = tmp_path / "ten.jsonl"
    rows.write_text("".join((REPO / "assets/data/translate_train.jsonl").read_text().splitlines(keepends=True)[:10]))
    cfg = load_config(write_config(tmp_path, data={"train_file": str(rows)},
                                   training=SHORT | {"max_steps": 4, "per_device_train_batch_size": 2,
                                                     "gradient_accumulation_steps": 2, "train_sampling_strategy": "sequential",
                                                     "packing": "off"}))
    r = train.run(cfg, tmp_path / "train")
    ids = data.tokenize(data.read_jsonl(rows), load_tokenizer(cfg.model), cfg.data.max_length, cfg.data.long_sample_policy).input_ids
    assert len(ids) == 10 and r.steps == 4
    assert r.train_tokens == sum(map(len, ids)) + sum(map(len, ids[:4]))


def test_training_runs_data_parallel_in_a_launched_subprocess(tmp_path):
    """launcher: accelerate starts the stage in 2 processes (torchrun + gloo on CPU): twice the data per step, one adapter."""
    runs = {}
    for n in (1, 2):
        cfg = load_config(write_config(tmp_path, training={"max_steps": 4, "save_steps": 4, "launcher": "accelerate", "num_processes": n}))
        r = train.run(cfg, tmp_path / f"train{n}")
        state = json.loads((tmp_path / f"train{n}" / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
        runs[n] = r
        assert r.steps == 4 == state["global_step"] and (r.adapter_dir / "adapter_model.safetensors").is_file()
        assert (tmp_path / f"train{n}" / "launch_config.yaml").is_file() and (tmp_path / f"train{n}" / "memory.json").is_file()
    assert runs[2].batches["samples_per_step"] == 2 * runs[1].batches["samples_per_step"] == 64  # each process trains its 32
    assert runs[2].train_tokens > 1.5 * runs[1].train_tokens


@pytest.mark.parametrize("sig,n", [(signal.SIGTERM, 2), (signal.SIGKILL, 2), (signal.SIGKILL, 1)])
def test_stopping_a_launched_training_leaves_no_process_behind(tmp_path, sig, n):
    """A cancelled flow run's SIGTERM, or a SIGKILL, stops the launcher and every rank: nothing keeps the GPUs."""
    import psutil

    cfg = write_config(tmp_path, training={"max_steps": 100_000, "save_steps": 100_000, "launcher": "accelerate", "num_processes": n})
    code = f"from stages import train; from stages.config import load_config; train.run(load_config({str(cfg)!r}), {str(tmp_path / 'train')!r})"
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    me = psutil.Process(parent.pid)
    deadline = time.time() + 120
    while time.time() < deadline and len([p for p in me.children(recursive=True) if "stages.train" in " ".join(p.cmdline())]) < n + 1:
        time.sleep(0.5)  # the launcher and its ranks
    tree = me.children(recursive=True)
    assert len(tree) >= n + 1, [p.cmdline() for p in tree]
    parent.send_signal(sig)
    parent.wait(timeout=60)
    gone, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, [p.cmdline() for p in alive]


def test_a_ctrl_c_whose_exception_a_finalizer_swallowed_still_stops_training(tmp_path, monkeypatch, capfd):
    """Python raises Ctrl-C's KeyboardInterrupt in whatever runs next on the main thread; inside a finalizer it is
    printed as "Exception ignored ... Traceback" and dropped, and training went on (the flow's Ctrl-C test hung so
    once; another time the flow's Ctrl-C printed that traceback from an asyncio transport's __del__). Here SIGINT
    arrives inside a __del__ at step 3: the entry point exits 130, prints no traceback, and no step after the next
    runs."""
    from stages import errors

    raised_in_finalizer = []

    class SigintOnDelete:
        def __del__(self):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)  # the handler runs here, inside the finalizer
            except KeyboardInterrupt:
                raised_in_finalizer.append(True)
                raise  # ...and Python drops it here: a finalizer's exception goes to sys.unraisablehook

    real = hf_trainer.MemoryCallback.on_step_end

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            obj = SigintOnDelete()
            del obj
        return real(self, args, state, control, **kwargs)

    monkeypatch.setattr(hf_trainer.MemoryCallback, "on_step_end", on_step_end)
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # Python's own, which prints (pytest's collects)
    cfg = load_config(write_config(tmp_path, training=SHORT | {"max_steps": 40, "save_steps": 100}))
    capfd.readouterr()
    # a terminal's Ctrl-C: Python's own handler in place (a suite started with `pytest &` inherits SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert errors.run_cli(lambda: train.run(cfg, tmp_path / "train"), "train") == 130
    finally:
        signal.signal(signal.SIGINT, before)
    err = capfd.readouterr().err
    assert raised_in_finalizer == [True]  # the exception really was raised inside the finalizer
    assert "Exception ignored" not in err and "Traceback" not in err, err[-2000:]
    assert "train: interrupted." in err
    steps = [json.loads(x)["step"] for x in (tmp_path / "train" / "memory_steps.jsonl").read_text().splitlines()]
    assert max(steps) <= 4, steps
    # the answered Ctrl-C does not stop the next run in this process (it once did: a suite's worker died at the
    # next test's first step with "node down: keyboard-interrupt")
    errors.check_interrupted()


def test_the_oom_policy_picks_the_next_attempt_from_the_post_mortem(tmp_path):
    """oom.next_attempt, the whole OOM policy: fit: speed falls back to fit: memory at the same micro-batch;
    otherwise the micro-batch halves with twice the accumulation, resuming from the checkpoint, until
    training.oom_retries is used or no smaller micro-batch exists."""
    from types import SimpleNamespace

    cfg = load_config(write_config(tmp_path, training=SHORT | {"packing": "off", "oom_retries": 2, "per_device_train_batch_size": 8}))
    report = {"step": 3, "phase": "train", "path": "oom-postmortem-1.json", "batch": {"ids": ["a", "b"]}}
    freed = {"previous_attempt_freed": True, "alloc_gib": 0.06}
    plan = SimpleNamespace(tokens_per_micro_batch=4096)
    speed = cfg.model_copy(update={"training": cfg.training.model_copy(update={"fit": "speed"})})
    nxt, rec = oom.next_attempt(speed, report, 0, False, 40, plan, None, freed)
    assert nxt.training.fit == "memory" and nxt.training.per_device_train_batch_size == 8 and rec["fit"] == "memory"
    nxt, rec = oom.next_attempt(cfg, report, 0, False, 40, plan, tmp_path / "checkpoint-2", freed)
    t = nxt.training
    assert (t.per_device_train_batch_size, t.gradient_accumulation_steps) == (4, 2 * cfg.training.gradient_accumulation_steps)
    assert rec == {"step": 3, "postmortem": "oom-postmortem-1.json", "resumed_from": str(tmp_path / "checkpoint-2"),
                   "per_device_train_batch_size": 4, "gradient_accumulation_steps": t.gradient_accumulation_steps} | freed
    assert "resuming with micro-batch 4 x accumulation" in oom.describe_recovery(report, rec)
    with pytest.raises(train.TrainOOMError, match=r"step 3 with micro-batch 8 \(rows \['a', 'b'\]\); 2 retries used"):
        oom.next_attempt(cfg, report, 2, False, 40, plan, None, freed)
    one = cfg.model_copy(update={"training": cfg.training.model_copy(update={"per_device_train_batch_size": 1})})
    with pytest.raises(train.TrainOOMError, match="no smaller micro-batch is possible"):
        oom.next_attempt(one, report, 0, False, 40, plan, None, freed)
