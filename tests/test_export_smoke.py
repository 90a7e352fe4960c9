"""GGUF export checks and the llama.cpp smoke test, on real files."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from stages import export, memory, smoke
from stages.config import load_config
from stages.export import fidelity, llamacpp, vocab
from stages.export.llamacpp_process import LlamaCrashed, LlamaProcess
from stages.model.load import load_tokenizer
from tests.conftest import REPO, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(e2e):
    return Path(e2e[0]["run_dir"])


def test_base_model_lacks_the_skill(tmp_path):
    """The untrained base, exported the same way, answers 0 held-out prompts: the skill comes from the fine-tune."""
    cfg = load_config(write_config(tmp_path, export={"quant_types": ["Q4_K_M"]}))
    ex = export.run(cfg, REPO / "assets" / "tiny-llama", tmp_path / "export")
    with pytest.raises(smoke.SmokeError, match=r"model-Q4_K_M.gguf: 0/50 prompts passed \(0% < smoke.min_accuracy 90%\)"):
        smoke.run(cfg, [(f.quant, f.path) for f in ex.files], tmp_path / "smoke")
    result = json.loads((tmp_path / "smoke" / "smoke_result.json").read_text())
    assert result["passed"] is False and result["files"][0]["accuracy"] == 0.0


def test_converter_must_match_the_runtime(tmp_path, monkeypatch):
    fake = tmp_path / "conv"
    fake.mkdir()
    (fake / "convert_hf_to_gguf.py").write_text("")
    (fake / "VERSION").write_text("0.0.1\n")
    monkeypatch.setenv("TAE_CONVERTER_DIR", str(fake))
    with pytest.raises(RuntimeError, match=rf"comes from llama-cpp-python 0.0.1, but {llamacpp.runtime_version()} is installed"):
        llamacpp.converter_dir()


def test_quant_types_follow_llama_cpps_rule_and_its_fallbacks(run_dir):
    """The real file passes with no fallbacks (every width a multiple of 256); a type llama.cpp would not have
    chosen is refused by name; the fallback llama.cpp picks for a row that is not a multiple of 256 is accepted
    and counted."""
    info = llamacpp.read_gguf(run_dir / "export" / "model-Q4_K_M.gguf")
    assert export.check_quant_types(info, "Q4_K_M", Path("model-Q4_K_M.gguf")) == {}
    wrong = copy.deepcopy(info)
    wrong["tensor_types"]["blk.0.attn_q.weight"] = "Q5_0"  # row 256: llama.cpp writes Q4_K here
    with pytest.raises(ValueError, match=r"1 of \d+ tensors .*blk.0.attn_q.weight is Q5_0, expected Q4_K \(row 256\)"):
        export.check_quant_types(wrong, "Q4_K_M", Path("model-Q4_K_M.gguf"))
    narrow = copy.deepcopy(info)
    narrow["tensor_shapes"]["blk.0.attn_q.weight"] = [320, 256]  # 320 = 10 x 32, not a multiple of 256
    narrow["tensor_types"]["blk.0.attn_q.weight"] = "Q5_0"
    assert export.check_quant_types(narrow, "Q4_K_M", Path("model-Q4_K_M.gguf")) == {"Q4_K->Q5_0": 1}
    narrow["tensor_types"]["blk.0.attn_q.weight"] = "Q4_K"  # a K-type on such rows cannot be what llama.cpp wrote
    with pytest.raises(ValueError, match=r"blk.0.attn_q.weight is Q4_K, expected Q5_0 \(Q4_K falls back: row 320 is not a multiple of 256\)"):
        export.check_quant_types(narrow, "Q4_K_M", Path("model-Q4_K_M.gguf"))
    with pytest.raises(ValueError, match="general.file_type is 15, expected 16"):
        export.check_quant_types(info, "Q5_K_S", Path("x.gguf"))


def test_gguf_tokenizer_metadata_and_tokenization_match_hf(run_dir):
    cfg = load_config(REPO / "configs" / "default.yaml")
    tok = load_tokenizer(cfg.model)
    result = json.loads((run_dir / "export" / "export_result.json").read_text())
    assert result["checks"]["Q4_K_M"] == {"vocab_size": len(tok), "bos_token_id": 1, "eos_token_id": 2, "chat_template_equal": True}
    assert result["checks"]["tokenization"]["identical"]


def test_tokenizer_mismatch_is_caught(run_dir):
    """The trap found building the default: without legacy=True, HF and llama.cpp tokenize `<s>[INST]` differently."""
    from transformers import AutoTokenizer

    modern = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama", legacy=False)
    text = modern.apply_chat_template([{"role": "user", "content": "Translate to French: red"}], tokenize=False)
    with pytest.raises(vocab.TokenizerMismatch, match=r"tokenizes differently from the HF tokenizer of .*tiny-llama at token 1.*set \"legacy\": true"):
        vocab.check_tokenization(run_dir / "export" / "model-f16.gguf", modern, [text], "model-f16.gguf", REPO / "assets" / "tiny-llama")


def test_the_tokenizer_fix_follows_the_direction_of_the_space():
    """Gemma's GGUF has no space prefix: a Llama-style tokenizer with legacy=True put "▁" where llama.cpp did not,
    and the message used to advise legacy: true, already set (found exporting a Gemma-2 shape)."""
    assert 'set "legacy": true' in vocab.space_fix(["[", "INST"], ["▁[", "INST"])
    assert 'set "legacy": false' in vocab.space_fix(["▁[", "INST"], ["[", "INST"])
    assert "tokenizer files the model was released with" in vocab.space_fix(["▁red"], ["▁re", "d"])
    # advice already followed is not given again (Granite's legacy: true); a byte-level BPE has no such switch
    class Legacy:
        legacy = True

    assert "legacy" not in vocab.space_fix(["[", "INST"], ["▁[", "INST"], Legacy())
    assert "legacy" not in vocab.space_fix(["Ġred"], [" re", "d"])


def test_offload_plan_fits_the_serving_card(run_dir):
    info = llamacpp.read_gguf(run_dir / "export" / "model-Q4_K_M.gguf")
    full = smoke.plan_offload(info, n_ctx=256, gpu_memory_gib=8, gpu_offload=True)
    assert full.n_gpu_layers == full.n_layers == 2
    kv = 2 * 256 * 2 * 64 * 2 * 2 / 2**30  # K+V, n_ctx 256, 2 KV heads x 64, f16, 2 layers
    assert full.kv_cache_gib == pytest.approx(kv, rel=1e-3)
    per_layer = full.layer_gib + kv / 2
    budget = (0.35 + full.other_gib + 1.5 * per_layer) / 0.9  # room for one and a half layers
    assert smoke.plan_offload(info, 256, budget, True).n_gpu_layers == 1
    assert smoke.plan_offload(info, 256, None, True).n_gpu_layers == 0
    assert "CPU build" in smoke.plan_offload(info, 256, 8, False).reason


def test_export_refuses_a_non_model_directory(tmp_path):
    cfg = load_config(write_config(tmp_path))
    with pytest.raises(FileNotFoundError, match="merge stage's `model` directory"):
        export.run(cfg, tmp_path, tmp_path / "export")


def _corrupt(src: Path, dst: Path, tensor: str) -> None:
    """A copy of `src` with one tensor's data zeroed: a file that loads but computes garbage."""
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(str(src)).tensors if t.name == tensor)
    blob = bytearray(src.read_bytes())
    blob[t.data_offset: t.data_offset + int(t.n_bytes)] = bytes(int(t.n_bytes))
    dst.write_bytes(bytes(blob))


def test_fidelity_gate_passes_real_files_and_stops_a_corrupted_one(run_dir, tmp_path):
    result = json.loads((run_dir / "export" / "export_result.json").read_text())
    fid = {f["quant"]: f for f in result["fidelity"]}
    assert fid["f16"]["top1_agreement"] >= 0.99 and fid["f16"]["mean_kl"] < 1e-3
    assert fid["Q4_K_M"]["passed"] and fid["Q5_K_S"]["passed"] and 0 < fid["Q4_K_M"]["mean_kl"] < 0.1
    cfg = load_config(REPO / "configs" / "default.yaml")
    tok = load_tokenizer(cfg.model)
    bad = tmp_path / "model-Q4_K_M.gguf"
    _corrupt(run_dir / "export" / "model-Q4_K_M.gguf", bad, "blk.1.ffn_down.weight")
    with pytest.raises(fidelity.FidelityError, match=r"model-Q4_K_M.gguf: mean KL .* top-1 agreement .*Nothing was handed off"):
        sequences = fidelity.held_out_ids(cfg, tok, cfg.export.fidelity.samples)
        merged = fidelity.load_merged(run_dir / "merge" / "model")
        fidelity.gate(export.measure_fidelity(cfg, [("Q4_K_M", bad)], sequences, fidelity.log_probs(merged, sequences)))


def test_an_architecture_the_converter_does_not_know_stops_with_one_message(run_dir, tmp_path):
    merged = tmp_path / "model"
    shutil.copytree(run_dir / "merge" / "model", merged)
    config = json.loads((merged / "config.json").read_text())
    (merged / "config.json").write_text(json.dumps(config | {"architectures": ["MadeUpForCausalLM"]}))
    cfg = load_config(write_config(tmp_path))
    with pytest.raises(ValueError, match=r"does not support the architecture MadeUpForCausalLM.*nothing can be exported"):
        export.run(cfg, merged, tmp_path / "export")
    assert not list((tmp_path / "export").glob("*.gguf*"))


def test_a_gguf_that_does_not_load_stops_the_smoke_test(tmp_path):
    bad = tmp_path / "model-Q4_K_M.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    cfg = load_config(write_config(tmp_path))
    with pytest.raises(smoke.SmokeError, match=r"model-Q4_K_M.gguf: not a readable GGUF file.*nothing was handed off"):
        smoke.run(cfg, [("Q4_K_M", bad)], tmp_path / "smoke")


def test_llama_cpp_runs_in_a_process_of_its_own_without_torch(run_dir):
    # A CUDA build of llama.cpp segfaults loading a model in a process that imported torch
    # (bench/llama_cuda/results/llama_gpu_diag.json): fidelity, tokenization and smoke use this process.
    import torch

    gguf = run_dir / "export" / "model-f16.gguf"
    with LlamaProcess(gguf.name) as llm:
        info = llm.call("load", str(gguf), n_ctx=32, logits_all=True, n_gpu_layers="all")
        scores = llm.call("scores", [1, 2, 3])
        maps = Path(f"/proc/{llm.proc.pid}/maps").read_text()
    assert scores.shape == (3, info["n_vocab"]) and info["n_ctx"] >= 32
    assert "libllama" in maps and "libtorch" not in maps and "libtorch" in Path("/proc/self/maps").read_text()
    assert torch.isfinite(torch.from_numpy(scores)).all()
    # its own peak, not the torch parent's (ru_maxrss would inherit that across fork and exec)
    assert 0 < llm.peak_rss_gib < memory.peak_rss_gib() / 2


def test_a_crash_inside_llama_cpp_is_one_clear_error(run_dir):
    gguf = run_dir / "export" / "model-f16.gguf"
    with LlamaProcess(gguf.name) as llm:
        llm.call("load", str(gguf), n_ctx=32, logits_all=True)
        os.kill(llm.proc.pid, signal.SIGSEGV)  # what the CUDA build did inside llama_model_load_from_file
        with pytest.raises(LlamaCrashed, match=r"died \(signal SIGSEGV\) during scores of model-f16.gguf; nothing was handed off"):
            llm.call("scores", [1, 2, 3])
    with LlamaProcess(gguf.name) as llm, pytest.raises(ValueError, match="Failed to load model"):
        llm.call("load", str(run_dir / "export" / "export_result.json"))  # an error inside comes back as itself


def test_every_gguf_is_also_asked_through_the_openai_compatible_server_which_then_stops(run_dir, tmp_path):
    """The serving team's path: llama.cpp's server on loopback, the openai client's chat completions, the GGUF's own
    template applied server-side. The e2e run's smoke result holds a served row per GGUF that passed like the
    in-process one and stopped at the end of turn; asked again here, no server process is left after the stage."""
    import psutil

    result = json.loads((run_dir / "smoke" / "smoke_result.json").read_text())
    for f in result["files"]:
        served = f["served"]
        assert served["n_prompts"] == f["n_prompts"] and served["accuracy"] >= 0.9 and served["stopped_at_eot"] == served["n_prompts"]
        assert served["mean_latency_s"] > 0 and served["completion_tokens_per_s"] > 0
    card = next((run_dir.parent.parent.parent / "handoff").rglob("README.md")).read_text()
    assert "served: pass rate, latency, tok/s" in card
    cfg = load_config(write_config(tmp_path, smoke={"max_prompts": 5}))
    gguf = run_dir / "export" / "model-Q4_K_M.gguf"
    r = smoke.run(cfg, [("Q4_K_M", gguf)], tmp_path / "smoke")
    assert r.files[0].served["n_prompts"] == 5 and (tmp_path / "smoke" / "server-Q4_K_M.log").is_file()
    left = [p for p in psutil.process_iter(["cmdline"]) if "llama_cpp.server" in " ".join(p.info["cmdline"] or []) and str(gguf) in
            " ".join(p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"] for p in left]


def test_every_registered_quant_type_is_what_llama_cpp_writes(run_dir, tmp_path):
    """stages/quants.py is the one list of types: each record quantizes through llama.cpp's own quantizer with its
    file type, every tensor in the type the export's port of llama.cpp's rule expects, and the disk check sizes the
    file within a fifth (the tiny model's vocabulary vectors and metadata weigh more than a 7B's)."""
    from stages import checks, quants
    from stages.model.check import read_header

    f16 = run_dir / "export" / "model-f16.gguf"
    header, _ = read_header(run_dir / "merge" / "model" / "model.safetensors")
    tensors = {k: (v["shape"], v["dtype"]) for k, v in header.items() if k != "__metadata__"}
    assert {"Q4_K_M", "Q5_K_S", "Q4_0"} <= set(quants.TYPES)
    for name, q in quants.TYPES.items():
        out = tmp_path / f"{name}.gguf"
        llamacpp.quantize(f16, out, q.ftype)
        info = llamacpp.read_gguf(out)
        assert info["fields"]["general.file_type"] == q.ftype
        assert export.check_quant_types(info, name, out) == {}, name   # every width of the tiny model divides 256
        assert llamacpp.type_counts(info).get(q.tensor_type, 0) > 0, (name, llamacpp.type_counts(info))
        assert 0.8 < checks.gguf_bytes(tensors, name) / out.stat().st_size < 1.2, name
        out.unlink()
