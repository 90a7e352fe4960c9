"""distributed: fsdp on CPU: 2 processes on gloo run accelerate's FSDP2 path (the one GPUs run),
train what one process trains, resume after kill -9, and run as two "machines" on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from stages import train
from stages.config import ConfigError, RunConfig, load_config
from stages.preflight import fsdp_over
from stages.train import launch
from stages.train.memory_model import Shapes, estimate
from tests.conftest import REPO, write_config

pytestmark = pytest.mark.slow
STEPS = {"max_steps": 12, "save_steps": 3, "logging_steps": 1, "warmup_steps": 0}
FSDP = {"launcher": "accelerate", "distributed": "fsdp", "num_processes": 2}


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "loss.jsonl").read_text().splitlines()]


def _adapter(out) -> dict:
    return load_file(out / "adapter" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process with accumulation 2, and FSDP over 2 processes with 1 each: the same micro-batches per step."""
    tmp = tmp_path_factory.mktemp("fsdp")
    one = train.run(load_config(write_config(tmp, training=STEPS | {"gradient_accumulation_steps": 2})), tmp / "one")
    sharded_cfg = write_config(tmp, training=STEPS | FSDP)
    two = train.run(load_config(sharded_cfg), tmp / "two")
    return tmp, one, two, sharded_cfg


def test_two_processes_sharded_train_the_loss_curve_and_adapter_of_one(runs):
    tmp, one, two, _ = runs
    assert two.steps == one.steps == 12
    assert _losses(tmp / "two") == pytest.approx(_losses(tmp / "one"), rel=1e-4)
    a, b = _adapter(tmp / "one"), _adapter(tmp / "two")
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)
    assert [e["eval_loss"] for e in two.eval_curve] == pytest.approx([e["eval_loss"] for e in one.eval_curve], rel=1e-4)
    # sharded checkpoints (DCP, one shard per process), each process's peak in the report
    assert (tmp / "two" / "checkpoints" / "checkpoint-12" / "pytorch_model_fsdp_0" / ".metadata").is_file()
    ranks = two.memory.extra["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["peak_rss_gib"] > 0 for r in ranks)
    assert two.memory.extra["distributed"] == {"kind": "fsdp", "processes": 2, "machines": 1}


def test_sharded_run_killed_then_rerun_resumes_to_the_same_adapter(runs):
    tmp, _, straight, cfg_path = runs
    crashed = tmp / "crashed"
    cmd = [sys.executable, "-m", "stages.train", "--config", str(cfg_path), "--out", str(crashed)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    while not (crashed / "checkpoints" / "checkpoint-3" / "trainer_state.json").is_file():
        assert proc.poll() is None and time.time() < deadline, "training ended before it could be killed"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # the launcher and both ranks follow (PR_SET_PDEATHSIG)
    proc.wait()
    assert not (crashed / "adapter").exists()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    result = json.loads((crashed / "train_result.json").read_text())
    assert result["resumed_from"] and result["steps"] == 12
    a, b = _adapter(tmp / "two"), _adapter(crashed)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_two_machines_on_loopback_run_as_one_two_process_job(runs, tmp_path):
    """num_machines: 2, one process each, rendezvous at machine 0's address: the job of 2 processes on one machine."""
    tmp = runs[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    multi = STEPS | FSDP | {"num_processes": 1, "num_machines": 2, "main_process_ip": "127.0.0.1", "main_process_port": port}
    cfg = write_config(tmp_path, training=multi)
    out = tmp_path / "train"
    code = ("import sys; from stages import train; from stages.config import load_config; "
            "r = train.run(load_config(sys.argv[1], [sys.argv[2]]), sys.argv[3]); print('result:', r.steps, r.adapter_dir, r.skipped)")
    machines = [subprocess.Popen([sys.executable, "-c", code, str(cfg), f"training.machine_rank={r}", str(out)], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (1, 0)]
    logs = [m.communicate(timeout=300)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "machine 1 of 2 done" in logs[0]
    # each machine's launcher returns the result process 0 saved (machine 1's through the copy its process kept)
    assert all(f"result: 12 {out / 'adapter'} False" in log for log in logs), logs[0][-3000:]
    assert _losses(out) == pytest.approx(_losses(tmp / "two"), rel=1e-4)
    assert json.loads((out / "train_result.json").read_text())["memory"]["extra"]["distributed"]["machines"] == 2


def test_launcher_arguments_for_machines_and_processes():
    base = RunConfig.model_validate({"model": {"name_or_path": "x"}, "data": {"train_file": "x"}, "handoff": {"model_name": "m"},
                                     "training": FSDP | {"num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1",
                                                         "main_process_port": 29511, "num_processes": 4}})
    gpu = launch.launcher_args(base, cuda=True)
    assert gpu[:5] == ["accelerate.commands.launch", "--num_processes", "8", "--num_machines", "2"]
    assert gpu[gpu.index("--machine_rank") + 1] == "1" and gpu[gpu.index("--main_process_ip") + 1] == "10.0.0.1"
    assert gpu[gpu.index("--main_process_port") + 1] == "29511" and "--multi_gpu" in gpu
    cpu = launch.launcher_args(base, cuda=False)
    assert cpu == ["torch.distributed.run", "--nproc_per_node", "4", "--nnodes", "2", "--node_rank", "1",
                   "--master_addr", "10.0.0.1", "--master_port", "29511"]


@pytest.mark.parametrize("training,message", [
    ({"distributed": "fsdp"}, "need launcher: accelerate"),
    ({"launcher": "accelerate", "num_machines": 2}, "needs main_process_ip"),
    ({"launcher": "accelerate", "num_machines": 2, "machine_rank": 2, "main_process_ip": "h"}, "ranks are 0 .. 1"),
    (FSDP | {"optim": "paged_adamw_8bit"}, "8-bit optimizers do not take FSDP2"),
])
def test_distributed_settings_that_cannot_run_fail_with_the_fix(tmp_path, training, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write_config(tmp_path, training=training))


def test_per_gpu_estimate_shards_the_base_and_the_preflight_names_how_many_gpus():
    """A 70B-class shape in QLoRA: one 24 GiB GPU cannot hold its NF4 weights; sharded, the base per GPU
    shrinks with the process count (the absmax constants stay whole) and the preflight names the fewest GPUs."""
    s = Shapes.from_config({"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                            "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8})
    raw = {"model": {"name_or_path": "x", "torch_dtype": "bfloat16"}, "data": {"train_file": "x", "max_length": 2048},
           "quantization": {"load_in_4bit": True}, "handoff": {"model_name": "m"},
           "lora": {"r": 16, "target_modules": ["q_proj", "v_proj"]}, "training": {"packing": "on", "max_tokens_per_batch": 2048}}
    cfg = RunConfig.model_validate(raw)
    weights = {}
    for n in (1, 2, 4):
        c = RunConfig.model_validate(raw | {"training": raw["training"] | FSDP | {"num_processes": n}})
        e = estimate(c, s, 2048, on_gpu=True)
        weights[n] = next(v for k, v in e.items_gib.items() if k.startswith("base weights"))
    single = next(v for k, v in estimate(cfg, s, 2048, on_gpu=True).items_gib.items() if k.startswith("base weights"))
    assert single > 24 * 0.9 > weights[2] > weights[4]
    # per GPU: sharded / n + what stays whole (the NF4 absmax constants): w(1) - w(2) == 2 (w(2) - w(4)), whole part > 0
    assert weights[1] - weights[2] == pytest.approx(2 * (weights[2] - weights[4]), rel=1e-3)
    assert 2 * weights[2] - weights[1] > 0
    n, per_gpu = fsdp_over(cfg, s, 2048, usable=24 * 0.9 - 0.5, on_gpu=True)
    assert n == 4 and per_gpu < 24 * 0.9 - 0.5
