"""Problems the run would hit after training, found before it starts (the preflight runs these first).

Each stops the run with one message that names the input and the fix (a UserError), within seconds,
instead of a traceback minutes or hours later:

- trackers (`training.report_to`): the MLflow server answers, or the SQLite / file store's directory
  is writable; the TensorBoard directory is writable. The user asked for the tracker, so a run without
  it is not what they asked for: it fails fast rather than training unrecorded.
- export tools: llama-cpp-python and gguf import in this process (export quantizes and reads GGUF
  here), the converter matches the runtime, and the processes the export starts later (llama.cpp's
  converter, the torch-free llama.cpp process) start and import what they need, started the same way.
- disk: the merged 16-bit model, the unquantized GGUF and every quantized one (artifacts_dir), the candidates export
  deletes after its fidelity gate, the adapter proof's base GGUF (deleted after it) and, where handoff.dir is on
  another filesystem, the bundle's copies fit in the free space of the filesystem(s) that will hold them at the peak;
  the preflight prints what each part needs and when it is freed.
- the hand-off directory: its `latest` is a link that can be switched.
- the tokenizer as llama.cpp will read it: the converter writes a vocabulary-only GGUF from the user's model directory
  (it supports the architecture and reads the tokenizer), whose metadata and tokenization of sample texts equal the
  HF tokenizer's (stages/export/vocab.py).
- export.imatrix, when it names a file: an importance-matrix GGUF whose tensors this model has, in their widths.

    checks.before_training(cfg, out_dir, tokenizer)   # out_dir: the preflight stage's directory in the run
"""

from __future__ import annotations

import errno
import importlib
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from stages import champion, data, errors, result_files
from stages.inputs import unwritable
from stages.config import RunConfig
from stages.errors import DiskFull, MissingPackage, RunError, UserError
from stages.export import convert as gguf_convert
from stages.export import imatrix, llamacpp, llamacpp_process, vocab
from stages.model.directory import config_json, resolve_model_dir, vocab_rows
from stages.quants import OUTPUT_BITS, OUTPUT_FALLBACK_BITS, TYPES
from stages.train import tracking

HTTP_TIMEOUT_S = 3      # an MLflow server that does not answer its health check in this long is down (or not there)
PROBE_TIMEOUT_S = 30    # a child that cannot import its packages in this long will not do better after training
INSTALL = "run `bash scripts/install.sh` in this environment (it builds llama-cpp-python, extracts the matching converter and installs gguf)"


class ToolError(UserError, RuntimeError):
    """A tool the export needs after training cannot run here."""


def before_training(cfg: RunConfig, out_dir: Path, tokenizer, export: bool = True) -> None:
    """Raise a UserError naming the first problem and its fix; `export`: also what the export side needs (its
    tools, its disk, the tokenizer as llama.cpp will read it, the importance matrix, the hand-off directory)."""
    run_dir = Path(out_dir).parent  # the preflight's directory is <artifacts_dir>/runs/<id>/preflight
    model_dir = resolve_model_dir(cfg.model.name_or_path)
    # the name export will give the GGUFs decides how llama.cpp reads some vocabularies: found (or refused) before any
    # child process starts, and the converter writes the user's vocabulary under it
    name = vocab.served_name(cfg.handoff.model_name, tokenizer, model_dir) if export else None
    probes = start_tool_probes() if export else []  # child processes: they start while the rest is checked
    job = vocab.start(model_dir, llamacpp.converter_dir(), name) if export else None  # the converter on the user's own files
    try:
        trackers(cfg, run_dir / "train")
        if export:
            disk(cfg, run_dir)
            handoff_dir(cfg)
            imat = imatrix_file(cfg)
        finish_tool_probes(probes)
        if export:
            gguf = job.wait()
            served_tokenizer(cfg, tokenizer, gguf, model_dir)
            if imat is not None:
                imatrix.check_against(imat, imatrix.widths_before_conversion(model_dir, llamacpp.read_gguf(gguf)),
                                      Path(cfg.export.imatrix).resolve(), str(model_dir))
    finally:
        for _what, _package, proc in probes:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if job is not None:
            job.kill()


# --- the hand-off directory, the importance matrix, the tokenizer as llama.cpp reads it ------------


def handoff_dir(cfg: RunConfig) -> None:
    """`latest` beside the published versions can be switched (a link, or nothing yet)."""
    problem = champion.latest_problem(Path(cfg.handoff.dir) / cfg.handoff.model_name)
    if problem:
        raise RunError(f"handoff.dir: {problem}")


def imatrix_file(cfg: RunConfig) -> imatrix.Imatrix | None:
    """export.imatrix, when it names a file: an importance matrix GGUF (its names and widths are checked against the
    model once the converter has named the model's tensors)."""
    if cfg.export.imatrix in ("auto", "off"):
        return None
    return imatrix.load(Path(cfg.export.imatrix))


SAMPLE_TEXTS = 20  # held-out and training samples each, through the chat template, tokenized both ways


def served_tokenizer(cfg: RunConfig, tokenizer, gguf: Path, model_dir: Path) -> None:
    """The vocabulary-only GGUF the converter wrote from the user's files: its metadata and its tokenization of sample
    texts (held-out and training samples in the chat template, and the converter's own probe text where the
    pre-tokenizer is named from tokenizer.json) equal the HF tokenizer's."""
    info = llamacpp.read_gguf(gguf)
    rows = vocab_rows(model_dir)
    what = f"the GGUF vocabulary llama.cpp's converter makes from {model_dir}"
    vocab.check_metadata(info, tokenizer, rows, what, model_dir)
    texts = [data.chat_text(s, tokenizer) for s in _ordinary(data.held_out(cfg, 2 * SAMPLE_TEXTS), tokenizer)[:SAMPLE_TEXTS]]
    texts += [data.chat_text(s, tokenizer) for s in _ordinary(data.train_samples(cfg)[:2 * SAMPLE_TEXTS], tokenizer)[:SAMPLE_TEXTS]]
    if gguf_convert.pre_tokenizer(model_dir):
        texts.append(gguf_convert.probe_text(llamacpp.converter_dir()))
    vocab.check_tokenization(gguf, tokenizer, [t for t in texts if t], what, model_dir)


def _ordinary(samples: list[data.Sample], tokenizer) -> list[data.Sample]:
    """Samples without special-token text in their messages: the preflight refused such text or (data.special_tokens_in_content:
    plain) training encodes it as plain text, which the whole text tokenized here, by either tokenizer, would not be."""
    pattern = data.special_pattern(tokenizer)
    return [s for s in samples if not (pattern and any(pattern.search(m["content"]) for m in s.messages))]


# --- trackers ---------------------------------------------------------------------------------


def trackers(cfg: RunConfig, train_dir: Path) -> None:
    """Every tracker in training.report_to can be written to, as the train stage will write to it."""
    report_to = cfg.training.report_to
    if "tensorboard" in report_to:
        where = tracking.tensorboard_dir(train_dir)
        why = unwritable(where)
        if why:
            raise tracking.TrackerError(f"training.report_to names tensorboard, but its log directory {where.resolve()} cannot be "
                                        f"written ({why}); make it writable, point artifacts_dir at a writable directory, or remove "
                                        "tensorboard from training.report_to")
    if "mlflow" in report_to:
        mlflow_store(tracking.mlflow_uri(train_dir))


def mlflow_store(uri: str) -> None:
    """An HTTP tracking server answers within HTTP_TIMEOUT_S; a SQLite or file store's directory is writable.
    Other schemes (databricks, ...) are left to MLflow."""
    parsed = urllib.parse.urlparse(uri)
    named = "MLFLOW_TRACKING_URI=" + uri if uri == os.environ.get("MLFLOW_TRACKING_URI") else f"the default {uri}"
    if parsed.scheme in ("http", "https"):
        why = unreachable(uri)
        if why:
            raise tracking.TrackerError(
                f"training.report_to names mlflow, but the tracking server {named} does not answer ({why}); start the server "
                f"(`mlflow server --host {parsed.hostname} --port {parsed.port or (443 if parsed.scheme == 'https' else 80)}`), point "
                "MLFLOW_TRACKING_URI at one that runs (or unset it: MLflow then logs to a SQLite file in the run), or remove mlflow "
                "from training.report_to")
        return
    if parsed.scheme == "sqlite":  # sqlite:///relative.db, sqlite:////absolute.db (SQLAlchemy's URLs)
        store = Path(urllib.parse.unquote(parsed.path[1:])).parent
    elif parsed.scheme in ("", "file"):
        store = Path(urllib.parse.unquote(parsed.path))
    else:
        return
    why = unwritable(store)
    if why:
        raise tracking.TrackerError(f"training.report_to names mlflow, but its store {named} is in {store.resolve()}, which cannot be written "
                                    f"({why}); point MLFLOW_TRACKING_URI at a writable place, or remove mlflow from training.report_to")


def unreachable(url: str) -> str | None:
    """Why an MLflow server at `url` does not answer its health check, or None when it answers at all
    (an HTTP error status is an answer: the server is there; MLflow reports what it refuses)."""
    health = urllib.parse.urljoin(url.rstrip("/") + "/", "health")
    try:
        with urllib.request.urlopen(health, timeout=HTTP_TIMEOUT_S):
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as e:
        reason = e.reason
        return f"{reason.strerror or reason}" if isinstance(reason, OSError) else str(reason)
    except TimeoutError:
        return f"no answer within {HTTP_TIMEOUT_S} s"
    except OSError as e:
        return e.strerror or str(e)


# --- export tools -----------------------------------------------------------------------------


def start_tool_probes() -> list[tuple[str, str, subprocess.Popen]]:
    """(what, package, process): the converter's and the llama.cpp process's imports, started as those
    processes are; the imports export needs in this process are checked here and now."""
    for package in ("llama_cpp", "gguf"):  # export quantizes with llama_cpp and reads GGUF metadata with gguf in-process
        import_here(package)
    converter = llamacpp.converter_dir()  # the script is there and matches the runtime, or how to get it
    missing = [f for f in ("conversion/__init__.py", "conversion/base.py") if not (converter / f).is_file()]
    if missing:
        raise llamacpp.ConverterMismatch(f"the converter in {converter} lacks {', '.join(missing)}; {INSTALL}")
    return [("llama.cpp's converter (convert_hf_to_gguf.py)", "gguf", gguf_convert.probe(converter)),
            ("the llama.cpp process (fidelity, tokenizer check, smoke test)", "llama_cpp", llamacpp_process.probe())]


def finish_tool_probes(probes: list[tuple[str, str, subprocess.Popen]], timeout: float = PROBE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    for what, package, proc in probes:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise ToolError(f"{what} did not start within {timeout:.0f} s (it imports {package} and exits); {INSTALL}, "
                            "and check the machine is not overloaded") from None
        if proc.returncode != 0:
            lines = [line for line in (out or "").splitlines() if line.strip()]
            raise MissingPackage(f"{package} cannot be imported by {what}, started as the export starts it "
                                 f"({lines[-1].strip() if lines else f'exit code {proc.returncode}'}); the export would fail "
                                 f"after training; {INSTALL}")


def import_here(package: str) -> None:
    try:
        importlib.import_module(package)
    except ModuleNotFoundError as e:
        raise (errors.missing_package(e) or MissingPackage(f"{package} cannot be imported ({e}); {INSTALL}")) from None
    except Exception as e:  # a broken build: a shared library that does not load
        raise MissingPackage(f"{package} cannot be imported in this process ({type(e).__name__}: {str(e)[:300]}); {INSTALL}") from None


# --- disk ---------------------------------------------------------------------------------------

# Bits per weight of llama.cpp's quantization mixes: stages/quants.py, from the sizes its quantize tool lists for
# Llama-3-8B (8.03 B weights, output layer included): Q4_K_M 4.58 GiB -> 4.89.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja")


@dataclass
class Output:
    what: str
    directory: Path       # where it will be written
    bytes: int
    freed: str | None = None   # the step after which the run deletes it again; None: it stays
    optional: bool = False     # left out, not the run stopped, where it does not fit (the adapter's proof: handoff.adapter auto)


def disk(cfg: RunConfig, run_dir: Path) -> None:
    """The outputs after training fit the free space of the filesystem(s) that will hold them at their peak (what
    stays, plus the largest set of files that live only until one step is done); DiskFull if not. Prints, per
    filesystem, what each part needs and when it is freed."""
    by_fs: dict[int, tuple[errors.Filesystem, list[Output]]] = {}
    for out in planned_outputs(cfg, run_dir):
        fs = errors.Filesystem.of(out.directory)
        by_fs.setdefault(fs.device, (fs, []))[1].append(out)
    for fs, outs in by_fs.values():
        need, with_optional = peak([o for o in outs if not o.optional]), peak(outs)
        print(f"preflight: disk at {fs.mount}: the export and the hand-off peak at {errors.gib(with_optional)} of {fs.describe()}: "
              + plan_text(outs))
        if need > fs.free:
            dirs = ", ".join(dict.fromkeys(f"{k} {Path(d).resolve()}" for k, d in (("artifacts_dir", cfg.artifacts_dir),
                                                                                   ("handoff.dir", cfg.handoff.dir))
                                           if errors.Filesystem.of(d).device == fs.device))
            raise DiskFull(errno.ENOSPC,
                           f"the export and the bundle will need about {errors.gib(need)} on the filesystem mounted at {fs.mount} "
                           f"({dirs}), which has {fs.describe()}: " + plan_text([o for o in outs if not o.optional])
                           + "; free space there, or point artifacts_dir / handoff.dir at a larger disk (they may be on "
                           "different disks), or export fewer export.quant_types")


def peak(outs: list[Output]) -> int:
    """Bytes on disk at the fullest moment: everything that stays, plus the files freed after one step (they are all
    there until that step ends; each step's are gone before the next one's are written)."""
    by_step: dict[str, int] = {}
    for o in outs:
        if o.freed:
            by_step[o.freed] = by_step.get(o.freed, 0) + o.bytes
    return sum(o.bytes for o in outs if not o.freed) + max(by_step.values(), default=0)


def plan_text(outs: list[Output]) -> str:
    def when(o: Output) -> str:
        notes = [f"freed {o.freed}"] * bool(o.freed) + ["left out where it does not fit"] * o.optional
        return f" ({'; '.join(notes)})" if notes else ""

    return ", ".join(f"{o.what} {errors.gib(o.bytes)}{when(o)}" for o in outs)


def planned_outputs(cfg: RunConfig, run_dir: Path) -> list[Output]:
    """What merge, export and handoff will write, sized from the base model's safetensors headers; outputs
    of stages this run already finished (a resumed run) are on disk already and not counted.

    Export quantizes each type with and without the importance matrix (export.imatrix) and deletes the farther of
    the two once the fidelity gate has measured both. The hand-off links the run's files into the bundle where
    handoff.dir shares artifacts_dir's filesystem (stages/handoff.py `place`: no bytes), copies them elsewhere; its
    adapter proof converts the base model to a GGUF as large as the unquantized one, deleted once measured."""
    model_dir = resolve_model_dir(cfg.model.name_or_path)
    tensors = _tensors(model_dir)
    tokenizer = sum((model_dir / f).stat().st_size for f in TOKENIZER_FILES if (model_dir / f).is_file())
    artifacts, handoff = Path(cfg.artifacts_dir), Path(cfg.handoff.dir)
    outs = []
    if not result_files.done(run_dir / "merge", "merge"):
        outs.append(Output("merged model", artifacts, _merged_bytes(model_dir, tensors) + tokenizer))
    quants = [Output(f"{q} GGUF", artifacts, gguf_bytes(tensors, q) + tokenizer) for q in cfg.export.quant_types]
    unquantized = gguf_bytes(tensors, cfg.export.outtype) + tokenizer
    adapter = _adapter_bytes(cfg, tensors) if cfg.handoff.adapter == "auto" else 0
    if not result_files.done(run_dir / "export", "export"):
        outs.append(Output(f"{cfg.export.outtype} GGUF", artifacts, unquantized))
        outs += quants
        if cfg.export.imatrix != "off":
            outs += [Output(f"{o.what} with the other weighting", artifacts, o.bytes, freed="after the fidelity gate")
                     for o, q in zip(quants, cfg.export.quant_types, strict=True) if TYPES[q].imatrix]
    if adapter:
        outs += [Output("the adapter proof's base GGUF", artifacts, unquantized, freed="after the adapter proof", optional=True),
                 Output("the adapter GGUF", artifacts, adapter // 3, optional=True)]
    if errors.Filesystem.of(handoff).device != errors.Filesystem.of(artifacts).device:  # one filesystem: linked, no bytes
        outs += [Output(f"bundle copy of the {o.what}", handoff, o.bytes) for o in quants]
        outs += [Output("bundle copy of the adapter (PEFT and GGUF)", handoff, adapter, optional=True)] if adapter else []
    return outs


def _adapter_bytes(cfg: RunConfig, tensors: dict[str, tuple[list[int], str]]) -> int:
    """The adapter's PEFT file (float32) and its GGUF (16-bit): r x (rows + columns) per adapted matrix, 6 bytes each."""
    wanted = cfg.lora.target_modules
    n = 0
    for name, (shape, _dtype) in tensors.items():
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if len(shape) != 2 or not name.endswith(".weight") or "layers." not in name:
            continue
        if wanted == "all-linear" or module in wanted:
            n += cfg.lora.r * (shape[0] + shape[1])
    return 6 * n


def gguf_bytes(tensors: dict[str, tuple[list[int], str]], kind: str) -> int:
    """A GGUF of `kind` (f16, bf16, f32, auto or a quant type): matrices at its bits per weight, vectors (norms,
    biases) in F32 as llama.cpp keeps them."""
    output = _output_layer(tensors)
    bits = 0.0
    for name, (shape, _dtype) in tensors.items():
        n = _numel(shape)
        if len(shape) < 2:
            bits += 32 * n
        elif kind in TYPES:
            mix, out = (TYPES[kind].bits, OUTPUT_BITS) if shape[-1] % 256 == 0 else (TYPES[kind].fallback_bits, OUTPUT_FALLBACK_BITS)
            bits += (max(mix, out) if name == output else mix) * n
        else:
            bits += (32 if kind == "f32" else 16) * n
    return int(bits / 8)


def _merged_bytes(model_dir: Path, tensors: dict[str, tuple[list[int], str]]) -> int:
    """merge saves every floating tensor in the base checkpoint's own dtype (config.json's dtype, else bf16)."""
    config = config_json(model_dir)
    width = 4 if (config.get("dtype") or config.get("torch_dtype")) == "float32" else 2
    return sum(_numel(shape) * (width if dtype.startswith(("F", "BF")) else DTYPE_BYTES.get(dtype, 1)) for shape, dtype in tensors.values())


def _tensors(model_dir: Path) -> dict[str, tuple[list[int], str]]:
    from stages.model.check import read_header

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        header, problem = read_header(f)
        if not problem:  # a broken file stopped the run at config load already
            out |= {k: (v["shape"], v["dtype"]) for k, v in header.items() if k != "__metadata__"}
    return out


def _output_layer(tensors: dict) -> str | None:
    """The output layer's weight: lm_head, or the input table where it is tied (no lm_head stored)."""
    names = list(tensors)
    return (next((n for n in names if n.endswith("lm_head.weight")), None)
            or next((n for n in names if n.endswith(("embed_tokens.weight", "wte.weight"))), None))


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
