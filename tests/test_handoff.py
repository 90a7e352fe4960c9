"""Atomic, immutable publishing of hand-off bundles."""

from __future__ import annotations

import json
import subprocess

import pytest

from stages import checksums, handoff
from stages.config import load_config
from stages.errors import RunError
from tests.conftest import write_config


def gguf(tmp_path, name, payload: bytes, extra_tokens: tuple[str, ...] = (), template: str | None = None):
    """A real (tiny) GGUF: the tiny model's vocabulary (plus `extra_tokens`, as control tokens), chat template (or
    `template`) and special ids, one tensor holding `payload`."""
    import numpy as np
    from gguf import GGUFWriter

    from stages.model.load import load_tokenizer

    tok = load_tokenizer(load_config(write_config(tmp_path)).model)
    p = tmp_path / name
    p.unlink(missing_ok=True)  # a new file, as export writes one (a .partial renamed into place): a published link keeps the old
    w = GGUFWriter(str(p), "llama")
    w.add_tokenizer_model("llama")  # the vocabulary llama.cpp loads to tell the hand-off its stop tokens
    w.add_token_list(tok.convert_ids_to_tokens(list(range(len(tok)))) + list(extra_tokens))
    w.add_token_scores([0.0] * (len(tok) + len(extra_tokens)))
    w.add_token_types([3 if i in tok.all_special_ids else 1 for i in range(len(tok))] + [3] * len(extra_tokens))  # CONTROL / NORMAL
    w.add_chat_template(template or tok.chat_template)
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
    with pytest.raises(RunError, match="run v1 already published .*bundles are immutable"):
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
    assert listed == {"model-Q4_K_M.gguf", "model-Q5_K_S.gguf", "manifest.json", "Modelfile", "README.md", "comparison.md", "comparison.json"}
    subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=b.bundle_dir, check=True, capture_output=True)


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
                  "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_the_bundle_stops_where_llama_cpp_stops_gemma_s_end_of_turn_included(tmp_path):
    """Gemma ends a turn with <end_of_turn>, not its EOS: the chat template closes each turn with it, llama.cpp stops
    there, and the Modelfile and the model card must say so too, or Ollama answers run on past the turn."""
    cfg = load_config(write_config(tmp_path))
    b = publish(cfg, "v1", [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"one", extra_tokens=("<start_of_turn>", "<end_of_turn>"),
                                            template=GEMMA_TEMPLATE))], tmp_path)
    modelfile = (b.bundle_dir / "Modelfile").read_text()
    assert 'PARAMETER stop "<end_of_turn>"' in modelfile and 'PARAMETER stop "</s>"' in modelfile
    assert modelfile.index("<end_of_turn>") < modelfile.index('stop "</s>"')  # the end of turn first
    assert "Generation stops at: '<end_of_turn>', '</s>'." in (b.bundle_dir / "README.md").read_text()
    assert json.loads((b.bundle_dir / "manifest.json").read_text())["stop_tokens"] == ["<end_of_turn>", "</s>"]


@pytest.mark.parametrize("asset, stops", [("tiny-llama", ["</s>"]), ("tiny-chatml", ["<|im_end|>"])])
def test_the_modelfile_stops_at_exactly_the_model_s_end_of_generation_tokens(tmp_path, asset, stops):
    """The stops are the token the chat template ends an assistant turn with and the EOS, each a token of the GGUF's
    vocabulary (the one llama.cpp's converter makes from the model's own files), nothing else: on the ChatML model
    not "<|endoftext|>" (its unknown token), which llama.cpp's end-of-generation set takes by its text alone, as it
    takes Qwen's plain-text "</s>"."""
    import shutil

    from stages.export import llamacpp, vocab
    from tests.conftest import REPO

    model = REPO / "assets" / asset
    cfg = load_config(write_config(tmp_path, model={"name_or_path": str(model)}))
    served = tmp_path / "model-Q4_K_M.gguf"
    shutil.copyfile(vocab.start(model, llamacpp.converter_dir()).wait(), served)  # a copy: the bundle links its GGUFs read-only
    b = publish(cfg, "v1", [("Q4_K_M", served)], tmp_path)
    lines = (b.bundle_dir / "Modelfile").read_text().splitlines()
    assert [line for line in lines if line.startswith("PARAMETER stop")] == [f'PARAMETER stop "{s}"' for s in stops]
    assert json.loads((b.bundle_dir / "manifest.json").read_text())["stop_tokens"] == stops


def test_disk_full_mid_write_publishes_nothing(tmp_path, monkeypatch):
    import errno

    cfg = load_config(write_config(tmp_path))
    a = publish(cfg, "v1", [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"one"))], tmp_path)
    calls = []

    def fill_disk(src, dst):  # the second file hits a full disk
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    real = handoff.place
    monkeypatch.setattr(handoff, "place", fill_disk)
    files = [("Q4_K_M", gguf(tmp_path, "model-Q4_K_M.gguf", b"x")), ("Q5_K_S", gguf(tmp_path, "model-Q5_K_S.gguf", b"y"))]
    with pytest.raises(OSError, match="disk full while writing the bundle.*nothing was published and `latest` is unchanged"):
        publish(cfg, "v2", files, tmp_path)
    root = a.bundle_dir.parent
    assert sorted(p.name for p in root.iterdir()) == ["latest", "v1"]
    assert (root / "latest").resolve() == a.bundle_dir.resolve()


def test_the_flow_s_hand_off_records_what_the_stages_returned(tmp_path):
    """handoff.from_stages, as the flow calls it: the manifest holds each stage's figures (the served examples left out),
    and the importance matrix ships because a kept file was quantized with it."""
    from types import SimpleNamespace as Result

    from stages.export.stage import ExportResult, GgufFile

    cfg = load_config(write_config(tmp_path))
    f = gguf(tmp_path, "model-Q4_K_M.gguf", b"one")
    (tmp_path / "imatrix.gguf").write_bytes(b"importance")
    ex = ExportResult(tmp_path / "model-f16.gguf", [GgufFile("Q4_K_M", f, 15, 0.1, {"Q4_K": 1})], "test", None,
                      imatrix={"file": str(tmp_path / "imatrix.gguf"), "dataset": "train", "chunks": 2, "tensors": 1, "choices": {},
                               "used_by": ["Q4_K_M"]})
    from stages.export.serving import Served

    served = Served(5, 5, 1.0, 5, 0.2, 40.0, 1.5, examples=[{"prompt": "p", "answer": "a"}]).to_json()
    sm = Result(memory=None, files=[Result(quant="Q4_K_M", accuracy=1.0, passed=5, n_prompts=5, gen_tokens_per_s=9.5,
                                           plan=Result(n_gpu_layers=0), served=served)])
    tr = Result(adapter_dir=tmp_path, steps=10, first_loss=2.0, final_loss=0.1, fit={"checkpointed_layers": 2}, best_eval_loss=0.5,
                memory=None)
    mg = Result(base="16bit", save_dtype="float32", kl={}, memory=None)
    ho = handoff.from_stages(cfg, "v1", "f" * 64, "flow-run-1", Result(memory=None), tr, mg, ex, sm, tmp_path / "stage" / "v1")
    m = json.loads(ho.manifest.read_text())
    assert m["version"] == "v1" and m["data_fingerprint"] == "f" * 64 and m["prefect_flow_run_id"] == "flow-run-1"
    assert m["smoke"]["Q4_K_M"] == {"accuracy": 1.0, "passed": 5, "n_prompts": 5, "gen_tokens_per_s": 9.5, "n_gpu_layers": 0,
                                    "served": {k: v for k, v in served.items() if k != "examples"}}
    assert "examples" not in m["smoke"]["Q4_K_M"]["served"] and m["smoke"]["Q4_K_M"]["served"]["mean_latency_s"] == 0.2
    assert m["memory_peaks"] == dict.fromkeys(["preflight", "train", "merge", "export", "smoke"])
    assert m["merge"] == {"base": "16bit", "save_dtype": "float32", "kl": {}} and m["fidelity"] == []
    assert m["train"] == {"steps": 10, "first_loss": 2.0, "final_loss": 0.1, "fit": {"checkpointed_layers": 2}, "best_eval_loss": 0.5}
    assert m["imatrix"]["file"] == "imatrix.gguf" and sorted(ho.files) == ["imatrix.gguf", "model-Q4_K_M.gguf"]
    assert ho.artifacts()[0].key == "champion-challenger" and ho.artifacts()[0].markdown == ho.comparison


def _judged(cfg, version, tmp_path, accuracy, kl, eval_loss):
    """Publish a bundle judged by these figures (what the flow passes: smoke, fidelity, the adapter's eval loss)."""
    f = gguf(tmp_path, f"model-Q4_K_M-{version}.gguf", version.encode())
    return handoff.run(cfg, version, [("Q4_K_M", f)], tmp_path / "stage" / version, adapter_dir=tmp_path, data_fingerprint="f" * 64,
                       smoke={"Q4_K_M": {"accuracy": accuracy}}, memory={},
                       fidelity=[{"quant": "Q4_K_M", "mean_kl": kl, "top1_agreement": 0.95}],
                       extra={"train": {"best_eval_loss": eval_loss}})


@pytest.mark.parametrize("worse, figure", [((0.90, 0.010, 1.00), "smoke accuracy Q4_K_M"), ((1.00, 0.050, 1.00), "mean KL Q4_K_M"),
                                            ((1.00, 0.010, 1.05), "eval loss")])
def test_a_worse_retrain_is_a_candidate_and_latest_stays(tmp_path, worse, figure):
    """Champion/challenger: on the same held-out data, a retrain worse on any figure beyond handoff.promotion's tolerance
    is published, with its comparison, but `latest` keeps pointing at the champion; one no worse becomes latest."""
    cfg = load_config(write_config(tmp_path))
    first = _judged(cfg, "v1", tmp_path, 1.0, 0.010, 1.00)
    assert first.promoted and "No bundle was published under this model name before" in first.comparison
    root = first.bundle_dir.parent
    bad = _judged(cfg, "v2", tmp_path, *worse)
    assert not bad.promoted and (root / "latest").resolve().name == "v1"
    assert f"**worse** ({figure})" in bad.comparison and (bad.bundle_dir / "comparison.md").read_text() == bad.comparison
    subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=bad.bundle_dir, check=True, capture_output=True)  # the comparison is checksummed
    import json

    assert json.loads((bad.bundle_dir / "manifest.json").read_text())["promotion"] == {"promoted": False, "champion": "v1", "worse": figure}
    good = _judged(cfg, "v3", tmp_path, 0.99, 0.012, 1.01)  # within every tolerance
    assert good.promoted and (root / "latest").resolve().name == "v3" and "promoted to `latest`" in good.comparison


def test_without_comparing_every_bundle_becomes_latest(tmp_path):
    cfg = load_config(write_config(tmp_path, handoff={"model_name": "tiny-llama-translate", "promotion": {"compare": False}}))
    _judged(cfg, "v1", tmp_path, 1.0, 0.01, 1.0)
    assert _judged(cfg, "v2", tmp_path, 0.0, 0.5, 9.0).promoted


@pytest.mark.slow
def test_a_worse_retrain_fails_the_flow_run_and_leaves_latest(tmp_path, capfd, prefect_harness):
    """Through the flow: a champion judged 100% on the same held-out prompts, a 10-step retrain that answers fewer:
    the run publishes a candidate, `latest` stays, and the flow ends with one line naming the regression (exit 2,
    a failed flow run for the deployment's automation)."""
    import json

    from flows.train_and_export import main
    from stages import champion

    cfg_path = write_config(tmp_path, training={"max_steps": 10, "save_steps": 10}, smoke={"min_accuracy": 0.0, "max_prompts": 10})
    cfg = load_config(cfg_path)
    root = tmp_path / "handoff" / cfg.handoff.model_name
    (root / "v0").mkdir(parents=True)
    (root / "v0" / "manifest.json").write_text(json.dumps({
        "held_out_fingerprint": champion.held_out_fingerprint(cfg), "smoke": {"Q4_K_M": {"accuracy": 1.0}, "Q5_K_S": {"accuracy": 1.0}},
        "fidelity": [], "train": {"best_eval_loss": None}, "files": []}))
    (root / "v0" / "SHA256SUMS").write_text(checksums.render({"manifest.json": checksums.sha256_file(root / "v0" / "manifest.json")}))
    (root / "latest").symlink_to("v0")
    code = main(["--config", str(cfg_path), "--run-id", "worse"])
    err = capfd.readouterr().err
    stopped = [line for line in err.splitlines() if "stopped:" in line]
    assert code == 2 and len(stopped) == 1 and "Regression: this run is worse than the bundle `latest` points at" in stopped[0], err[-2000:]
    assert "smoke accuracy Q4_K_M" in stopped[0] and "ln -sfn worse" in stopped[0]
    assert (root / "latest").resolve().name == "v0" and (root / "worse" / "comparison.md").is_file()


def test_the_bundle_links_the_run_s_ggufs_read_only_where_one_filesystem_holds_both(tmp_path):
    """No second copy of a 7B's 10 GB: the GGUF is reflinked or hard-linked into the bundle; a hard link makes both
    names read-only, so nothing rewrites a published file in place; checksummed as before."""
    import os

    cfg = load_config(write_config(tmp_path))
    src = gguf(tmp_path, "model-Q4_K_M.gguf", b"linked")
    b = publish(cfg, "v1", [("Q4_K_M", src)], tmp_path)
    placed = json.loads((b.bundle_dir / "manifest.json").read_text())["placed"]
    dst = b.bundle_dir / "model-Q4_K_M.gguf"
    assert placed["model-Q4_K_M.gguf"] in ("reflink", "hardlink")
    if placed["model-Q4_K_M.gguf"] == "hardlink":
        assert os.stat(src).st_ino == os.stat(dst).st_ino and not os.access(src, os.W_OK) or os.geteuid() == 0
        assert oct(src.stat().st_mode & 0o777) == "0o444"
    subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=b.bundle_dir, check=True, capture_output=True)
    # another filesystem (or one that links nothing): a copy
    other = tmp_path / "copy.gguf"
    assert handoff.place(src, other) in ("reflink", "hardlink")  # same filesystem here
