"""The second embedded default end to end (configs/chatml.yaml): a byte-level BPE tokenizer.json, a ChatML
template with a default system prompt, tied embeddings, widths that are not multiples of 256. Every stage
runs for real under Prefect; the checks are what such models broke before: llama.cpp's fallback types,
the pre-tokenizer, the Modelfile's TEMPLATE, stopping at <|im_end|>."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from stages.export import llamacpp, modelcard, quant_types
from tests.conftest import REPO, write_config

pytestmark = pytest.mark.slow
CHATML = REPO / "configs" / "chatml.yaml"


@pytest.fixture(scope="module")
def chatml(tmp_path_factory, prefect_harness):
    from flows.train_and_export import train_and_export

    tmp = tmp_path_factory.mktemp("chatml")
    state = train_and_export(config=str(write_config(tmp, CHATML)), return_state=True)
    assert state.is_completed(), state
    result = state.result()
    return Path(result["run_dir"]), Path(result["bundle"])


def test_the_asset_is_what_it_stands_for():
    config = json.loads((REPO / "assets/tiny-chatml/config.json").read_text())
    assert config["tie_word_embeddings"] and config["hidden_size"] % 256 and config["intermediate_size"] % 256
    tok = AutoTokenizer.from_pretrained(REPO / "assets/tiny-chatml")
    assert json.loads((REPO / "assets/tiny-chatml/tokenizer.json").read_text())["model"]["type"] == "BPE"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")


def test_quantized_files_hold_llama_cpps_fallback_types_and_say_how_many(chatml):
    run_dir, bundle = chatml
    result = json.loads((run_dir / "export" / "export_result.json").read_text())
    manifest = {f["quant"]: f for f in json.loads((bundle / "manifest.json").read_text())["files"]}
    for f in result["files"]:
        info = llamacpp.read_gguf(bundle / Path(f["path"]).name)
        assert "output.weight" not in info["tensor_types"]  # tied: the token table is the output matrix
        expected = quant_types.expected(info, f["quant"])
        assert {n: c.type for n, c in expected.items()} == {n: info["tensor_types"][n] for n in expected}
        # every attention and MLP matrix has 192- or 576-value rows: all of them fell back, none is a K-type
        assert f["n_fallback"] == sum(1 for n in expected if n.startswith("blk.")) > 0
        assert f["fallbacks"] == quant_types.fallbacks(expected)
        assert not {"Q4_K", "Q5_K", "Q6_K"} & set(info["tensor_types"].values())
        assert manifest[f["quant"]]["n_fallback"] == f["n_fallback"] and manifest[f["quant"]]["fallbacks"] == f["fallbacks"]
    assert result["files"][0]["fallbacks"] == {"Q4_K->Q5_0": 12, "Q6_K->Q8_0": 2}  # ffn_down / attn_v of the more-bits layers
    card = (bundle / "README.md").read_text()
    assert "fallback tensors" in card and "Q4_K->Q5_0 12" in card
    assert "its default system turn included" in card


def test_bpe_tokenization_and_the_template_survive_conversion(chatml):
    run_dir, _ = chatml
    checks = json.loads((run_dir / "export" / "export_result.json").read_text())["checks"]
    # the converter did not know this tokenizer's hash: the pre-tokenizer was named from tokenizer.json and proven
    assert checks["pre_tokenizer"] == {"name": "smollm", "from": "tokenizer.json", "probe_text_compared": True}
    assert checks["tokenization"]["identical"] and checks["tokenization"]["texts_compared"] >= 20
    assert all(checks[q]["chat_template_equal"] for q in ("base", "Q4_K_M", "Q5_K_S"))
    fidelity = {f["quant"]: f for f in json.loads((run_dir / "export" / "export_result.json").read_text())["fidelity"]}
    assert fidelity["f16"]["top1_agreement"] >= 0.99 and all(f["passed"] for f in fidelity.values())


def test_answers_stop_at_im_end_under_llama_cpp(chatml):
    run_dir, _ = chatml
    smoke = json.loads((run_dir / "smoke" / "smoke_result.json").read_text())
    for f in smoke["files"]:
        assert f["n_prompts"] == 50 and f["stopped_at_eos"] == 50 and f["accuracy"] >= 0.9, f["quant"]


def test_modelfile_carries_the_template_with_its_default_system_turn(chatml):
    _, bundle = chatml
    text = (bundle / "Modelfile").read_text()
    assert 'TEMPLATE """<|im_start|>{{ if not .System }}' not in text  # the default turn is inside, after the prefix
    assert "{{ if not .System }}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{{ end }}" in text
    assert 'PARAMETER stop "<|im_end|>"' in text
    assert "<|im_end|>" in json.loads((bundle / "manifest.json").read_text())["stop_tokens"]
    tok = AutoTokenizer.from_pretrained(REPO / "assets/tiny-chatml")
    tt = modelcard.turn_template(tok.chat_template, tok.bos_token, tok.eos_token, strip_bos=False)  # llama.cpp adds no BOS here
    assert tt.go_template() in text  # what the Modelfile holds is what these pieces rebuild
    convo = [{"role": "user", "content": "Translate to French: red"}, {"role": "assistant", "content": "rouge"},
             {"role": "user", "content": "Translate to French: house"}]
    for messages in (convo, [{"role": "system", "content": "Answer in French."}, *convo]):
        assert tt.assemble(messages) == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_bundle_verifies(chatml):
    _, bundle = chatml
    subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=bundle, check=True)
