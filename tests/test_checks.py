"""What the preflight finds before training (stages/checks.py) and the model-directory check's architecture
comparison (stages/model/check.py), on real files, processes, sockets and filesystems.

The reliability suite runs each problem end to end through both entry points; these tests pin the parts:
no false alarm on checkpoints that load, the family named on a mismatch, the estimate against real GGUF
sizes, the tracker probes, the ENOSPC message on a real full tmpfs.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stages import checks, data, errors
from stages.config import load_config
from stages.model import check
from stages.model.load import load_tokenizer
from stages.train import tracking
from tests.conftest import DEFAULT, REPO, write_config

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "phi3": "Phi3ForCausalLM"}


@functools.cache
def _grid():
    """bench/gpu_figure/random_checkpoints.py, whose make_checkpoint writes random-init checkpoints with save_pretrained."""
    spec = importlib.util.spec_from_file_location("random_checkpoints", REPO / "bench" / "gpu_figure" / "random_checkpoints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    """(family, tied) -> a random-init checkpoint of that family, as make_checkpoint writes it."""
    root = tmp_path_factory.mktemp("checkpoints")
    shapes = {f"{family}-{tied}": dict(model_type=family, architectures=[cls], tie_word_embeddings=tied, **TINY)
              for family, cls in FAMILIES.items() for tied in (False, True)}
    return {(family, tied): _grid().make_checkpoint(f"{family}-{tied}", root, shapes) for family in FAMILIES for tied in (False, True)}


def _relabelled(src: Path, dst: Path, model_type: str) -> Path:
    """`src`'s weights under a config.json naming another family (the sizes unchanged)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"model_type": model_type, "architectures": [FAMILIES[model_type]]}))
    return dst


# --- the architecture against the weights ---------------------------------------------------------


def test_the_embedded_defaults_and_saved_checkpoints_pass(checkpoints):
    for d in (REPO / "assets" / "tiny-llama", REPO / "assets" / "tiny-chatml", *checkpoints.values()):
        assert check.check_model_dir(d) == [], d


@pytest.mark.parametrize("config_type,weights_type,names", [
    ("qwen2", "llama", "6 tensor(s) it expects are in no weights file (e.g. model.layers.0.self_attn.q_proj.bias"),
    ("llama", "qwen2", "6 tensor(s) in the weights have no place in it (e.g. model.layers.0.self_attn.k_proj.bias"),
    ("qwen3", "llama", "model.layers.0.self_attn.q_norm.weight"),
    ("llama", "qwen3", "model.layers.0.self_attn.k_norm.weight"),
    ("phi3", "llama", "model.layers.0.self_attn.qkv_proj.weight"),
    ("llama", "phi3", "model.layers.0.mlp.gate_up_proj.weight"),
])
def test_a_config_of_another_family_is_refused_with_the_family_that_fits(config_type, weights_type, names, checkpoints, tmp_path):
    d = _relabelled(checkpoints[(weights_type, False)], tmp_path / "m", config_type)
    [problem] = check.check_model_dir(d)
    assert f"model_type {config_type!r} ({FAMILIES[config_type]}) does not match the weights" in problem and names in problem
    # the first family that expects exactly these tensors (mistral's layout is llama's)
    assert f"set model_type to {weights_type!r} (and architectures to [{FAMILIES[weights_type]!r}])" in problem


def test_a_family_with_the_same_tensors_is_not_a_mismatch(checkpoints, tmp_path):
    """Mistral's weights are named and shaped as Llama's: such a config loads them as they are."""
    assert check.check_model_dir(_relabelled(checkpoints[("llama", False)], tmp_path / "m", "mistral")) == []


def test_names_are_read_as_transformers_loads_them(checkpoints, tmp_path):
    """A checkpoint of the bare model (no `model.` prefix) and Mixtral's published expert names (fused on load)."""
    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare"
    shutil.copytree(checkpoints[("llama", True)], bare)
    weights = load_file(bare / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in weights.items()}, bare / "model.safetensors", metadata={"format": "pt"})
    assert check.check_model_dir(bare) == []

    shapes = {"mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4, **TINY)}
    moe = _grid().make_checkpoint("mixtral", tmp_path, shapes)
    header, _ = check.read_header(moe / "model.safetensors")
    assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in header)  # saved in the published layout
    assert check.check_model_dir(moe) == []


def test_a_4bit_checkpoint_with_its_extra_tensors_passes(checkpoints, tmp_path):
    pytest.importorskip("bitsandbytes")
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    src, dst = checkpoints[("qwen2", True)], tmp_path / "nf4"
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=BitsAndBytesConfig(load_in_4bit=True), dtype=torch.bfloat16)
    model.save_pretrained(dst)
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    header, _ = check.read_header(dst / "model.safetensors")
    assert any(k.endswith(".weight.absmax") for k in header)
    assert check.check_model_dir(dst) == []


# --- the chat template --------------------------------------------------------------------------


def test_a_template_escaping_the_sandbox_is_named_not_the_data(tmp_path):
    model = tmp_path / "m"
    shutil.copytree(REPO / "assets" / "tiny-llama", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}{{ m['content'] }}{% if 'cat' in m['content'] %}{{ ''.__class__.__mro__ }}{% endif %}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    assert check.check_model_dir(model) == []  # the probe conversation does not reach the escape; the data does
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "fine", "completion": "ok"}) + "\n" + json.dumps({"prompt": "red cat", "completion": "x"}) + "\n")
    with pytest.raises(data.DataError) as e:
        data.tokenize(data.read_jsonl(f), tok, 64, "error")
    assert str(e.value).startswith(f"the chat template in {model / 'tokenizer_config.json'} (its chat_template) reaches for Python internals")
    assert "d.jsonl" not in str(e.value)


# --- data ---------------------------------------------------------------------------------------


def test_a_lone_surrogate_names_the_line_and_field(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "fine", "completion": "ok"}\n'
                 '{"id": "\\udfff", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b \\ud800"}]}\n'
                 '{"prompt": "an emoji \\ud83d\\ude00 is a pair", "completion": "ok"}\n')
    with pytest.raises(data.DataError) as e:
        data.read_jsonl(f)
    assert "1 bad line(s)" in str(e.value)
    assert "d.jsonl:2: messages[1].content holds a lone surrogate, \\ud800 at character 3" in str(e.value)


def test_an_empty_parquet_file_says_it_has_no_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "completion": pa.array([], pa.string())}), f)
    with pytest.raises(data.DataError, match=r"t\.parquet has no rows \(a Parquet file with the columns prompt, completion and 0 rows\)"):
        data.read_source(f)
    f.write_bytes(b"")
    with pytest.raises(data.DataError, match=r"t\.parquet is empty \(0 bytes\)"):
        data.read_source(f)


def test_every_sample_dropped_names_the_file_and_the_length_that_keeps_one(tmp_path):
    tok = load_tokenizer(load_config(DEFAULT).model)
    f = tmp_path / "eval.jsonl"
    f.write_text("".join(json.dumps({"prompt": "Translate: " + "red cat " * n, "completion": "rouge"}) + "\n" for n in (10, 20)))
    samples = data.read_jsonl(f)
    shortest = min(len(data.tokenize([s], tok, 10**6, "error").input_ids[0]) for s in samples)
    with pytest.raises(data.DataError) as e:
        data.tokenize(samples, tok, 8, "drop")
    assert str(e.value) == (f"no sample of {f} is left: all 2 of its samples are longer than data.max_length=8 (the shortest has "
                            f"{shortest} tokens) and data.long_sample_policy is drop; raise data.max_length to at least {shortest}, "
                            f"or give {f} samples that fit")


# --- trackers -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(tmp_path, report_to):
    return load_config(write_config(tmp_path, training={"report_to": report_to}))


def test_an_mlflow_server_that_is_not_there_is_found_in_seconds(tmp_path, monkeypatch):
    port = _free_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(tracking.TrackerError, match=rf"MLFLOW_TRACKING_URI=http://127.0.0.1:{port} does not answer \(Connection refused\)"):
        checks.trackers(_cfg(tmp_path, ["mlflow"]), tmp_path / "train")
    assert time.monotonic() - t0 < 5


def test_a_server_that_answers_passes_whatever_it_answers(tmp_path, monkeypatch):
    """Any HTTP answer (here a 404 for /health) means the server is there."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.server_port}/prefix")
        checks.trackers(_cfg(tmp_path, ["mlflow"]), tmp_path / "train")
    finally:
        server.shutdown()


def test_local_stores_must_be_writable(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    checks.trackers(_cfg(tmp_path, ["mlflow", "tensorboard"]), tmp_path / "runs" / "x" / "train")  # the default SQLite store
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a directory goes")
    with pytest.raises(tracking.TrackerError, match=rf"its log directory {re.escape(str(blocked))}/train/tensorboard cannot be written "
                                                     rf"\({re.escape(str(blocked))} is a file"):
        checks.trackers(_cfg(tmp_path, ["tensorboard"]), blocked / "train")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{blocked}/mlflow.db")
    with pytest.raises(tracking.TrackerError, match=rf"its store MLFLOW_TRACKING_URI=sqlite:///{re.escape(str(blocked))}/mlflow\.db is in "
                                                     rf"{re.escape(str(blocked))}, which cannot be written"):
        checks.trackers(_cfg(tmp_path, ["mlflow"]), tmp_path / "train")


def test_mlflow_calls_to_a_dead_server_end_in_seconds_and_say_so(monkeypatch):
    """Unbounded, MLflow retries a call 7 times with backoff (about 4 minutes); within bounded_http, seconds."""
    from mlflow import MlflowClient

    for k in tracking.HTTP_BOUNDS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")  # a user's own setting wins
    t0 = time.monotonic()
    with tracking.bounded_http(), pytest.raises(Exception) as e:
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2" and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"
        MlflowClient(f"http://127.0.0.1:{_free_port()}").search_experiments()
    assert time.monotonic() - t0 < 30 and tracking._unreachable(e.value), e.value
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"


def test_a_tracker_lost_at_the_start_or_mid_run_stops_training_with_one_message(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    for k in tracking.HTTP_BOUNDS:
        monkeypatch.delenv(k, raising=False)
    cfg = _cfg(tmp_path, ["mlflow"])
    port = _free_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(tracking.TrackerError, match=rf"the MLflow tracking server at http://127.0.0.1:{port} stopped answering during "
                                                    r"training .*rerun with the same --run-id to resume"):
        with tracking.Tracker(cfg, tmp_path / "train"):
            pass
    assert time.monotonic() - t0 < 30
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # the bounds last as long as the tracker

    # mid-run: training stops on the client's error (a real one, from a dead server); the run is ended, the error said as such
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    tracker = tracking.Tracker(cfg, tmp_path / "train2").__enter__()
    with pytest.raises(Exception) as lost:  # within the tracker's bounds: seconds
        MlflowClient(f"http://127.0.0.1:{port}").log_metric(tracker.run_id, "loss", 1.0)
    with pytest.raises(tracking.TrackerError) as e:
        tracker.__exit__(type(lost.value), lost.value, None)
    assert e.value.__cause__ is lost.value
    assert MlflowClient(tracking.default_uri(tmp_path / "train2")).get_run(tracker.run_id).info.status == "FAILED"


# --- export tools -------------------------------------------------------------------------------


def test_the_tool_probes_pass_here_and_a_stuck_one_is_named(tmp_path):
    probes = checks.start_tool_probes()
    checks.finish_tool_probes(probes)
    assert [p.returncode for _w, _p, p in probes] == [0, 0]
    stuck = [("a tool", "pkg", subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True))]
    with pytest.raises(checks.ToolError, match=r"a tool did not start within 1 s \(it imports pkg and exits\); run `bash scripts/install.sh`"):
        checks.finish_tool_probes(stuck, timeout=1)
    assert stuck[0][2].poll() is not None


def test_the_whole_check_passes_on_the_default(tmp_path):
    from stages.model.load import load_tokenizer

    cfg = load_config(write_config(tmp_path))
    t0 = time.monotonic()
    checks.before_training(cfg, tmp_path / "artifacts" / "runs" / "x" / "preflight", load_tokenizer(cfg.model))
    print(f"checks.before_training on the default: {time.monotonic() - t0:.2f} s")


# --- disk ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_estimate_is_close_to_what_the_default_run_wrote(e2e):
    """Merged model, f16 and quantized GGUFs of the default run against the estimate (within 20%)."""
    result, cfg_path, _ = e2e
    cfg, run_dir = load_config(cfg_path), Path(result["run_dir"])
    planned = {o.what: o.bytes for o in checks.planned_outputs(cfg, run_dir / "elsewhere")}
    real = {"merged model": sum(f.stat().st_size for f in (run_dir / "merge" / "model").iterdir() if f.is_file())}
    real |= {f"{q} GGUF": (run_dir / "export" / f"model-{q}.gguf").stat().st_size for q in (cfg.export.outtype, *cfg.export.quant_types)}
    for what, n in real.items():
        assert abs(planned[what] - n) <= 0.2 * n, (what, planned[what], n)


def test_outputs_of_finished_stages_are_not_counted_again(tmp_path):
    cfg = load_config(write_config(tmp_path))
    run = tmp_path / "run"
    before = {o.what for o in checks.planned_outputs(cfg, run)}
    (run / "merge" / "model").mkdir(parents=True)
    (run / "merge" / "merge_result.json").write_text("{}")
    (run / "export").mkdir()
    (run / "export" / "export_result.json").write_text("{}")
    # a merge result whose model is gone: the merge runs again, and writes it again
    assert "merged model" in {o.what for o in checks.planned_outputs(cfg, run)}
    (run / "merge" / "model" / "config.json").write_text("{}")
    after = {o.what for o in checks.planned_outputs(cfg, run)}
    assert before - after == {"merged model", "f16 GGUF", "Q4_K_M GGUF", "Q5_K_S GGUF", "Q4_K_M GGUF with the other weighting",
                              "Q5_K_S GGUF with the other weighting"}
    assert after == {"the adapter proof's base GGUF", "the adapter GGUF"}  # the hand-off's; the bundle links, on this filesystem


def test_the_disk_peak_counts_what_export_and_hand_off_delete_only_until_they_do(tmp_path, capsys):
    """The candidates export quantizes with the other weighting live until the fidelity gate keeps the closer, the
    adapter proof's base GGUF until it is measured: the peak is what stays plus the larger of the two, not their sum;
    the bundle links the run's files (one filesystem here) and adds nothing. The preflight says each part and when it
    is freed."""
    cfg = load_config(write_config(tmp_path))
    outs = {o.what: o for o in checks.planned_outputs(cfg, tmp_path / "run")}
    stays = sum(o.bytes for o in outs.values() if not o.freed)
    assert outs["Q4_K_M GGUF with the other weighting"].freed == "after the fidelity gate"
    proof = outs["the adapter proof's base GGUF"]
    assert proof.freed == "after the adapter proof" and proof.optional and proof.bytes == outs["f16 GGUF"].bytes
    assert checks.peak(list(outs.values())) == stays + proof.bytes  # larger than both candidates together
    assert not any(w.startswith("bundle copy") for w in outs)
    checks.disk(cfg, tmp_path / "run")
    line = capsys.readouterr().out
    assert "the export and the hand-off peak at 13.0 MiB" in line and "the adapter proof's base GGUF 3.4 MiB (freed after the adapter proof; left out where it does not fit)" in line
    off = load_config(write_config(tmp_path, handoff={"adapter": "off"}, export={"imatrix": "off"}))
    assert checks.peak(checks.planned_outputs(off, tmp_path / "run")) == sum(o.bytes for o in outs.values() if not o.freed and not o.optional)


def _in_namespace(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """`script` (shell) with a 1 MiB tmpfs at tmp_path/small, mounted for it alone."""
    if not shutil.which("unshare") or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare -rm (user and mount namespaces) to mount a tmpfs")
    (tmp_path / "small").mkdir()
    return subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path / 'small'} && {script}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_full_disk_names_the_filesystem_of_the_file_written(tmp_path):
    """A write() fails with ENOSPC and names no file: the message names the tmpfs the file was on, its mount point
    and its free space, not the process's working directory. A relative name resolves against that directory."""
    code = (
        "import os, sys\n"
        "from stages import errors\n"
        f"os.chdir({str(tmp_path / 'small')!r})\n"
        "for name, given in (('absolute.bin', os.path.abspath('absolute.bin')), ('relative.bin', 'relative.bin')):\n"
        "    try:\n"
        "        with open(name, 'wb') as f:\n"
        "            f.write(bytes(2 << 20))\n"
        "    except OSError as e:\n"
        "        print(errors.no_space(e, given))\n"
        "        os.remove(name)\n"
    )
    p = _in_namespace(f"{sys.executable} -c {_quote(code)}", tmp_path)
    small = tmp_path / "small"
    lines = p.stdout.splitlines()
    assert len(lines) == 2, p.stdout + p.stderr
    for line, name in zip(lines, ("absolute.bin", "relative.bin"), strict=True):
        assert line.startswith(f"no space left on the filesystem mounted at {small} (") and f"while writing {small / name}; free" in line, line
        assert "MiB free of 1.0 MiB" in line


def test_the_disk_check_refuses_a_filesystem_too_small(tmp_path):
    cfg_path = write_config(tmp_path, handoff={"dir": str(tmp_path / "small" / "handoff")})
    code = (
        "from pathlib import Path\n"
        "from stages import checks\n"
        "from stages.config import load_config\n"
        "from stages.errors import DiskFull\n"
        f"cfg = load_config({str(cfg_path)!r})\n"
        "try:\n"
        f"    checks.disk(cfg, Path({str(tmp_path / 'run')!r}))\n"
        "except DiskFull as e:\n"
        "    print(e)\n"
    )
    p = _in_namespace(f"{sys.executable} -c {_quote(code)}", tmp_path)
    small = tmp_path / "small"
    refusal = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert refusal.startswith(f"the export and the bundle will need about 2.3 MiB on the filesystem mounted at {small} (handoff.dir "
                              f"{small / 'handoff'}), which has 1.0 MiB free of 1.0 MiB: bundle copy of the Q4_K_M GGUF"), p.stdout + p.stderr
    assert "adapter" not in refusal  # the adapter's copy is left out where it does not fit: it stops no run


def _quote(code: str) -> str:
    import shlex

    return shlex.quote(code)


def test_a_missing_package_is_an_install_problem_not_a_bug():
    e = ModuleNotFoundError("No module named 'llama_cpp'", name="llama_cpp")
    user = errors.as_user_error(e)
    assert isinstance(user, errors.MissingPackage) and "llama-cpp-python" in str(user) and "bash scripts/install.sh" in str(user)
    assert errors.as_user_error(ModuleNotFoundError("No module named 'yaml'", name="yaml")) is None  # anything else stays a bug


def test_the_vocabulary_rows_are_read_where_a_multimodal_checkpoint_keeps_them(tmp_path):
    import json

    from stages.model.directory import vocab_rows

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {"vocab_size": 262_208}}))
    assert vocab_rows(tmp_path) == 262_208
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 128_256}))
    assert vocab_rows(tmp_path) == 128_256
