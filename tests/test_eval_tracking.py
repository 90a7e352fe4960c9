"""Eval loss during training (per loss-carrying token, early stopping, the best checkpoint kept) and the
trackers (TensorBoard, MLflow), on the real tiny model: short runs, real packages, read back from disk."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from stages import train
from stages.config import ConfigError, load_config
from stages.model.load import load_tokenizer
from stages.train import batches, eval_loss, tracking
from stages.train import model as lora_model
from tests.conftest import REPO, write_config

pytestmark = pytest.mark.slow
# Small packed micro-batches and 8 held-out samples: each step and each eval is a few tiny forwards.
FAST = {"per_device_train_batch_size": 2, "max_tokens_per_batch": 64, "logging_steps": 1, "warmup_steps": 0}


def _eval_file(tmp_path, n: int = 8):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join((REPO / "assets/data/translate_eval.jsonl").read_text().splitlines(keepends=True)[:n]))
    return str(path)


def test_eval_loss_is_per_loss_carrying_token_however_the_samples_are_batched(tmp_path):
    """Padded by 4, padded one by one and packed give the same eval loss: the token-weighted mean, not a mean of batch means."""
    cfg = load_config(write_config(tmp_path, data={"eval_file": _eval_file(tmp_path, 12)}, training=FAST))
    tokenizer = load_tokenizer(cfg.model)
    rows = eval_loss.rows(cfg, tokenizer)
    results = {}
    for packing in ("off", "on"):  # the model as training builds it: packed attention only when packing
        shaped = cfg.model_copy(update={"training": cfg.training.model_copy(update={"packing": packing})})
        model = lora_model.build_model(shaped)
        for micro in (4, 1) if packing == "off" else (4,):
            shaped = shaped.model_copy(update={"training": shaped.training.model_copy(update={"per_device_train_batch_size": micro})})
            items = eval_loss.micro_batches(shaped, rows, packing == "on")
            collator = batches.PackedCollator(varlen=True) if packing == "on" else batches.Collator(tokenizer.pad_token_id)
            total, tokens = eval_loss.measure(model, items, eval_loss.collate_like(collator), torch.device("cpu"))
            results[f"{packing}-{micro}"] = (total.item() / tokens, tokens, len(items))
        assert model.training  # measure() puts the model back in train mode (checkpointing needs it)
        assert eval_loss.forward_kwargs(model) == {}  # the stock forward takes no skip_logits (only Liger's does)
    assert results["off-4"][2] == 3 and results["off-1"][2] == 12 and results["on-4"][2] < 12
    assert results["off-4"][1] == results["off-1"][1] == results["on-4"][1]  # the same loss-carrying tokens
    for name in ("off-1", "on-4"):
        assert results[name][0] == pytest.approx(results["off-4"][0], rel=1e-5)


def test_early_stopping_keeps_the_checkpoint_with_the_lowest_eval_loss(tmp_path):
    """A learning rate too small to move the eval loss: it never gets lower after the first eval, so
    training stops `patience` evals later and the adapter written is step 1's, not the last step's."""
    over = FAST | {"max_steps": 12, "save_steps": 1, "eval_steps": 1, "early_stopping_patience": 2, "learning_rate": 1e-12}
    cfg = load_config(write_config(tmp_path, data={"eval_file": _eval_file(tmp_path)}, training=over))
    r = train.run(cfg, tmp_path / "train")
    assert r.stopped_early and r.steps == 3
    assert [e["step"] for e in r.eval_curve] == [1, 2, 3] and len({e["eval_loss"] for e in r.eval_curve}) == 1
    assert r.best_step == r.adapter_step == 1 and r.best_eval_loss == r.eval_curve[0]["eval_loss"]
    ckpt = tmp_path / "train" / "checkpoints"
    adapter = load_file(r.adapter_dir / "adapter_model.safetensors")
    best, last = (load_file(ckpt / f"checkpoint-{s}" / "adapter_model.safetensors") for s in (1, 3))
    assert all(torch.equal(adapter[k], best[k]) for k in best)
    assert any(not torch.equal(adapter[k], last[k]) for k in last)  # the last step did move the adapter
    saved = json.loads((tmp_path / "train" / "train_result.json").read_text())
    assert saved["eval_curve"] == r.eval_curve and saved["best_step"] == 1 and saved["stopped_early"] is True
    assert [json.loads(x)["step"] for x in (tmp_path / "train" / "eval_loss.jsonl").read_text().splitlines()] == [1, 2, 3]
    again = train.run(cfg, tmp_path / "train")  # the finished stage is skipped, with the same eval record
    assert again.skipped and again.eval_curve == r.eval_curve and again.adapter_step == 1


def test_train_result_artifacts_are_the_memory_steps_and_the_eval_curve(tmp_path):
    """What the flow publishes for train: every (len // 100)th memory row, then the eval curve; each only if there,
    also for a result cached before artifacts() existed (read back without memory_png or eval fields)."""
    stage_dir = tmp_path / "train"
    stage_dir.mkdir()
    old = {"adapter_dir": str(stage_dir / "adapter"), "steps": 3, "first_loss": 2.0, "final_loss": 1.0, "train_tokens": 9,
           "tokens_per_s": 1.0, "trainable_params": 4, "resumed_from": None, "loss_png": str(stage_dir / "loss.png"), "memory": None}
    assert train.TrainResult.from_record(old).artifacts() == []
    (stage_dir / "memory_steps.jsonl").write_text("".join(json.dumps({"step": i, "rss_gib": 1.0}) + "\n" for i in range(1, 251)))
    curve = [{"step": 1, "eval_loss": 2.5, "eval_tokens": 40}, {"step": 2, "eval_loss": 2.25, "eval_tokens": 40}]
    r = train.TrainResult.from_record(dict(old, memory_png=str(stage_dir / "memory.png"), eval_curve=curve, best_step=2,
                                           best_eval_loss=2.25, stopped_early=True, adapter_step=2))
    steps, evals = r.artifacts()
    assert steps.key == "memory-steps-train" and [row["step"] for row in steps.table] == list(range(1, 251, 2))
    assert steps.description == f"Memory per optimizer step (every 2); plot: {stage_dir / 'memory.png'}"
    assert evals.key == "eval-loss-train" and evals.table == curve
    assert evals.description == ("Eval loss per loss-carrying token on the held-out data; lowest 2.2500 at step 2, stopped early "
                                 f"at step 3; adapter from step 2; plot: {stage_dir / 'loss.png'}")


def test_save_steps_must_be_a_multiple_of_eval_steps_to_keep_the_best(tmp_path):
    cfg = load_config(write_config(tmp_path, training={"save_steps": 5, "eval_steps": 2}))
    with pytest.raises(ConfigError, match=r"training.save_steps \(5\) is not a multiple of training.eval_steps \(2\).*e.g. 4 or 6.*"
                                          r"training.load_best: false"):
        train.run(cfg, tmp_path / "train")
    assert not (tmp_path / "train" / "fit.json").exists()  # refused before the model was built
    assert eval_loss.eval_steps(cfg.model_copy(update={"training": cfg.training.model_copy(update={"load_best": False})}), True) == 2
    assert eval_loss.eval_steps(cfg, has_eval=False) is None


def test_without_eval_data_the_eval_settings_are_inert_and_say_so(tmp_path, capsys):
    over = FAST | {"max_steps": 2, "save_steps": 5, "eval_steps": 2, "early_stopping_patience": 1}
    cfg = load_config(write_config(tmp_path, data={"eval_file": None}, smoke={"check": "stops"}, training=over))
    r = train.run(cfg, tmp_path / "train")
    out = capsys.readouterr().out
    assert out.count("no eval data") == 1 and "training.eval_steps, early_stopping_patience and load_best have no effect" in out
    assert r.steps == 2 and r.eval_curve == [] and r.best_step is None and not r.stopped_early and r.adapter_step == 2


def test_tensorboard_and_mlflow_get_losses_eval_params_memory_and_plots(tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    over = FAST | {"max_steps": 3, "save_steps": 3, "report_to": ["tensorboard", "mlflow"]}
    cfg = load_config(write_config(tmp_path, data={"eval_file": _eval_file(tmp_path)}, training=over))
    out = tmp_path / "train"
    r = train.run(cfg, out)

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx([r.best_eval_loss])
    assert [e.step for e in events.Scalars("memory/peak_rss_gib")] == [1, 2, 3]
    assert {"plots/loss", "plots/memory"} <= set(events.Tags()["images"])

    saved = json.loads((out / "mlflow_run.json").read_text())
    assert saved["tracking_uri"] == f"sqlite:///{(out / 'mlflow.db').resolve()}"
    client = MlflowClient(saved["tracking_uri"])
    run = client.get_run(saved["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["training.max_steps"] == "3" and run.data.params["training.report_to"] == '["tensorboard", "mlflow"]'
    assert run.data.params["learning_rate"] == str(cfg.training.learning_rate)  # the Trainer's own params too
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]
    assert client.get_metric_history(run.info.run_id, "eval_loss")[0].value == pytest.approx(r.best_eval_loss)
    assert len(client.get_metric_history(run.info.run_id, "memory/rss_gib")) == 3
    assert {a.path for a in client.list_artifacts(run.info.run_id, "plots")} == {"plots/loss.png", "plots/memory.png"}
    assert "train_result.json" in {a.path for a in client.list_artifacts(run.info.run_id)}

    # After export and smoke, the flow adds each GGUF's fidelity and smoke figures to the same runs.
    fidelity = [{"quant": "Q4_K_M", "file": "model-Q4_K_M.gguf", "mean_kl": 0.012, "top1_agreement": 0.918}]
    tracking.log_export(cfg, out, fidelity, {"Q4_K_M": {"accuracy": 1.0}})
    assert client.get_metric_history(run.info.run_id, "export/Q4_K_M/top1_agreement")[0].value == pytest.approx(0.918)
    assert client.get_metric_history(run.info.run_id, "smoke/Q4_K_M/accuracy")[0].value == 1.0
    assert {"export/fidelity.md", "export/fidelity.json"} <= {a.path for a in client.list_artifacts(run.info.run_id, "export")}
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("export/Q4_K_M/mean_kl")] == pytest.approx([0.012])

    # As after a crash before the results were written: the rerun resumes and continues the same MLflow run.
    (out / "train_result.json").unlink()
    train.run(cfg, out)
    assert json.loads((out / "mlflow_run.json").read_text())["run_id"] == saved["run_id"]
    assert len(client.search_runs([run.info.experiment_id])) == 1
