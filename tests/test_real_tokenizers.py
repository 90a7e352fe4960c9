"""Released tokenizers, rebuilt from llama.cpp's own test vocabularies (tests/real_tokenizers.py), on tiny random-init
models: Qwen2's byte-level BPE (151,643 tokens + ChatML, 151,936 embedding rows) and Phi-3's SentencePiece (chat
tokens that strip the whitespace after them) through every stage with their releases' chat templates, Llama 3's
byte-level BPE through the preflight and the hand-off's stop tokens, and each against llama.cpp's test strings."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from stages import checks, data, handoff, merge, preflight, smoke
from stages.config import load_config
from stages.export import llamacpp, modelcard, vocab
from stages.export import stage as export_stage
from stages.export.llamacpp_process import LlamaProcess
from stages.model import load
from stages.train import stage as train_stage
from tests import real_tokenizers as rt
from tests.conftest import write_config

# SentencePiece and llama.cpp put a word-start space before any text; transformers 5's Metaspace adds none to text that
# already starts with a space ("▁Hello" for " Hello", llama.cpp "▁" "▁Hello"), and its BPE merges runs of "▁" that
# SentencePiece's scores keep apart: of llama.cpp's 46 strings, the 15 that start with a space differ. A chat template
# puts no such text after a special token, and the export's tokenization check compares the texts that are trained on.
SPM_LEADING_SPACE = 15


@pytest.mark.parametrize("name", rt.RELEASES)
def test_each_rebuilt_tokenizer_gives_llama_cpps_ids_for_its_test_strings(name):
    d = rt.vocabulary(name)
    strings = rt.cases(name)
    with LlamaProcess(name) as llm:   # this runtime on the sdist's own vocabulary: the .out files are its ids
        llm.call("load", str(d / f"ggml-vocab-{name}.gguf"), vocab_only=True)
        assert llm.call("tokenize", [t for t, _ in strings]) == [ids for _, ids in strings]
    r = rt.roundtrip(name)
    assert r.strings == 46
    if r.sentencepiece is None:   # byte-level BPE: tokenizer.json is the release's, id for id
        assert r.identical == 46, r.differ[:3]
    else:
        assert r.sentencepiece == 46
        assert len(r.differ) == SPM_LEADING_SPACE and all(x["text"].startswith(" ") for x in r.differ), r.differ[:3]


def tiny_model(name: str, out: Path) -> tuple[Path, dict]:
    """A 2-layer, 64-wide random-init model of `name`'s release (its model_type, embedding rows and special ids) with the
    release's tokenizer files. Its table and head are set so that it answers the end-of-turn token at once: a random
    model never stops, and a stop is what the smoke test and the served answers are checked for."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = rt.build(name)
    release = json.loads((src / "release.json").read_text())
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("release.json"))
    config = AutoConfig.for_model(release["model_type"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                                  tie_word_embeddings=False, vocab_size=release["rows"], bos_token_id=release["bos_token_id"],
                                  eos_token_id=release["eos_token_id"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    end_of_turn = AutoTokenizer.from_pretrained(out).convert_tokens_to_ids(release["end_of_generation"][0])
    with torch.no_grad():   # one large coordinate on every token, read only by the end-of-turn token's output row
        model.get_input_embeddings().weight[:, 0] = 50.0
        model.get_output_embeddings().weight[end_of_turn].zero_()
        model.get_output_embeddings().weight[end_of_turn, 0] = 1.0
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": release["bos_token_id"],
                                                            "eos_token_id": release["generation_eos"]}))
    return out, release


def _config(tmp_path: Path, model_dir: Path, model_name: str):
    loose = {"f16": 1.0, "Q4_K_M": 1.0}   # random weights: the fidelity has nothing to hold; that it runs is the point
    return load_config(write_config(
        tmp_path, model={"name_or_path": str(model_dir)},
        training={"max_steps": 2, "save_steps": 100},   # no checkpoint, so no eval pass over 100 samples at 150k logits
        export={"imatrix": "off", "quant_types": ["Q4_K_M"], "fidelity": {"samples": 2, "max_mean_kl": loose, "min_top1": dict.fromkeys(loose, 0.0)}},
        # every answer is empty (the model's first token ends the turn): `stops` passes none, the stop counts are checked
        smoke={"check": "stops", "min_accuracy": 0.0, "max_prompts": 2, "max_tokens": 4, "serve": True},
        handoff={"model_name": model_name, "adapter": "off"}))


@pytest.mark.slow
@pytest.mark.parametrize("name, served_as", [("qwen2", "support-bot"), ("phi-3", "support-bot (Phi-3)")])
def test_a_release_tokenizer_trains_exports_serves_and_stops_at_its_end_of_turn(name, served_as, tmp_path):
    model_dir, release = tiny_model(name, tmp_path / "model")
    cfg = _config(tmp_path, model_dir, "support-bot")
    tok = load.load_tokenizer(cfg.model)

    pre = preflight.run(cfg, tmp_path / "preflight")   # the converter's vocabulary against the HF tokenizer, before training
    trained = train_stage.run(cfg, tmp_path / "train")
    assert trained.steps == 2 and trained.final_loss == trained.final_loss
    merged = merge.run(cfg, trained.adapter_dir, tmp_path / "merge")
    exported = export_stage.run(cfg, merged.merged_dir, tmp_path / "export")

    proven = json.loads((tmp_path / "export" / "export_result.json").read_text())["checks"]
    assert proven["base"] == {"vocab_size": release["rows"], "bos_token_id": release["bos_token_id"],
                              "eos_token_id": release["eos_token_id"], "chat_template_equal": True}
    assert proven["Q4_K_M"]["chat_template_equal"] and proven["tokenization"] == {"texts_compared": 20, "identical": True}
    assert "pre_tokenizer" not in proven   # the converter knew the tokenizer by its own table: it is the release's
    # Phi-3's chat tokens strip the whitespace after them; llama.cpp does so only in a GGUF whose name says Phi-3
    assert proven["names"]["general.name"] == served_as and proven["names"]["general.finetune"] == "support-bot"
    info = llamacpp.read_gguf(exported.base_gguf)
    if name == "phi-3":   # as gguf-py's reader reads it (9 s on Qwen2's vocabulary)
        assert info == llamacpp._read_gguf_with_reader(exported.base_gguf)
    assert info["fields"]["tokenizer.ggml.model"] == {"qwen2": "gpt2", "phi-3": "llama"}[name]
    assert info["fields"].get("tokenizer.ggml.pre") == {"qwen2": "qwen2", "phi-3": "default"}[name]

    smoked = smoke.run(cfg, [(f.quant, f.path) for f in exported.files], tmp_path / "smoke")
    (f,) = smoked.files
    # in process and through llama.cpp's OpenAI-compatible server, each answer ended at the end-of-turn token
    assert f.n_prompts == 2 and f.stopped_at_eos == 2 and f.examples[0]["got"] == ""
    assert f.served["n_prompts"] == 2 and f.served["stopped_at_eot"] == 2 and f.served["examples"][0]["finish_reason"] == "stop"

    bundle = handoff.from_stages(cfg, "v1", data.fingerprint([cfg.data.train_file, cfg.data.eval_file]), None,
                                 pre, trained, merged, exported, smoked, tmp_path / "handoff-stage").bundle_dir
    manifest = json.loads((bundle / "manifest.json").read_text())
    text = (bundle / "Modelfile").read_text()
    # exactly the release's end-of-generation tokens: the template's end of turn, then generation_config.json's EOS ids
    assert manifest["stop_tokens"] == release["end_of_generation"]
    assert [line for line in text.splitlines() if line.startswith("PARAMETER stop")] == [
        f"PARAMETER stop {json.dumps(s)}" for s in release["end_of_generation"]]
    tt = modelcard.turn_template(tok.chat_template, tok.bos_token, tok.eos_token, strip_bos=True)
    assert tt.go_template() in text
    convo = [{"role": "user", "content": "Translate to French: red"}, {"role": "assistant", "content": "rouge"},
             {"role": "user", "content": "Translate to French: house"}]
    rendered = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert (tok.bos_token or "") + tt.assemble(convo) == rendered   # llama.cpp adds the BOS the template opens with
    subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=bundle, check=True)


@pytest.mark.slow
def test_llama_3s_tokenizer_passes_the_preflight_and_stops_at_eot_id(tmp_path):
    """Llama 3 (128,256 tokens, BOS inside its template, <|eot_id|> ending a turn and <|end_of_text|> the text): the
    preflight's check of the converter's vocabulary against the HF tokenizer; its stop tokens and Ollama template."""
    model_dir, release = tiny_model("llama-bpe", tmp_path / "model")
    cfg = _config(tmp_path, model_dir, "support-bot")
    tok = load.load_tokenizer(cfg.model)
    gguf = vocab.start(model_dir, llamacpp.converter_dir(), vocab.served_name("support-bot", tok, model_dir)).wait()
    checks.served_tokenizer(cfg, tok, gguf, model_dir)   # the preflight's check: metadata, 40 chat texts tokenized both ways
    assert llamacpp.read_gguf(gguf)["fields"]["tokenizer.ggml.pre"] == "llama-bpe"   # the converter knew it by its table
    with LlamaProcess("llama 3") as llm:
        llm.call("load", str(gguf), vocab_only=True)
        stops = handoff.stop_tokens(llm, tok, tok.chat_template, model_dir)
        assert llm.call("add_bos")
    assert stops == release["end_of_generation"] == ["<|eot_id|>", "<|end_of_text|>"]
    tt = modelcard.turn_template(tok.chat_template, tok.bos_token, tok.eos_token, strip_bos=True)
    convo = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "red"}]
    assert tok.bos_token + tt.assemble(convo) == tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("name, model_name, served", [
    ("phi-3", "support-bot", "support-bot (Phi-3)"),
    ("phi-3", "Phi3-support", "Phi3-support"),
    ("qwen2", "support-bot", "support-bot"),
    ("qwen2", "phi-3-like", None),       # llama.cpp would strip after <|im_start|> and <|im_end|>: refused
    ("llama-spm", "phi3-chat", None),    # ... after </s>
])
def test_the_gguf_name_keeps_llama_cpps_phi_3_whitespace_rule_to_tokenizers_that_have_it(name, model_name, served):
    tok = rt.load(name)
    if served is None:
        with pytest.raises(vocab.TokenizerMismatch, match=rf"handoff.model_name '{model_name}' contains .* strip the whitespace"
                                                          r".*Choose a handoff.model_name without 'phi-3' or 'phi3'"):
            vocab.served_name(model_name, tok, Path("model"))
    else:
        assert vocab.served_name(model_name, tok, Path("model")) == served


def test_the_preflight_refuses_a_phi3_name_for_a_tokenizer_that_keeps_the_whitespace(tmp_path):
    model_dir, _ = tiny_model("llama-spm", tmp_path / "model")
    cfg = _config(tmp_path, model_dir, "phi3-chat")
    with pytest.raises(vocab.TokenizerMismatch, match=r"'phi3-chat' contains 'phi3'.* keeps it after </s>: every served prompt"):
        preflight.run(cfg, tmp_path / "preflight")


def test_gguf_metadata_is_read_as_gguf_py_reads_it():
    """llamacpp.read_gguf walks the header itself (gguf-py's reader takes 9 s over a 150k vocabulary): the same
    fields, tensor types, sizes and shapes on the sdist's vocabularies small enough for gguf-py's reader in CI."""
    for name in ("phi-3", "llama-spm"):
        gguf = rt.vocabulary(name) / f"ggml-vocab-{name}.gguf"
        assert llamacpp.read_gguf(gguf) == llamacpp._read_gguf_with_reader(gguf)
