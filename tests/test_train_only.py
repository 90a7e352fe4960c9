"""`--train-only`: a training box without the export side's tools still gets every other check (the capped grid
runs the train stage alone on a GPU image without llama.cpp)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO, write_config


def _preflight(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    shadow = tmp_path / "shadow"
    for name in ("llama_cpp", "gguf"):  # importable as when not installed
        (shadow / name).mkdir(parents=True, exist_ok=True)
        (shadow / name / "__init__.py").write_text(f'raise ModuleNotFoundError("No module named {name!r}", name={name!r})\n')
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(shadow), str(REPO)]), "NO_LOCAL_GGUF": "1"}
    return subprocess.run([sys.executable, "-m", "stages.preflight", "--config", str(write_config(tmp_path)), "--out",
                           str(tmp_path / "runs" / "x" / "preflight"), *extra], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)


def test_without_llama_cpp_the_preflight_refuses_unless_training_only(tmp_path):
    full = _preflight(tmp_path)
    assert full.returncode == 2, full.stderr[-2000:]
    assert "llama_cpp" in full.stderr and "scripts/install.sh" in full.stderr, full.stderr[-2000:]
    train_only = _preflight(tmp_path, "--train-only")
    assert train_only.returncode == 0, train_only.stderr[-3000:]
    assert (tmp_path / "runs" / "x" / "preflight" / "preflight.md").is_file()
