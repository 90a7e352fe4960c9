"""Atomic, immutable publishing of hand-off bundles."""

from __future__ import annotations

import subprocess

import pytest

from stages import handoff
from stages.config import load_config
from stages.errors import RunError
from tests.conftest import write_config


def gguf(tmp_path, name, payload: bytes):
    """A real (tiny) GGUF: the tiny model's chat template and special ids, one tensor holding `payload`."""
    import numpy as np
    from gguf import GGUFWriter

    from stages.modelio import load_tokenizer

    tok = load_tokenizer(load_config(write_config(tmp_path)).model)
    p = tmp_path / name
    w = GGUFWriter(str(p), "llama")
    w.add_chat_template(tok.chat_template)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_add_bos_token(True)
    w.add_tensor("payload", np.frombuffer(payload.ljust(16, b"\0"), dtype=np.int8).copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
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
    assert b"one" in (a.bundle_dir / "model-Q4_K_M.gguf").read_bytes()
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
    with pytest.raises(RunError, match="versions are immutable"):
        publish(cfg, "v1", [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"other"))], tmp_path)


def test_bundle_has_a_modelfile_and_model_card_checked_by_sha256sums(tmp_path):
    cfg = load_config(write_config(tmp_path))
    b = publish(cfg, "v1", [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"one")), ("Q5_K_S", gguf(tmp_path, "model-Q5_K_S.gguf", b"two"))],
                tmp_path)
    modelfile = (b.bundle_dir / "Modelfile").read_text()
    assert "FROM ./model-Q4_K_M.gguf" in modelfile and 'PARAMETER stop "</s>"' in modelfile
    # the Go template reproduces the Jinja chat template, minus the BOS llama.cpp adds itself
    assert '{{ else if eq .Role "user" }}[INST] {{ .Content }} [/INST]' in modelfile
    card = (b.bundle_dir / "README.md").read_text()
    assert "model-Q5_K_S.gguf" in card and "sha256sum -c SHA256SUMS" in card
    assert "checked against the Jinja rendering." in card and "default system turn" not in card  # this template has none
    listed = {line.split()[1] for line in (b.bundle_dir / "SHA256SUMS").read_text().splitlines()}
    assert listed == {"model-Q4_K_M.gguf", "model-Q5_K_S.gguf", "manifest.json", "Modelfile", "README.md"}
    subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=b.bundle_dir, check=True, capture_output=True)


def test_disk_full_mid_write_publishes_nothing(tmp_path, monkeypatch):
    import errno
    import shutil

    cfg = load_config(write_config(tmp_path))
    a = publish(cfg, "v1", [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"one"))], tmp_path)
    calls = []

    def fill_disk(src, dst, **kw):  # the second file hits a full disk
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, **kw)

    real = shutil.copy2
    monkeypatch.setattr(shutil, "copy2", fill_disk)
    files = [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"x")), ("Q5_K_S", gguf(tmp_path, "model-Q5_K_S.gguf", b"y"))]
    with pytest.raises(OSError, match="disk full while writing the bundle.*nothing was published and `latest` is unchanged"):
        publish(cfg, "v2", files, tmp_path)
    root = a.bundle_dir.parent
    assert sorted(p.name for p in root.iterdir()) == ["latest", "v1"]
    assert (root / "latest").resolve() == a.bundle_dir.resolve()
