"""Atomic, immutable publishing of hand-off bundles."""

from __future__ import annotations

import subprocess

import pytest

from stages import handoff
from stages.config import load_config
from tests.conftest import write_config


def gguf(tmp_path, name, payload):
    p = tmp_path / name
    p.write_bytes(payload)
    return p


def publish(cfg, version, files, tmp_path):
    return handoff.run(cfg, version, files, tmp_path / "stage" / version, adapter_dir=tmp_path,
                       data_fingerprint="f" * 64, smoke={}, memory={})


def test_publish_then_republish_moves_latest_and_keeps_old(tmp_path):
    cfg = load_config(write_config(tmp_path))
    a = publish(cfg, "v1", [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"one"))], tmp_path)
    b = publish(cfg, "v2", [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"two"))], tmp_path)
    latest = a.bundle_dir.parent / "latest"
    assert latest.resolve() == b.bundle_dir.resolve()
    assert (a.bundle_dir / "model-Q4_K_M.gguf").read_bytes() == b"one"
    subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=a.bundle_dir, check=True, capture_output=True)
    assert oct(b.bundle_dir.stat().st_mode & 0o777) == "0o755"
    assert (tmp_path / "stage" / "v2" / "memory.json").is_file()


def test_failed_publish_leaves_everything_as_it_was(tmp_path):
    cfg = load_config(write_config(tmp_path))
    a = publish(cfg, "v1", [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"one"))], tmp_path)
    root = a.bundle_dir.parent
    with pytest.raises(FileNotFoundError):
        publish(cfg, "v2", [("Q4_K_M", tmp_path / "missing.gguf")], tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "v1"]  # no v2, no temp dir left
    assert (root / "latest").resolve() == a.bundle_dir.resolve()


def test_versions_are_immutable(tmp_path):
    cfg = load_config(write_config(tmp_path))
    publish(cfg, "v1", [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"one"))], tmp_path)
    with pytest.raises(FileExistsError, match="versions are immutable"):
        publish(cfg, "v1", [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"other"))], tmp_path)
