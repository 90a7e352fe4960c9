"""stages.result_files: one owner of every stage's result file, and one answer to "is this stage done"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages import result_files


@dataclass
class _Result:
    adapter_dir: Path
    steps: int


def test_a_stage_is_done_only_with_its_result_and_every_output_it_stands_for(tmp_path):
    train = tmp_path / "train"
    train.mkdir()
    assert not result_files.done(train, "train")
    saved = result_files.save(train, "train", _Result(train / "adapter", 4))
    assert saved == train / "train_result.json" and not list(train.glob("*.partial"))
    assert result_files.load(train, "train") == {"adapter_dir": str(train / "adapter"), "steps": 4}
    assert not result_files.done(train, "train"), "no adapter yet: not done"
    (train / "adapter").mkdir()
    (train / "adapter" / "adapter_config.json").write_text("{}")
    assert result_files.done(train, "train")


def test_an_export_is_done_only_while_every_gguf_it_lists_is_there(tmp_path):
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    result_files.save(tmp_path, "export", {"files": [{"quant": "Q4_K_M", "path": str(gguf)}]})
    assert result_files.done(tmp_path, "export")
    gguf.unlink()
    assert not result_files.done(tmp_path, "export")
