"""What an exported GGUF says it is (general.*), read back with gguf-py from files the official converter wrote; and
llama.cpp's vocabulary loads, which warned about a training context of 0."""

from __future__ import annotations

import json
import shutil

from stages import memory
from stages.export import convert, llamacpp, naming, vocab
from stages.export.llamacpp_process import LlamaProcess
from tests.conftest import REPO

TINY = REPO / "assets" / "tiny-llama"


def test_a_gguf_names_itself_after_the_run_and_its_hugging_face_base(tmp_path):
    """A base from the HF cache (a snapshot of Qwen/Qwen2.5-0.5B-Instruct, its card's front matter giving the license):
    the converter writes the run's name, the base's family, the base with its repo URL, and the license gguf-py's
    override file alone would drop."""
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "0123abc"
    shutil.copytree(TINY, snapshot)
    (snapshot / "README.md").write_text("---\nlicense: apache-2.0\nlicense_link: https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/blob/main/LICENSE\n"
                                        "---\n# Qwen2.5-0.5B-Instruct\n")
    names = naming.override("support-bot", str(snapshot), snapshot)
    (tmp_path / "names.json").write_text(json.dumps(names))
    with memory.track("export", tmp_path / "stage", gpu=False) as meter:
        convert.convert(meter, llamacpp.converter_dir(), snapshot, tmp_path / "model-f16.gguf", "f16", metadata=tmp_path / "names.json")
    fields = llamacpp.read_gguf(tmp_path / "model-f16.gguf")["fields"]
    assert {k: v for k, v in fields.items() if k.startswith("general.") and k not in ("general.file_type", "general.quantization_version")} == {
        "general.architecture": "llama", "general.type": "model", "general.size_label": "1.8M",
        "general.name": "support-bot", "general.finetune": "support-bot", "general.basename": "Qwen2.5",
        "general.base_model.count": 1, "general.base_model.0.name": "Qwen2.5 0.5B Instruct",
        "general.base_model.0.organization": "Qwen", "general.base_model.0.repo_url": "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct",
        "general.license": "apache-2.0", "general.license.link": "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/blob/main/LICENSE"}
    assert naming.check(llamacpp.read_gguf(tmp_path / "model-f16.gguf"), names, "model-f16.gguf")["general.name"] == "support-bot"


def test_a_local_base_is_named_by_its_directory_without_a_repo_url_or_license():
    names = naming.override("tiny-llama-translate", str(TINY), TINY)
    assert names == {"general.name": "tiny-llama-translate", "general.basename": "tiny-llama", "general.finetune": "tiny-llama-translate",
                     "general.base_models": [{"name": "Tiny Llama"}]}
    assert naming.hf_repo_id("Qwen/Qwen2.5-7B-Instruct", TINY) == "Qwen/Qwen2.5-7B-Instruct"  # an id resolved from the HF cache


def test_a_vocabulary_load_makes_no_context_and_llama_cpp_warns_of_none(tmp_path, capfd):
    """Each default run printed llama.cpp's "n_ctx_seq (512) > n_ctx_train (0)" three times: the preflight's, export's
    and the hand-off's vocabulary-only loads built a 512-token context on a model whose context length (512 in the
    GGUF, llama.context_length) a vocabulary load never reads. Loaded alone, the vocabulary still tokenizes."""
    gguf = vocab.start(TINY, llamacpp.converter_dir()).wait()
    with LlamaProcess("vocabulary") as llm:
        assert llm.call("load", str(gguf), vocab_only=True) == {"n_vocab": 448, "n_ctx": 0}
        assert llm.call("tokenize", ["</s>"]) == [[2]] and llm.call("end_of_generation") == ["</s>"] and llm.call("add_bos")
    assert "n_ctx_train" not in capfd.readouterr().err
