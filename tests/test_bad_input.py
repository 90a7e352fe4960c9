"""Bad input through the README's command: one clear message, exit 2, nothing trained or published."""

from __future__ import annotations

import json

import pytest

from flows.train_and_export import main
from tests.conftest import write_config


def run_cli(tmp_path, capsys, *args):
    code = main(["--config", str(tmp_path / "config.yaml"), *args])
    err = capsys.readouterr().err
    assert not (tmp_path / "handoff").exists(), "nothing may be published"
    assert not list((tmp_path / "artifacts").glob("runs/*/train")), "must stop before training"
    return code, err


def dataset(tmp_path, lines):
    p = tmp_path / "train.jsonl"
    p.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines) + "\n")
    return str(p)


def test_unknown_config_key(tmp_path, capsys):
    write_config(tmp_path, lora={"rank": 8})
    code, err = run_cli(tmp_path, capsys)
    assert code == 2 and "lora.rank: unknown key; did you mean `r`?" in err


def test_missing_model(tmp_path, capsys):
    write_config(tmp_path, model={"name_or_path": "nobody/no-such-model"})
    code, err = run_cli(tmp_path, capsys)
    assert code == 2 and "'nobody/no-such-model' is neither a local directory nor a model in the HF cache" in err


@pytest.mark.parametrize("lines, expected", [
    ([{"prompt": "a", "completion": "b"}, '{"prompt": "a"'], r"train.jsonl:2: not valid JSON"),
    (["", ""], r"train.jsonl has no samples"),
    ([{"messages": [{"role": "user", "content": "hello"}]}], r"train.jsonl:1: has no assistant turn"),
])
def test_bad_dataset_stops_before_training(tmp_path, capsys, prefect_harness, lines, expected):
    write_config(tmp_path, data={"train_file": dataset(tmp_path, lines)})
    code, err = run_cli(tmp_path, capsys)
    assert code == 2
    assert "DataError" in err and __import__("re").search(expected, err), err


def test_preflight_refuses_a_run_that_does_not_fit(tmp_path, capsys, prefect_harness):
    write_config(tmp_path)
    code, err = run_cli(tmp_path, capsys, "--set", "preflight.gpu_memory_gib=0.02")
    assert code == 2 and "PreflightError" in err and "the estimated peak" in err and "smallest change that fits" in err


def test_a_native_crash_in_the_flow_process_names_the_python_line():
    """llama.cpp or a CUDA library dying with SIGSEGV leaves no traceback; the flow module's
    faulthandler prints the Python stack it died in."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    code = "import ctypes, flows.train_and_export\ndef load_gguf():\n    ctypes.string_at(0)\nload_gguf()\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}  # the module's own, not the environment's
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -11 and "Segmentation fault" in p.stderr and "load_gguf" in p.stderr, p.stderr[-2000:]
