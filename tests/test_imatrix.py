"""export.imatrix: an importance matrix from the run's training data, both files measured, the better one kept."""

from __future__ import annotations

import hashlib
import json
import subprocess

import numpy as np
import pytest

from stages import export, handoff
from stages.config import load_config
from stages.export import imatrix, llamacpp
from tests.conftest import REPO, write_config

pytestmark = pytest.mark.xdist_group("imatrix")  # one worker builds the module's export once
BASE = REPO / "assets" / "tiny-llama"  # exported as is: the question here is the quantization, not the fine-tune


@pytest.fixture(scope="module")
def auto(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("imatrix-auto")
    cfg = load_config(write_config(tmp, export={"quant_types": ["Q4_K_M", "Q5_K_S"], "imatrix": "auto"}))
    return cfg, export.run(cfg, BASE, tmp / "export"), tmp / "export"


def test_auto_measures_both_files_per_type_and_keeps_the_lower_kl(auto):
    _cfg, ex, out = auto
    info = ex.imatrix
    assert set(info["choices"]) == {"Q4_K_M", "Q5_K_S"}
    for f in ex.files:
        c = info["choices"][f.quant]
        kept, other = ("imatrix", "plain") if f.imatrix else ("plain", "imatrix")
        assert c["kept"] == kept and c[kept]["mean_kl"] <= c[other]["mean_kl"]
        assert f.path == out / f"model-{f.quant}.gguf" and f.path.is_file()
        fid = next(x for x in ex.fidelity if x.quant == f.quant)
        assert fid.file == f.path.name and fid.mean_kl == c[kept]["mean_kl"]  # the gate judged the kept file
    assert not list(out.glob("*.imatrix.gguf")) and not list(out.glob("*.partial"))  # the other variant is gone
    # on the tiny model the run's own imatrix lowers KL for both types (plain 0.0217 -> 0.0185, 0.0131 -> 0.0100)
    assert all(c["kept"] == "imatrix" for c in info["choices"].values()), info["choices"]
    assert json.loads((out / "export_result.json").read_text())["imatrix"]["choices"] == info["choices"]


def test_the_imatrix_file_is_llamas_format_and_covers_every_quantized_matrix(auto):
    cfg, ex, out = auto
    imat = imatrix.load(out / "imatrix.gguf")
    base = llamacpp.read_gguf(ex.base_gguf)
    matrices = {n for n, shape in base["tensor_shapes"].items() if len(shape) == 2 and n != "token_embd.weight"}
    assert set(imat.sums) == matrices  # every linear layer, lm_head (output.weight) included
    for name, sums in imat.sums.items():
        assert sums.shape == (base["tensor_shapes"][name][0],) and (sums > 0).all()  # one value per input column
        assert imat.counts[name] == ex.imatrix["tokens"] >= cfg.export.imatrix_tokens
    assert imat.chunks == ex.imatrix["chunks"] and "translate_train.jsonl" in ex.imatrix["dataset"]
    from gguf import GGUFReader

    fields = GGUFReader(str(out / "imatrix.gguf")).fields
    assert fields["general.type"].contents() == "imatrix" and fields["imatrix.chunk_size"].contents() == imatrix.CHUNK


def test_calibration_never_uses_the_held_out_texts(tmp_path):
    from stages import data
    from stages.model.load import load_tokenizer

    cfg = load_config(write_config(tmp_path, data={"eval_file": None, "eval_split": None}, smoke={"check": "stops"}))
    tok = load_tokenizer(cfg.model)
    ids, _ = imatrix.calibration_ids(cfg, tok, 4000)
    held = {tuple(tok(t, add_special_tokens=False)["input_ids"]) for t in data.held_out_texts(cfg, tok, cfg.export.fidelity.samples)}
    assert ids and not held & {tuple(x) for x in ids}  # without eval data fidelity measures on the first training samples: not these
    assert sum(map(len, ids)) >= 4000


def test_an_imatrix_that_hurts_is_measured_and_the_plain_file_kept(auto, tmp_path):
    _cfg, _ex, out = auto
    good = imatrix.load(out / "imatrix.gguf")
    rng = np.random.default_rng(0)
    # importance on a few random columns only: the quantizer spends its precision where the model does not look
    bad = imatrix.Imatrix({n: np.where(rng.random(s.shape) < 0.02, 1e6, 1e-6).astype(np.float32) for n, s in good.sums.items()},
                          dict(good.counts), good.tokens, good.chunks, "adversarial")
    path = bad.write(tmp_path / "bad.gguf")
    cfg = load_config(write_config(tmp_path, export={"quant_types": ["Q4_K_M"], "imatrix": str(path)}))
    ex = export.run(cfg, BASE, tmp_path / "export")
    c = ex.imatrix["choices"]["Q4_K_M"]
    assert c["kept"] == "plain" and c["imatrix"]["mean_kl"] > c["plain"]["mean_kl"], c
    assert not ex.files[0].imatrix
    assert (tmp_path / "export" / "imatrix.gguf").read_bytes() == path.read_bytes()  # the given file, handed on as it is


def test_off_quantizes_once_and_a_missing_file_is_named(tmp_path):
    cfg = load_config(write_config(tmp_path, export={"quant_types": ["Q4_K_M"], "imatrix": "off"}))
    ex = export.run(cfg, BASE, tmp_path / "export")
    assert ex.imatrix is None and not (tmp_path / "export" / "imatrix.gguf").exists() and not ex.files[0].imatrix
    cfg = load_config(write_config(tmp_path, export={"quant_types": ["Q4_K_M"], "imatrix": str(tmp_path / "none.gguf")}))
    with pytest.raises(imatrix.ImatrixError, match=r"export.imatrix names .*none.gguf, which is not there"):
        export.run(cfg, BASE, tmp_path / "export2")


def test_the_bundle_holds_the_imatrix_checksummed_and_the_card_both_figures(auto, tmp_path):
    cfg, ex, out = auto
    info = {**ex.imatrix, "file": "imatrix.gguf"}
    b = handoff.run(cfg, "v1", [(f.quant, f.path) for f in ex.files], tmp_path / "stage", adapter_dir=tmp_path, data_fingerprint="f" * 64,
                    smoke={}, memory={}, fidelity=[vars(f) for f in ex.fidelity], extra={"imatrix": info},
                    extra_files=[out / "imatrix.gguf"])
    sums = dict(reversed(line.split()) for line in (b.bundle_dir / "SHA256SUMS").read_text().splitlines())
    assert sums["imatrix.gguf"] == hashlib.sha256((out / "imatrix.gguf").read_bytes()).hexdigest()
    subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=b.bundle_dir, check=True, capture_output=True)
    card = (b.bundle_dir / "README.md").read_text()
    assert "## Importance matrix" in card and "llama-quantize --imatrix imatrix.gguf" in card
    q4 = ex.imatrix["choices"]["Q4_K_M"]
    assert f"| Q4_K_M | {q4['kept']} | {q4['plain']['mean_kl']} | {q4['imatrix']['mean_kl']} |" in card
    assert "imatrix.gguf" not in (b.bundle_dir / "Modelfile").read_text()  # the Modelfile names GGUF models only


def test_yaml_off_is_off(tmp_path):
    path = write_config(tmp_path)
    path.write_text(path.read_text().replace("export:\n", "export:\n  imatrix: off\n", 1))
    assert load_config(path).export.imatrix == "off"
    assert load_config(write_config(tmp_path)).export.imatrix == "auto"


def test_a_moe_imatrix_has_a_row_per_expert_from_the_tokens_routed_to_it(tmp_path):
    """The routed experts, most of a MoE's weights, were outside the matrix (only nn.Linear layers were hooked): llama.cpp
    quantized every `ffn_*_exps` tensor without it. Now each expert gets the row of its own routed tokens, as
    llama-imatrix collects them, and the export says which experts no calibration token reached."""
    from stages.export import stage as export_stage
    from tests.test_families import _config, tiny_model

    model_dir, asset = tiny_model("qwen3_moe", tmp_path / "model")   # 4 experts, 2 per token, 2 layers
    cfg = _config(tmp_path, model_dir, asset)
    cfg = cfg.model_copy(update={"export": cfg.export.model_copy(update={"imatrix": "auto"})})
    ex = export_stage.run(cfg, model_dir, tmp_path / "export")
    base = llamacpp.read_gguf(ex.base_gguf)
    experts = {n: [int(x) for x in s] for n, s in base["tensor_shapes"].items() if "_exps." in n}
    assert len(experts) == 6, sorted(experts)   # gate, up and down of both layers
    imat = imatrix.load(tmp_path / "export" / "imatrix.gguf")
    for name, (width, _, n_experts) in experts.items():
        assert imat.sums[name].shape == (n_experts, width) and imat.counts[name].shape == (n_experts,)
        assert imat.counts[name].sum() == 2 * imat.tokens   # every calibration token's 2 routed slots, once
    # a layer's gate and up projections read the same inputs; the down projection its experts' gated activations
    assert np.array_equal(imat.sums["blk.0.ffn_gate_exps.weight"], imat.sums["blk.0.ffn_up_exps.weight"])
    assert imat.sums["blk.0.ffn_down_exps.weight"].shape[1] == 128
    info = ex.imatrix["experts"]
    assert info["of"] == 6 * 4 and info["covered"] == sum(int((imat.counts[n] > 0).sum()) for n in experts)
    assert info["without_data"] == imat.experts_without_data
    from stages.export import modelcard

    assert f"{info['covered']} of 24 expert matrices got some" in "\n".join(modelcard.imatrix_lines(ex.imatrix))
    # an expert no token reached weighs its columns evenly
    missing = imatrix.Imatrix({"e": np.ones((2, 3), np.float32)}, {"e": np.array([5, 0])}, 5, 1, "test")
    assert missing.experts_without_data == {"e": [1]} and np.allclose(missing.means()["e"], [[0.2] * 3, [1.0] * 3])
    # llama.cpp found a matrix of the right size for every expert tensor; it names what it found none for (the embedding,
    # which it never quantizes with one), so its log is the quantization that read the matrix
    logs = " ".join(p.read_text() for p in (tmp_path / "export").glob("*.quantize.log"))
    assert "did not find weights for token_embd.weight" in logs
    assert "did not find weights for blk." not in logs and "is different from tensor size" not in logs
