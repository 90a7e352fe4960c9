"""Convert the merged model to GGUF with llama.cpp's own converter, then quantize it.

    python -m stages.export --config configs/default.yaml --merged artifacts/runs/<id>/merge/model --out DIR

merged safetensors --convert_hf_to_gguf.py--> model-f16.gguf --llama_model_quantize--> model-Q4_K_M.gguf, model-Q5_K_S.gguf

Each quantized file is read back with gguf-py and checked: architecture, general.file_type,
and every weight matrix in a type its name promises (Q4_K_M: Q4_K with some Q5_K/Q6_K;
Q5_K_S: Q5_K with Q6_K for the output). K-quants work on 256-value super-blocks; a matrix
whose rows are not a multiple of 256 silently falls back to another type, which this
check reports by tensor name. Vocabulary size, BOS/EOS ids and the chat template must
equal the HF tokenizer's, or the model will not stop or will be prompted wrongly.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from stages import data, errors, fidelity, llamacpp, memory
from stages.config import QUANT_FTYPES, RunConfig, load_config
from stages.errors import MissingInput
from stages.llamacpp_process import LlamaProcess
from stages.memory import MemoryReport
from stages.modelio import load_tokenizer

# Types a K-quant mix may use for weight matrices (llama.cpp's llama_tensor_get_type).
ALLOWED = {
    "Q4_K_M": {"Q4_K", "Q5_K", "Q6_K"},
    "Q4_K_S": {"Q4_K", "Q5_K", "Q6_K"},
    "Q5_K_S": {"Q5_K", "Q6_K"},
    "Q5_K_M": {"Q5_K", "Q6_K"},
    "Q6_K": {"Q6_K"},
    "Q8_0": {"Q8_0"},
}
MAIN_TYPE = {"Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0"}


@dataclass
class GgufFile:
    quant: str
    path: Path
    ftype: int
    size_mib: float
    tensor_types: dict[str, int]   # type -> number of tensors


@dataclass
class ExportResult:
    base_gguf: Path                # the unquantized conversion (f16 by default)
    files: list[GgufFile]          # the quantized files, in config order
    llama_cpp_version: str
    memory: MemoryReport | None
    skipped: bool = False
    checks: dict = field(default_factory=dict)
    fidelity: list = field(default_factory=list)  # fidelity.Fidelity per file, the unquantized one first
    seconds: dict = field(default_factory=dict)   # wall time of each step: convert, checks, each quant, fidelity


def run(cfg: RunConfig, merged_dir: Path, out_dir: Path) -> ExportResult:
    """Convert <merged_dir> to GGUF and quantize to every `export.quant_types` in <out_dir>."""
    out_dir, merged_dir = Path(out_dir), Path(merged_dir)
    done = out_dir / "export_result.json"
    if done.is_file():
        print(f"export: GGUF files already in {out_dir}; skipping")
        return _load(done)
    if not (merged_dir / "config.json").is_file():
        raise MissingInput(f"{merged_dir.resolve()} is not a model directory; point --merged at the merge stage's `model` directory")
    converter = llamacpp.converter_dir()
    tokenizer = load_tokenizer(cfg.model)
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
        convert(meter, converter, merged_dir, base, cfg.export.outtype)
        lap(f"convert_{cfg.export.outtype}")
        rows = json.loads((merged_dir / "config.json").read_text()).get("vocab_size")
        checks = {"base": check_tokenizer(llamacpp.read_gguf(base), tokenizer, rows)}
        checks["tokenization"] = check_tokenization(base, tokenizer, data.held_out_texts(cfg, tokenizer, 20))
        lap("tokenizer_checks")
        files = []
        for quant in cfg.export.quant_types:
            path = out_dir / f"model-{quant}.gguf"
            tmp = path.with_suffix(".gguf.partial")
            errors.inject("export-quantize", tmp)
            llamacpp.quantize(base, tmp, QUANT_FTYPES[quant])
            info = llamacpp.read_gguf(tmp)
            check_quant_types(info, quant, tmp)
            checks[quant] = check_tokenizer(info, tokenizer, rows)
            tmp.rename(path)
            files.append(GgufFile(quant, path, QUANT_FTYPES[quant], round(path.stat().st_size / 2**20, 3), llamacpp.type_counts(info)))
            print(f"export: {path.name} {files[-1].size_mib:.1f} MiB {files[-1].tensor_types}")
            lap(f"quantize_{quant}")
        drift = check_fidelity(cfg, tokenizer, merged_dir, [(cfg.export.outtype, base)] + [(f.quant, f.path) for f in files])
        lap("fidelity")
        meter.extra["fidelity"] = [memory.jsonable(f) for f in drift]
        meter.extra["seconds"] = seconds
    result = ExportResult(base, files, llamacpp.runtime_version(), meter.report, checks=checks, fidelity=drift, seconds=seconds)
    done.write_text(json.dumps(memory.jsonable(result), indent=2))
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
            raise errors.no_space(e) from e
        raise


# transformers 5 writes rope_type "default" for plain RoPE; the converter knows only the scaled types by name,
# warns, and writes plain RoPE (rope_theta as the frequency base), which is what "default" means.
CONVERTER_HARMLESS = ("Unknown RoPE type: default",)


def convert(meter: memory.track, converter: Path, merged_dir: Path, dst: Path, outtype: str) -> None:
    """convert_hf_to_gguf.py in a subprocess (its peak RSS is measured as the stage's child)."""
    tmp = dst.with_suffix(".gguf.partial")
    cmd = [sys.executable, str(converter / "convert_hf_to_gguf.py"), str(merged_dir), "--outfile", str(tmp), "--outtype", outtype]
    proc = meter.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = dst.with_suffix(".convert.log")  # a line per tensor: the file keeps it, the run's log gets what matters
    log.write_text(proc.stdout or "")
    notable = [line for line in (proc.stdout or "").splitlines()
               if ("WARNING" in line or "ERROR" in line) and not any(h in line for h in CONVERTER_HARMLESS)]
    print(f"export: {merged_dir.name} -> {dst.name} (converter log: {log})", *notable, sep="\n")
    if proc.returncode != 0 or not tmp.is_file():
        print(*(proc.stdout or "").splitlines()[-40:], sep="\n")
        tmp.unlink(missing_ok=True)
        unsupported = re.search(r"Model (\S+) is not supported", proc.stdout or "")
        if unsupported:
            raise llamacpp.UnsupportedArchitecture(
                f"llama.cpp's converter (llama-cpp-python {llamacpp.runtime_version()}) does not support the architecture "
                f"{unsupported.group(1)} of {merged_dir}; nothing was exported. Use a base model of a supported family "
                "(Llama, Qwen2, Mistral, Gemma, Phi, ...) or a llama-cpp-python release whose converter lists it"
            )
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {proc.returncode}) on {merged_dir}; the end of its output is above, "
                           f"all of it in {log}")
    tmp.rename(dst)


def check_fidelity(cfg: RunConfig, tokenizer, merged_dir: Path, ggufs: list[tuple[str, Path]]) -> list[fidelity.Fidelity]:
    """Every GGUF against the merged model on held-out texts; FidelityError on a breach."""
    sequences = fidelity.held_out_ids(cfg, tokenizer, cfg.export.fidelity.samples)
    ref = fidelity.reference(merged_dir, sequences)
    results = [fidelity.measure(q, p, sequences, ref, cfg.export.fidelity) for q, p in ggufs]
    for r in results:
        print(f"export: fidelity {r.file}: mean KL {r.mean_kl:.5f}, top-1 {r.top1_agreement:.1%} over {r.positions} positions"
              f"{'' if r.passed else '  FAILED'}")
    fidelity.gate(results)
    return results


def check_quant_types(info: dict, quant: str, path: Path) -> None:
    """Every weight matrix in a type `quant` allows, and the main type in the majority."""
    ftype = info["fields"].get("general.file_type")
    if ftype != QUANT_FTYPES[quant]:
        raise ValueError(f"{path.name}: general.file_type is {ftype}, expected {QUANT_FTYPES[quant]} ({quant})")
    matrices = {n: t for n, t in info["tensor_types"].items() if len(info["tensor_shapes"][n]) >= 2 and n != "token_embd.weight"}
    odd = {n: t for n, t in matrices.items() if t not in ALLOWED[quant]}
    if odd:
        rows = {n: info["tensor_shapes"][n][0] for n in odd}
        raise ValueError(
            f"{path.name}: {len(odd)} weight matrices are not in a {quant} type: "
            + ", ".join(f"{n}={t} (row {rows[n]})" for n, t in list(odd.items())[:8])
            + "; K-quants need rows that are a multiple of 256, so this model cannot be fully "
            f"{quant}-quantized; choose Q8_0 in export.quant_types or a model with such shapes"
        )
    main = sum(t == MAIN_TYPE[quant] for t in matrices.values())
    if main * 2 < len(matrices):
        raise ValueError(f"{path.name}: only {main}/{len(matrices)} matrices are {MAIN_TYPE[quant]}; this is not a {quant} file")


def check_tokenizer(info: dict, tokenizer, model_vocab: int | None = None) -> dict:
    """Vocabulary, special ids and chat template as the HF tokenizer has them.

    The converter pads the GGUF vocabulary to the model's embedding rows (Qwen2-7B: 151,646
    tokens, 152,064 rows), so either size is right; anything else is not.
    """
    f = info["fields"]
    got = {
        "vocab_size": f.get("tokenizer.ggml.tokens", {}).get("array_len"),
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.get("tokenizer.ggml.eos_token_id"),
        "chat_template": f.get("tokenizer.chat_template"),
    }
    want = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "chat_template": tokenizer.chat_template,
    }
    if model_vocab and got["vocab_size"] == model_vocab:
        want["vocab_size"] = model_vocab
    bad = {k: (got[k], want[k]) for k in want if want[k] is not None and got[k] != want[k]}
    if bad:
        raise ValueError("GGUF tokenizer metadata differs from the HF tokenizer: " + "; ".join(
            f"{k}: gguf {str(g)[:80]!r} vs hf {str(w)[:80]!r}" for k, (g, w) in bad.items()))
    return {k: v for k, v in got.items() if k != "chat_template"} | {"chat_template_equal": True}


def check_tokenization(gguf_path: Path, tokenizer, texts: list[str]) -> dict:
    """The GGUF's tokenizer must produce the ids training used, text for text.

    A mismatch (typically a "▁" llama.cpp puts after special tokens that the HF tokenizer
    does not) makes every served prompt slightly foreign to the model.
    """
    with LlamaProcess(gguf_path.name) as vocab:
        vocab.call("load", str(gguf_path), vocab_only=True)
        for text, gg in zip(texts, vocab.call("tokenize", texts), strict=True):
            hf = tokenizer(text, add_special_tokens=False)["input_ids"]
            if hf != gg:
                i = next((k for k, (a, b) in enumerate(zip(hf, gg, strict=False)) if a != b), min(len(hf), len(gg)))
                raise ValueError(
                    f"{gguf_path.name} tokenizes differently from the HF tokenizer at token {i} of {text[:60]!r}: "
                    f"hf {tokenizer.convert_ids_to_tokens(hf[i:i + 3])} vs gguf {vocab.call('pieces', gg[i:i + 3])}; "
                    "for a SentencePiece Llama set \"legacy\": true in tokenizer_config.json (llama.cpp adds a space after "
                    "special tokens)"
                )
    return {"texts_compared": len(texts), "identical": True}


def _load(path: Path) -> ExportResult:
    d = json.loads(path.read_text())
    files = [GgufFile(**(f | {"path": Path(f["path"])})) for f in d["files"]]
    return ExportResult(Path(d["base_gguf"]), files, d["llama_cpp_version"], None, skipped=True, checks=d.get("checks", {}),
                        fidelity=[fidelity.Fidelity(**x) for x in d.get("fidelity", [])], seconds=d.get("seconds", {}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Convert a merged model to GGUF and quantize it (a stage of train-and-export).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--merged", type=Path, required=True, help="the merge stage's model directory")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    r = run(load_config(a.config), a.merged, a.out)
    for f in r.files:
        print(f"{f.quant}: {f.path} ({f.size_mib} MiB) {f.tensor_types}")


if __name__ == "__main__":
    import sys

    from stages.errors import run_cli

    sys.exit(run_cli(main, "export"))
