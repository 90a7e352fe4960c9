"""Convert the merged model to GGUF with llama.cpp's own converter, then quantize it.

    python -m stages.export --config configs/default.yaml --merged artifacts/runs/<id>/merge/model --out DIR

merged safetensors --convert_hf_to_gguf.py--> model-f16.gguf --llama_model_quantize--> model-Q4_K_M.gguf, model-Q5_K_S.gguf

Each quantized file is read back with gguf-py and checked: architecture, general.file_type,
and every tensor in the type llama.cpp's own rule gives it (stages/export/quant_types.py): the
mix's K-type, or, for a matrix whose rows are not a multiple of 256 (widths 576, 896,
960), the fallback llama.cpp picks (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0). Fallbacks
are counted per file in export_result.json, the model card and the hand-off manifest.
Vocabulary size, BOS/EOS ids and the chat template must equal the HF tokenizer's, and
the GGUF must tokenize held-out texts as HF does, or the model will not stop or will be
prompted wrongly.

The converter and the quantizer write a line per tensor: those go to model-*.convert.log
and model-*.quantize.log next to the GGUFs, and the run's log gets one line per file
(TAE_VERBOSE=1 prints every line too).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from stages import data, errors, inputs, memory, result_files
from stages.artifact import Artifact
from stages import quants
from stages.config import RunConfig
from stages.errors import MissingInput
from stages.export import convert, fidelity, imatrix, llamacpp, naming, quant_types, vocab
from stages.export.llamacpp_process import LlamaProcess
from stages.memory import MemoryReport
from stages.model.directory import resolve_model_dir, vocab_rows
from stages.model.load import load_tokenizer

IMATRIX_FILE = "imatrix.gguf"
NAMES_FILE = "gguf-names.json"  # the converter's --metadata override (stages/export/naming.py), kept with the run


@dataclass
class GgufFile:
    quant: str
    path: Path
    ftype: int
    size_mib: float
    tensor_types: dict[str, int]   # type -> number of tensors
    n_fallback: int = 0            # tensors in llama.cpp's fallback type: their rows are not a multiple of the K-type's 256
    fallbacks: dict[str, int] = field(default_factory=dict)  # "Q4_K->Q5_0" -> tensors
    imatrix: bool = False          # quantized with the run's importance matrix (export.imatrix)


@dataclass
class ExportResult:
    base_gguf: Path                # the unquantized conversion (f16 by default)
    files: list[GgufFile]          # the quantized files, in config order
    llama_cpp_version: str
    memory: MemoryReport | None
    skipped: bool = False
    checks: dict = field(default_factory=dict)
    fidelity: list[fidelity.Fidelity] = field(default_factory=list)  # per file, the unquantized one first
    seconds: dict = field(default_factory=dict)   # wall time of each step: convert, checks, each quant, fidelity
    imatrix: dict | None = None                   # export.imatrix: the file, what it was computed on, per type what was kept

    def outputs(self) -> list[Path]:
        """The files this result stands for: the export is done while they are there."""
        return [f.path for f in self.files]

    def gguf_files(self) -> list[tuple[str, Path]]:
        """The quantized files as (type, path): what smoke and the hand-off take."""
        return [(f.quant, f.path) for f in self.files]

    def fidelity_table(self) -> list[dict]:
        """Each GGUF's fidelity to the merged model as plain rows, the unquantized one first."""
        return [memory.jsonable(f) for f in self.fidelity]

    def artifacts(self) -> list[Artifact]:
        return [Artifact("fidelity", "Each GGUF vs the merged model on held-out texts (mean KL, top-1)", table=self.fidelity_table())]


def run(cfg: RunConfig, merged_dir: Path, out_dir: Path) -> ExportResult:
    """Convert <merged_dir> to GGUF and quantize to every `export.quant_types` in <out_dir>."""
    out_dir, merged_dir = Path(out_dir), Path(merged_dir)
    if (done := result_files.load_if_done(out_dir, "export", ExportResult)) is not None:
        print(f"export: GGUF files already in {out_dir}; skipping")
        return done
    if not (merged_dir / "config.json").is_file():
        raise MissingInput(f"{merged_dir.resolve()} is not a model directory; point --merged at the merge stage's `model` directory")
    converter = llamacpp.converter_dir()
    tokenizer = load_tokenizer(cfg.model)
    model_dir = resolve_model_dir(cfg.model.name_or_path)  # the user's files: what a tokenizer message names
    out_dir.mkdir(parents=True, exist_ok=True)

    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = round(now - clock, 2)
        clock = now
        print(f"export: {name} took {seconds[name]:.1f} s", flush=True)  # in the log even if a later step dies

    with memory.track("export", out_dir) as meter, _no_partial_files(out_dir):
        base = out_dir / f"model-{cfg.export.outtype}.gguf"
        names = naming.override(cfg.handoff.model_name, cfg.model.name_or_path, model_dir, tokenizer)
        (out_dir / NAMES_FILE).write_text(json.dumps(names, indent=2))
        converted = convert.convert(meter, converter, merged_dir, base, cfg.export.outtype, source=model_dir,
                                    metadata=out_dir / NAMES_FILE)
        lap(f"convert_{cfg.export.outtype}")
        rows = vocab_rows(merged_dir)
        info = llamacpp.read_gguf(base)
        checks = {"base": vocab.check_metadata(info, tokenizer, rows, base.name, model_dir),
                  "names": naming.check(info, names, base.name)}
        print("export: the GGUFs name themselves: " + ", ".join(f"{k} {v!r}" for k, v in checks["names"].items()))
        texts = data.held_out_texts(cfg, tokenizer, 20)
        if converted.pre_tokenizer:  # named from tokenizer.json, not recognized by the converter: prove it on its probe text
            texts.append(convert.probe_text(converter))
            checks["pre_tokenizer"] = {"name": converted.pre_tokenizer, "from": "tokenizer.json", "probe_text_compared": True}
        checks["tokenization"] = vocab.check_tokenization(base, tokenizer, texts, base.name, model_dir)
        lap("tokenizer_checks")
        sequences = fidelity.held_out_ids(cfg, tokenizer, cfg.export.fidelity.samples)
        imat, reference = from_merged_model(cfg, tokenizer, merged_dir, base, out_dir, sequences)
        experts = None if imat is None else expert_coverage(imat)
        if imat is not None:
            print(imatrix_summary(imat, experts))
        lap("merged_model" if imat is None else "imatrix")
        means = imat.means() if imat is not None else None
        made: list[GgufFile] = []  # every quantized file: plain, and with the imatrix where the type reads one
        for quant in cfg.export.quant_types:
            for with_imatrix in (None, means) if means is not None and quants.TYPES[quant].imatrix else (None,):
                made.append(quantize_one(quant, base, out_dir, tokenizer, rows, checks, with_imatrix, model_dir))
            lap(f"quantize_{quant}")
        measured = measure_fidelity(cfg, [(cfg.export.outtype, base)] + [(f.quant, f.path) for f in made], sequences, reference)
        files, drift, choices = keep_better(made, measured[0], measured[1:])
        fidelity.gate(drift)
        lap("fidelity")
        meter.extra["fidelity"] = [memory.jsonable(f) for f in drift]
        meter.extra["seconds"] = seconds
    imatrix_info = None if imat is None else {
        "file": str(out_dir / IMATRIX_FILE), "tokens": imat.tokens, "chunks": imat.chunks, "dataset": imat.dataset,
        "tensors": len(imat.sums), "not_covered": imat.skipped, "seconds": imat.seconds, "choices": choices,
        "experts": experts,
        # the types whose kept file was quantized with it: the bundle ships imatrix.gguf only if there is one
        "used_by": [q for q, c in choices.items() if c["kept"] == "imatrix"]}
    result = ExportResult(base, files, llamacpp.runtime_version(), meter.report, checks=checks, fidelity=drift, seconds=seconds,
                          imatrix=imatrix_info)
    result_files.save(out_dir, "export", result)
    return result


@contextlib.contextmanager
def _no_partial_files(out_dir: Path):
    """Whatever stops the export (a full disk, a failed check, Ctrl-C), no half-written GGUF stays behind;
    a full disk is said as such."""
    try:
        yield
    except BaseException as e:
        for p in out_dir.glob("*.partial"):
            p.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC and not isinstance(e, errors.DiskFull):
            raise errors.no_space(e, out_dir) from e  # a write() names no file: the export directory is what was written
        raise


def measure_fidelity(cfg: RunConfig, ggufs: list[tuple[str, Path]], sequences: list[list[int]], reference: list) -> list[fidelity.Fidelity]:
    """Every GGUF against the merged model's `reference` log-probabilities on the held-out `sequences`; fidelity.gate
    says which breach export.fidelity."""
    with LlamaProcess("fidelity") as llm:  # one llama.cpp process for every file: a start-up each cost ~1 s on 2 cores
        results = [fidelity.measure(q, p, sequences, reference, cfg.export.fidelity, llm) for q, p in ggufs]
    for r in results:
        print(f"export: fidelity {r.file}: mean KL {r.mean_kl:.5f}, top-1 {r.top1_agreement:.1%} over {r.positions} positions"
              f"{'' if r.passed else '  FAILED'}")
    return results


def from_merged_model(cfg: RunConfig, tokenizer, merged_dir: Path, base: Path, out_dir: Path,
                      sequences: list[list[int]]) -> tuple[imatrix.Imatrix | None, list]:
    """What export needs of the merged HF model, from one load of it: its importance matrix (export.imatrix; None when
    off) and its next-token log-probabilities on `sequences`, the fidelity gate's reference. The model is freed
    before llama.cpp loads the GGUFs (onto the same GPU)."""
    model = fidelity.load_merged(merged_dir)
    try:
        return importance_matrix(cfg, tokenizer, model, base, out_dir), fidelity.log_probs(model, sequences)
    finally:
        del model
        memory.free_gpu()


def importance_matrix(cfg: RunConfig, tokenizer, model, base: Path, out_dir: Path) -> imatrix.Imatrix | None:
    """export.imatrix: the importance matrix (computed on the merged `model` from the training data, or read from the
    given file), written to <out_dir>/imatrix.gguf; None when off."""
    if cfg.export.imatrix == "off":
        return None
    tmp = out_dir / f"{IMATRIX_FILE}.partial"
    if cfg.export.imatrix != "auto":
        imat = imatrix.load(Path(cfg.export.imatrix))
        used = imatrix.check_against(imat, imatrix.widths_in_gguf(llamacpp.read_gguf(base)), Path(cfg.export.imatrix), base.name)
        imat.skipped = sorted(set(imat.sums) - set(used))  # names this model does not have: not handed to the quantizer
        imat.sums = {n: imat.sums[n] for n in used}
        imat.counts = {n: imat.counts[n] for n in used}
        shutil.copyfile(cfg.export.imatrix, tmp)  # handed on as given
    else:
        imat = imatrix.from_run(cfg, tokenizer, model, llamacpp.read_gguf(base))
        imat.write(tmp)
    tmp.rename(out_dir / IMATRIX_FILE)
    return imat


def imatrix_summary(imat: imatrix.Imatrix, experts: dict | None) -> str:
    """One line for the run's log: what the importance matrix covers (`experts`: expert_coverage's figures)."""
    return (f"export: importance matrix of {len(imat.sums)} tensors from {imat.dataset} in {imat.seconds:.1f} s -> {IMATRIX_FILE}"
            + (f" ({len(imat.skipped)} linear layers have no GGUF tensor of their width: {', '.join(imat.skipped[:4])})" if imat.skipped else "")
            + (f"; routed experts: {experts['covered']} of {experts['of']} expert matrices got calibration tokens"
               + (f", none reached {', '.join(f'{n} {e}' for n, e in list(experts['without_data'].items())[:3])} (weighted evenly)"
                  if experts["without_data"] else "") if experts else ""))


def expert_coverage(imat: imatrix.Imatrix) -> dict | None:
    """How many experts' rows of the expert tensors the calibration reached, and which it did not; None without experts."""
    covered, total = imat.experts_covered()
    return {"covered": covered, "of": total, "without_data": imat.experts_without_data} if total else None


def quantize_one(quant: str, base: Path, out_dir: Path, tokenizer, rows: int | None, checks: dict,
                 means: dict | None, model_dir: Path) -> GgufFile:
    """One quantized file (with the importance matrix `means`, if given), checked (types, tokenizer) before it gets its name."""
    path = out_dir / (f"model-{quant}.gguf" if means is None else f"model-{quant}.imatrix.gguf")
    tmp = path.with_suffix(".gguf.partial")
    errors.inject("export-quantize", tmp)
    log = path.with_suffix(".quantize.log")
    log.write_text(llamacpp.quantize(base, tmp, quants.TYPES[quant].ftype, imatrix=means))
    if llamacpp.EXPORT_VERBOSE:
        print(log.read_text())
    info = llamacpp.read_gguf(tmp)
    fallbacks = check_quant_types(info, quant, tmp)
    checks[quant if means is None else f"{quant}-imatrix"] = vocab.check_metadata(info, tokenizer, rows, path.name, model_dir)
    naming.check(info, checks["names"], path.name)  # the quantizer copies every key: proven per file
    tmp.rename(path)
    f = GgufFile(quant, path, quants.TYPES[quant].ftype, round(path.stat().st_size / 2**20, 3), llamacpp.type_counts(info),
                 sum(fallbacks.values()), fallbacks, imatrix=means is not None)
    print(quant_summary(f, log))
    return f


def keep_better(made: list[GgufFile], base_fid: fidelity.Fidelity, measured: list[fidelity.Fidelity]):
    """Per type, the file with the lower mean KL to the merged model (plain on a tie); the other is deleted and the kept
    one is named model-<type>.gguf. Returns (files, fidelity of the base and the kept files, per-type figures)."""
    files, drift, choices = [], [base_fid], {}
    by_quant: dict[str, list[tuple[GgufFile, fidelity.Fidelity]]] = {}
    for f, fid in zip(made, measured, strict=True):
        by_quant.setdefault(f.quant, []).append((f, fid))
    for quant, pair in by_quant.items():
        kept, kept_fid = min(pair, key=lambda x: (x[1].mean_kl, x[0].imatrix))
        if len(pair) > 1:
            choices[quant] = {"kept": "imatrix" if kept.imatrix else "plain",
                              **{("imatrix" if f.imatrix else "plain"): {"mean_kl": fid.mean_kl, "p99_kl": fid.p99_kl,
                                                                          "top1_agreement": fid.top1_agreement, "size_mib": f.size_mib}
                                 for f, fid in pair}}
            print(f"export: {quant}: kept the {choices[quant]['kept']} file (mean KL plain {choices[quant]['plain']['mean_kl']:.5f}, "
                  f"imatrix {choices[quant]['imatrix']['mean_kl']:.5f})")
        for f, _fid in pair:
            if f is not kept:
                f.path.unlink()
        final = f.path.parent / f"model-{quant}.gguf"
        if kept.path != final:
            kept.path.rename(final)
            kept.path.with_suffix(".quantize.log").rename(final.with_suffix(".quantize.log"))
            kept.path = final
            kept_fid.file = final.name
        files.append(kept)
        drift.append(kept_fid)
    return files, drift, choices


def check_quant_types(info: dict, quant: str, path: Path) -> dict[str, int]:
    """Every tensor llama.cpp quantizes in the type its `quant` rule gives it (the K-type, an upgrade the mix makes,
    or the fallback for rows that are not a multiple of 256); returns the fallbacks, "Q4_K->Q5_0" -> tensors."""
    ftype = info["fields"].get("general.file_type")
    if ftype != quants.TYPES[quant].ftype:
        raise ValueError(f"{path.name}: general.file_type is {ftype}, expected {quants.TYPES[quant].ftype} ({quant})")
    expected = quant_types.expected(info, quant)
    wrong = {n: c for n, c in expected.items() if info["tensor_types"][n] != c.type}
    if wrong:
        def why(c: quant_types.Choice) -> str:
            return f"{c.rule} falls back: row {c.row} is not a multiple of {quant_types.BLOCK[c.rule]}" if c.fallback else f"row {c.row}"

        raise ValueError(
            f"{path.name}: {len(wrong)} of {len(expected)} tensors are not in the type llama.cpp's {quant} rule gives them: "
            + ", ".join(f"{n} is {info['tensor_types'][n]}, expected {c.type} ({why(c)})" for n, c in list(wrong.items())[:8])
            + f"; the file is not what llama-cpp-python {llamacpp.runtime_version()} writes for {quant}. If llama-cpp-python was "
            "upgraded, port its src/llama-quant.cpp type rule into stages/export/quant_types.py; otherwise re-export"
        )
    return quant_types.fallbacks(expected)


def quant_summary(f: GgufFile, log: Path) -> str:
    """One line for the run's log per quantized file: types, fallbacks (counted as llama.cpp's own warning counts
    them), and where the per-tensor lines are."""
    types = ", ".join(f"{t} {n}" for t, n in f.tensor_types.items())
    fell = (f"{f.n_fallback} of {sum(f.tensor_types.values())} tensors fell back (rows not a multiple of 256): "
            + ", ".join(f"{k} {n}" for k, n in f.fallbacks.items())) if f.n_fallback else "no fallbacks"
    return f"export: {f.path.name} {f.size_mib:.1f} MiB: {types}; {fell}; per-tensor log {log.name}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Convert a merged model to GGUF and quantize it (a stage of train-and-export).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--merged", type=Path, required=True, help="the merge stage's model directory")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    r = run(inputs.load(a.config), a.merged, a.out)
    for f in r.files:
        print(f"{f.quant}: {f.path} ({f.size_mib} MiB) {f.tensor_types}, {f.n_fallback} fallbacks {f.fallbacks}")
