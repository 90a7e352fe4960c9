"""llama.cpp's convert_hf_to_gguf.py on a merged model, in a subprocess: a summary line in the run's log, all of it in a file.

    convert(meter, converter_dir, merged_dir, dst, "f16") -> Converted(pre_tokenizer=None | "smollm", ...)

BPE pre-tokenizers. For a byte-level BPE tokenizer the converter must name the pre-tokenizer (the regex that splits
text before the merges) in the GGUF's tokenizer.ggml.pre. It recognizes it by the sha256 of the ids the tokenizer gives
a probe text (get_vocab_base_pre), a table of published tokenizers; one trained for the fine-tune, or newer than the
converter, stops it with "BPE pre-tokenizer was not recognized". When tokenizer.json's own pre_tokenizer is, field
for field, one that llama.cpp implements (PRE_TOKENIZERS), the converter runs with that name for exactly that case
(the `python -m stages.export.convert` launcher below); export then checks, on the converter's own probe text among
others, that the GGUF tokenizes exactly as the HF tokenizer does.
"""

from __future__ import annotations

import ast
import errno
import json
import os
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from stages import errors, memory
from stages.export import llamacpp

ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the `stages` package
MARK = "train-and-export: BPE pre-tokenizer not in the converter's table; tokenizer.json's pre_tokenizer is llama.cpp's"

# transformers 5 writes rope_type "default" for plain RoPE; the converter knows only the scaled types by name,
# warns, and writes plain RoPE (rope_theta as the frequency base), which is what "default" means.
CONVERTER_HARMLESS = ("Unknown RoPE type: default",)

# tokenizer.json pre_tokenizer -> llama.cpp's name for the same split (src/llama-vocab.cpp): GPT-2's byte-level regex,
# and StarCoder/SmolLM's (digits one by one first). trim_offsets changes offsets, never ids, so it is not compared.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
PRE_TOKENIZERS = {
    "gpt-2": _BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
}


@dataclass
class Converted:
    path: Path
    log: Path                         # the converter's whole output (a line per tensor)
    pre_tokenizer: str | None = None  # set when it came from tokenizer.json, not the converter's table


def convert(meter: memory.track, converter: Path, merged_dir: Path, dst: Path, outtype: str, *, source: Path | None = None,
            metadata: Path | None = None, stage: str = "export") -> Converted:
    """convert_hf_to_gguf.py in a subprocess (its peak RSS is measured as the stage's child). `source`: the user's model
    directory `merged_dir` was made from, named in a refusal (its files are the ones to change). `metadata`: a
    `--metadata` override file (stages/export/naming.py), its `general.license` applied too."""
    tmp = dst.with_suffix(".gguf.partial")
    cmd, env, pre = command(converter, merged_dir, tmp, "--outtype", outtype, *(("--metadata", str(metadata)) if metadata else ()))
    proc = meter.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = proc.stdout or ""
    log = dst.with_suffix(".convert.log")
    log.write_text(out)
    if llamacpp.EXPORT_VERBOSE:
        print(out)
    if proc.returncode != 0 or not tmp.is_file():
        print(*out.splitlines()[-40:], sep="\n")
        tmp.unlink(missing_ok=True)
        if "No space left on device" in out:  # the converter's OSError, in its own process: said as the full disk it is
            raise errors.no_space(OSError(errno.ENOSPC, "No space left on device", str(tmp)))
        last = next((line.strip() for line in reversed(out.splitlines()) if line.strip()), "")
        raise refusal(out, source or merged_dir) or RuntimeError(
            f"convert_hf_to_gguf.py failed (exit {proc.returncode}) on {merged_dir}: {last[:300]}; the end of its output is "
            f"above, all of it in {log}")
    tmp.rename(dst)
    used = pre if MARK in out else None
    # With the pre-tokenizer named from tokenizer.json (and proven on the probe text later), the converter's banner
    # about an unrecognised BPE pre-tokenizer is handled: the summary line says "(from tokenizer.json)" instead.
    handled = CONVERTER_HARMLESS + (("WARNING:hf-to-gguf:**",) if used else ())
    notable = [line for line in out.splitlines()
               if ("WARNING" in line or "ERROR" in line) and not any(h in line for h in handled)
               and line.strip() != "WARNING:hf-to-gguf:"]
    print(summary(merged_dir, llamacpp.read_gguf(dst), dst, log, used, stage), *notable, sep="\n")
    return Converted(dst, log, used)


def command(converter: Path, model_dir: Path, outfile: Path, *options: str,
            script: str = "convert_hf_to_gguf.py") -> tuple[list[str], dict | None, str | None]:
    """(argv, environment, pre-tokenizer named from tokenizer.json or None) of the converter's `script` on `model_dir`,
    through the `python -m stages.export.convert` launcher."""
    script = converter / script
    args = [str(model_dir), "--outfile", str(outfile), *options]
    pre = pre_tokenizer(model_dir)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return [sys.executable, "-P", "-m", "stages.export.convert", pre or "", str(script), *args], env, pre


def refusal(out: str, model_dir: Path) -> llamacpp.UnsupportedArchitecture | None:
    """What the converter's output says it cannot convert in `model_dir`, as a user error naming the file; None when it
    failed otherwise."""
    unsupported = re.search(r"Model (\S+) is not supported", out)
    if unsupported:
        return llamacpp.UnsupportedArchitecture(
            f"llama.cpp's converter (llama-cpp-python {llamacpp.runtime_version()}) does not support the architecture "
            f"{unsupported.group(1)} of {model_dir / 'config.json'}; nothing can be exported. Use a base model of a supported family "
            "(Llama, Qwen2, Mistral, Gemma, Phi, ...) or a llama-cpp-python release whose converter lists it"
        )
    if "BPE pre-tokenizer was not recognized" in out and MARK not in out:   # with MARK the launcher named it; it failed later
        return llamacpp.UnsupportedArchitecture(
            f"llama.cpp's converter (llama-cpp-python {llamacpp.runtime_version()}) does not know the BPE pre-tokenizer of "
            f"{model_dir / 'tokenizer.json'}, and its pre_tokenizer is none of {sorted(PRE_TOKENIZERS)}; nothing can be exported. "
            "Use a llama-cpp-python release whose converter lists the base model's tokenizer"
        )
    lines = [line for line in out.splitlines() if line.strip()]
    tail = lines[-1] if lines else ""
    if re.search(r"(tokenizer|vocab)", tail, re.I) and re.search(r"(Error|Exception)\b", tail):  # the converter's own words on the tokenizer
        return llamacpp.UnsupportedArchitecture(
            f"llama.cpp's converter (llama-cpp-python {llamacpp.runtime_version()}) cannot read the tokenizer of {model_dir} "
            f"({tail.strip()[:300]}); nothing can be exported. Give the tokenizer files the model was released with "
            "(tokenizer.json, or tokenizer.model for SentencePiece) beside config.json")
    return None


# What convert_hf_to_gguf.py does before its first line of work: its own directory first on sys.path, then its gguf-py
# (unless NO_LOCAL_GGUF), then `import gguf`. The converter itself imports torch; the probe does not need to.
PROBE = """import os, sys
sys.path[0] = sys.argv[1]
if 'NO_LOCAL_GGUF' not in os.environ:
    sys.path.insert(1, os.path.join(sys.argv[1], 'gguf-py'))
import gguf
print('gguf', getattr(gguf, '__file__', '?'))
"""


def probe(converter: Path) -> subprocess.Popen:
    """A process started as the converter is (this interpreter, this environment) that imports what the converter
    imports from its own tree (gguf) and exits: checked before training (stages/checks.py reads the outcome)."""
    return subprocess.Popen([sys.executable, "-c", PROBE, str(converter)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def summary(merged_dir: Path, info: dict, dst: Path, log: Path, pre: str | None, stage: str = "export") -> str:
    """One line for the run's log: what came out, by tensor type, and where the per-tensor lines are."""
    f = info["fields"]
    types = ", ".join(f"{t} {n}" for t, n in llamacpp.type_counts(info).items())
    vocab = f"{f.get('tokenizer.ggml.model')}/{f.get('tokenizer.ggml.pre', '-')}" + (" (from tokenizer.json)" if pre else "")
    return (f"{stage}: converted {merged_dir.name} -> {dst.name}: {len(info['tensor_types'])} tensors ({types}), "
            f"{dst.stat().st_size / 2**20:.1f} MiB, vocab {f.get('tokenizer.ggml.tokens', {}).get('array_len')} {vocab}; "
            f"per-tensor log {log.name}")


def pre_tokenizer(model_dir: Path) -> str | None:
    """llama.cpp's name for the pre-tokenizer in tokenizer.json, if it is one llama.cpp implements and nothing else
    (no normalizer, merges applied as trained) changes the ids; else None."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return None  # the converter reports a broken tokenizer in its own words
    model = tok.get("model") or {}
    if tok.get("normalizer") or model.get("type") != "BPE" or model.get("ignore_merges") or (tok.get("decoder") or {}).get("type") != "ByteLevel":
        return None
    got = _without(tok.get("pre_tokenizer"), "trim_offsets")
    return next((name for name, want in PRE_TOKENIZERS.items() if got == want), None)


def probe_text(converter: Path) -> str | None:
    """The text the converter hashes to recognize a tokenizer (chktxt in get_vocab_base_pre): emoji, CJK, digits,
    runs of whitespace and apostrophes, where pre-tokenizers differ."""
    tree = ast.parse((converter / "conversion" / "base.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "chktxt" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def _without(obj, key: str):
    if isinstance(obj, dict):
        return {k: _without(v, key) for k, v in obj.items() if k != key}
    if isinstance(obj, list):
        return [_without(v, key) for v in obj]
    return obj


def _launch(pre: str, script: Path, args: list[str]) -> None:
    """Run the converter script as its own __main__, naming `pre` (if any) only where its table does not know the
    tokenizer, and converting no multi-token-prediction layers: transformers drops them at load (Qwen3-Next's mtp.*,
    DeepSeek's and GLM's NextN layers), so a merged model never has them, and the converter would assert it must
    (its --no-mtp, refused by classes without MTP, hence the class default).

    `--metadata FILE` (stages/export/naming.py) names the GGUF, for convert_lora_to_gguf.py too, which has no such
    option (the launcher takes it out of its arguments and hands the file to gguf-py as convert_hf_to_gguf.py does)."""
    metadata = _metadata_option(args, keep=script.name != LORA_SCRIPT)
    sys.argv = [str(script), *args]
    sys.path[:0] = [str(script.parent)]  # what running the script directly puts first
    if "NO_LOCAL_GGUF" not in os.environ:
        sys.path.insert(1, str(script.parent / "gguf-py"))  # the converter's own gguf-py, as the script does
    from conversion.base import ModelBase, TextModel

    ModelBase.no_mtp = True
    if metadata is not None:
        _names_from(metadata)
    if not pre:
        runpy.run_path(str(script), run_name="__main__")
        return

    recognize = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognize(self, tokenizer)
        except NotImplementedError:
            print(f"{MARK} {pre!r}; writing tokenizer.ggml.pre={pre}", flush=True)
            return pre

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    runpy.run_path(str(script), run_name="__main__")


LORA_SCRIPT = "convert_lora_to_gguf.py"


def _metadata_option(args: list[str], keep: bool) -> Path | None:
    """The file of a `--metadata FILE` in `args`; taken out of them unless `keep`."""
    if "--metadata" not in args:
        return None
    i = args.index("--metadata")
    path = Path(args[i + 1])
    if not keep:
        del args[i:i + 2]
    return path


def _names_from(path: Path) -> None:
    """gguf-py's Metadata.load with `path` as the override file wherever the script passed none, and its
    `general.license` applied: gguf-py reads the license only from a model card's front matter, and the merged
    directory has no card."""
    import gguf

    load = gguf.Metadata.load
    given = json.loads(path.read_text(encoding="utf-8"))

    def load_named(metadata_override_path=None, model_path=None, model_name=None, total_params=0):
        meta = load(metadata_override_path or path, model_path, model_name, total_params)
        meta.license = given.get("general.license", meta.license)
        return meta

    gguf.Metadata.load = staticmethod(load_named)


if __name__ == "__main__":
    _launch(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
