"""The one memory helper: per-stage peaks that reset, and exact child-process peaks."""

from __future__ import annotations

import json
import sys

from stages import memory
from stages.train import batches, hf_trainer
from stages.train import model as lora_model


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


def test_a_stage_starts_without_what_an_earlier_one_dropped(tmp_path):
    """Cyclic garbage an earlier stage left (a trainer and its model hold each other) is collected at
    the next stage's start, so it is neither that stage's peak nor still held when llama.cpp loads."""
    import gc

    class Node:
        pass

    gc.disable()
    try:
        a, b = Node(), Node()
        a.other, b.other, a.block = b, a, bytearray(300 * 2**20)
        a.block[::4096] = b"x" * len(a.block[::4096])  # resident
        del a, b  # unreachable, but only the cycle collector frees it
        with memory.track("next", tmp_path) as meter:
            pass
    finally:
        gc.enable()
    gc.collect()  # without the collection at the stage start, this is where the 300 MiB would go
    assert meter.report.peak_rss_gib < memory.stats()["rss_gib"] + 0.1


def test_the_summary_table_shows_each_stage_s_own_figures():
    gpu = memory.MemoryReport("train", "NVIDIA H200", 12.0, 3.1, None, peak_alloc_gib=6.4, peak_reserved_gib=6.9,
                              start_alloc_gib=0.06, start_reserved_gib=0.06)
    host = memory.MemoryReport("handoff", "cpu", 1.0, 0.8, None)
    rows = memory.markdown_table({"train": gpu, "handoff": host.to_json(), "merge": None})
    assert rows[2] == "| train | 12.0 | 6.90 | 6.40 | 0.06 | 3.10 | - |"
    assert rows[3] == "| handoff | 1.0 | - | - | - | 0.80 | - |"  # no GPU figure for a stage that never used it
    assert rows[4].startswith("| merge | skipped")


def _tied_model(root):
    """A tiny tied-embedding model (the rule for Qwen2.5 0.5-3B, Llama-3.2, Gemma, SmolLM2) with the default's tokenizer."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import REPO

    config = AutoConfig.for_model("qwen2", vocab_size=448, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(REPO / "assets" / "tiny-llama" / f, root / f)
    return root


def test_a_freed_model_leaves_nothing_behind(tmp_path):
    """With an 8-bit bitsandbytes optimizer (the GPU default) the HF Trainer registers every nn.Embedding in
    bitsandbytes' process-wide GlobalOptimManager, which nobody clears: before the fix a tied table
    outlived each build (on the H200: +445 MiB per build of a tied Qwen2.5-1.5B, the probe's table still
    allocated during training). Three builds, trained and released: none of their tables survives."""
    import gc
    import weakref

    from stages.config import RunConfig
    from tests.conftest import REPO

    model_dir = _tied_model(tmp_path / "tied")
    cfg = RunConfig.model_validate({
        "model": {"name_or_path": str(model_dir)}, "data": {"train_file": str(REPO / "assets/data/translate_train.jsonl")},
        "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}, "handoff": {"model_name": "t"},
        "training": {"per_device_train_batch_size": 2, "max_steps": 2, "optim": "adamw_8bit", "packing": "off"}})  # padded rows below
    tables = []
    for _ in range(3):
        model = lora_model.build_model(cfg)
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # tied
        tables.append(weakref.ref(model.get_input_embeddings().weight))
        rows = [{"input_ids": list(range(3, 40)), "labels": list(range(3, 40))} for _ in range(4)]
        trainer = hf_trainer.make_trainer(cfg, model, rows, batches.Collator(0), tmp_path / "out", max_steps=2, save_strategy="no", disable_tqdm=True)
        trainer.train()
        hf_trainer.release(trainer)
        del trainer, model
        gc.collect()
    assert [t() is None for t in tables] == [True, True, True]


def test_the_train_stage_frees_its_model_before_it_returns(tmp_path, monkeypatch):
    """Trainer and model hold each other through reference cycles; the stage collects them itself, so the
    next stage in the flow process (merge, llama.cpp's smoke test) starts without them, even when the
    cycle collector has not run (before the fix the flow process still held 1.22 GiB of torch memory
    during smoke and hand-off on the H200)."""
    import gc
    import weakref

    from stages import train
    from stages.config import load_config
    from stages.train import stage as train_stage
    from tests.conftest import write_config

    built = []

    def spy(cfg, *args):
        model = build(cfg, *args)
        built.append(weakref.ref(model.get_input_embeddings().weight))
        return model

    build = lora_model.build_model
    monkeypatch.setattr(train_stage, "build_model", spy)  # the name train.run looks up
    cfg = load_config(write_config(tmp_path, training={"max_steps": 3}))
    gc.disable()
    try:
        train.run(cfg, tmp_path / "train")
        assert built and all(ref() is None for ref in built)
    finally:
        gc.enable()


def test_pages_touched_peak_counts_the_allocator_pages_live_blocks_hold():
    """A capped allocator with expandable segments unmaps only whole free pages (20 MiB large, 2 MiB small):
    two 12 MiB blocks side by side hold two large pages, and keep both while either half-page is live."""
    mib = 2**20
    events = [{"action": "alloc", "addr": 0, "size": 12 * mib}, {"action": "alloc", "addr": 12 * mib, "size": 12 * mib},
              {"action": "free_completed", "addr": 0, "size": 12 * mib}, {"action": "alloc", "addr": 24 * mib, "size": 4 * mib}]
    assert memory.pages_touched_peak({}, events) == 2 * memory.LARGE_PAGE
    small = [{"action": "alloc", "addr": 1 << 40, "size": 512}, {"action": "alloc", "addr": (1 << 40) + 3 * mib, "size": 512}]
    assert memory.pages_touched_peak({}, small) == 2 * memory.SMALL_PAGE  # two small pages, not one large
    # blocks live before the record began count from the start; a freed one gives its page back
    assert memory.pages_touched_peak({0: 30 * mib}, [{"action": "free_completed", "addr": 0, "size": 30 * mib}]) == 2 * memory.LARGE_PAGE
    with memory.page_need() as need:  # off CUDA there is nothing to replay
        pass
    assert need.gib is None
