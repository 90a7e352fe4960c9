"""stages.result_files: one owner of every stage's result file, and one answer to "is this stage done"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages import result_files
from stages.export import fidelity
from stages.export.stage import ExportResult, GgufFile
from stages.memory import MemoryReport
from stages.merge import MergeResult


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
    result_files.save(tmp_path, "export", ExportResult(tmp_path / "model-f16.gguf", [GgufFile("Q4_K_M", gguf, 15, 0.0, {})],
                                                       "0.3.36", None))
    assert result_files.done(tmp_path, "export")
    gguf.unlink()
    assert not result_files.done(tmp_path, "export")


def test_a_saved_result_comes_back_whole_while_the_files_it_stands_for_are_there(tmp_path):
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    saved = ExportResult(tmp_path / "model-f16.gguf", [GgufFile("Q4_K_M", gguf, 15, 1.5, {"q4_K": 3})], "0.3.36",
                         MemoryReport("export", "cpu", 1.0, 2.0, None, extra={"quantize_s": 3}),
                         fidelity=[fidelity.Fidelity("Q4_K_M", gguf.name, 30, 0.01, 0.05, 0.97, 0.1, 0.8, True)],
                         imatrix={"kept": {"Q4_K_M": True}})
    result_files.save(tmp_path, "export", saved)
    back = result_files.load_if_done(tmp_path, "export", ExportResult)
    assert back == ExportResult(**{**vars(saved), "skipped": True})   # paths, nested results and their lists rebuilt
    gguf.unlink()   # a file the result stands for is gone: the stage runs again
    assert result_files.load_if_done(tmp_path, "export", ExportResult) is None


def test_a_record_of_an_older_version_takes_the_defaults_of_fields_added_since(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    result_files.path(tmp_path, "merge").write_text('{"merged_dir": "%s", "save_dtype": "bfloat16", '
                                                    '"max_abs_logit_diff": 0.01, "memory": null, "gone": 1}' % (tmp_path / "model"))
    back = result_files.load_if_done(tmp_path, "merge", MergeResult)
    assert back == MergeResult(tmp_path / "model", "bfloat16", 0.01, None, skipped=True, base="16bit", kl={})
