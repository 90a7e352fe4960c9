"""The llama.cpp toolchain: the official converter, quantization and reading GGUF files.

The converter (convert_hf_to_gguf.py with its conversion/ and gguf-py/) is extracted by
scripts/install.sh from the same llama-cpp-python sdist that built the runtime, into
$TAE_CACHE_DIR/llama-cpp-converter-<version>. A converter from another llama.cpp version
can write metadata the runtime misreads, so the versions must match exactly.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections import Counter
from pathlib import Path

from stages import errors
from stages.errors import UserError

CACHE = Path(os.environ.get("TAE_CACHE_DIR", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "train-and-export"))
MAX_METADATA_STRING = 1 << 20  # a chat template or any string over 1 MiB in GGUF metadata is refused
# llama-cpp-python silences fd 1 and 2 while it loads a model unless verbose: then a crash inside
# llama.cpp (even Python's faulthandler report) leaves no trace. TAE_LLAMA_VERBOSE=1 keeps its log.
VERBOSE = os.environ.get("TAE_LLAMA_VERBOSE") == "1"
# The converter and the quantizer write a line per tensor: the export stage keeps those in a log file next to the
# GGUF and prints one summary line per file. TAE_VERBOSE=1 prints every line as well.
EXPORT_VERBOSE = os.environ.get("TAE_VERBOSE") == "1"


class UnsupportedArchitecture(UserError, ValueError):
    """llama.cpp's converter has no mapping for the model's architecture."""


class ConverterMismatch(UserError, RuntimeError):
    """The converter on disk is not from the installed llama.cpp runtime's sdist."""


def runtime_version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def converter_dir() -> Path:
    """The converter matching the installed llama-cpp-python, or a clear error how to get it."""
    version = runtime_version()
    d = Path(os.environ.get("TAE_CONVERTER_DIR", CACHE / f"llama-cpp-converter-{version}"))
    script = d / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise ConverterMismatch(
            f"GGUF converter not found at {script}; run `bash scripts/install.sh` (it extracts it from the llama-cpp-python {version} sdist)"
        )
    found = (d / "VERSION").read_text().strip() if (d / "VERSION").is_file() else "unknown"
    if found != version:
        raise ConverterMismatch(
            f"the converter in {d} comes from llama-cpp-python {found}, but {version} is installed; "
            "re-run `bash scripts/install.sh` so both come from the same sdist"
        )
    return d


def quantize(src: Path, dst: Path, ftype: int, nthread: int = 0, imatrix: dict | None = None) -> str:
    """llama.cpp's own quantizer, in-process (llama_model_quantize); returns its log (a line per tensor).

    imatrix: GGUF tensor name -> mean x^2 per input column (stages/export/imatrix.py), as `llama-quantize --imatrix` passes it."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = nthread or (os.cpu_count() or 1)
    if imatrix:
        from stages.export.imatrix import quantize_entries

        entries, _buffers = quantize_entries(imatrix)  # _buffers: alive until the call returns
        params.imatrix = ctypes.cast(entries, type(params.imatrix))
    with captured_log() as log:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.is_file():
        print(*"".join(log).splitlines()[-20:], sep="\n")  # llama.cpp's reason, if it gave one
        import errno
        import shutil

        if shutil.disk_usage(dst.parent).free < src.stat().st_size // 2:  # llama.cpp says only "failed": a full disk is the likely why
            raise errors.no_space(OSError(errno.ENOSPC, "No space left on device", str(dst)))
        raise RuntimeError(f"llama_model_quantize({src.name} -> {dst.name}, ftype {ftype}) failed with code {rc}")
    return "".join(log)


@contextlib.contextmanager
def captured_log():
    """llama.cpp's log, collected into a list of text pieces instead of going to stderr, while the block runs.

    llama-cpp-python prints every piece with print(..., file=sys.stderr), which a Prefect flow with log_prints
    turns into one log record each: hundreds per quantized file. Its own callback is put back afterwards.
    """
    import llama_cpp
    from llama_cpp import _logger

    pieces: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        pieces.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield pieces
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


MAX_PER_LAYER = 4096   # a numeric metadata array this long or shorter is a per-layer setting, kept whole


def read_gguf(path: Path) -> dict:
    """Metadata and tensor types of a GGUF file, through gguf-py's reader.

    Returns: {"fields": {key: value}, "tensor_types": {name: type}, "tensor_bytes": {name: n},
    "tensor_shapes": {name: [..]}}. Absurdly large string metadata is refused.
    """
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as e:  # gguf-py's messages do not say which file
        raise ValueError(f"{Path(path).name}: not a readable GGUF file ({e}); re-export it") from None
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            # Vocabularies are arrays of 100k+ entries: keep only their length. Hybrid models (Jamba, LFM2) give
            # per-layer settings as short arrays of numbers (head_count_kv 0 on a recurrent layer): kept whole.
            if len(field.types) > 1 and field.types[1] != GGUFValueType.STRING and len(field.data) <= MAX_PER_LAYER:
                fields[key] = field.contents()
            else:
                fields[key] = {"array_len": len(field.data)}
            continue
        value = field.contents()
        if isinstance(value, str) and len(value) > MAX_METADATA_STRING:
            raise ValueError(f"{path.name}: metadata {key} is {len(value)} characters long; refusing a file this odd")
        fields[key] = value
    return {
        "fields": fields,
        "tensor_types": {t.name: t.tensor_type.name for t in reader.tensors},
        "tensor_bytes": {t.name: int(t.n_bytes) for t in reader.tensors},
        "tensor_shapes": {t.name: [int(x) for x in t.shape] for t in reader.tensors},
    }


def type_counts(info: dict) -> dict[str, int]:
    return dict(Counter(info["tensor_types"].values()).most_common())
