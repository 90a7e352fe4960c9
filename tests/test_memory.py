"""The one memory helper: per-stage peaks that reset, and exact child-process peaks."""

from __future__ import annotations

import json
import sys

from stages import memory


def test_stage_peak_resets_between_stages(tmp_path):
    with memory.track("a", tmp_path / "a") as a:
        block = bytearray(300 * 2**20)  # touched: 300 MiB resident
        block[:: 4096] = b"x" * len(block[:: 4096])
        del block
    with memory.track("b", tmp_path / "b") as b:
        pass
    assert a.report.peak_rss_gib - b.report.peak_rss_gib > 0.2
    saved = json.loads((tmp_path / "a" / "memory.json").read_text())
    assert saved["stage"] == "a" and saved["peak_gib"] >= a.report.peak_rss_gib and saved["device"] == "cpu"


def test_child_process_peak_is_measured(tmp_path):
    with memory.track("c", tmp_path) as meter:
        proc = meter.run([sys.executable, "-c", "b = bytearray(400 * 2**20); b[::4096] = b'x' * len(b[::4096])"])
    assert proc.returncode == 0
    assert 0.39 < meter.report.child_peak_rss_gib < 0.45  # 400 MiB + a bare interpreter
    r = meter.report
    assert r.peak_gib == max(r.peak_rss_gib, r.child_peak_rss_gib)  # the headline covers the child too


def test_memory_json_is_written_even_when_the_stage_fails(tmp_path):
    try:
        with memory.track("boom", tmp_path):
            raise RuntimeError("x")
    except RuntimeError:
        pass
    assert json.loads((tmp_path / "memory.json").read_text())["stage"] == "boom"
