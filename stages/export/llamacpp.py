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
    """Metadata and tensor types of a GGUF file.

    Returns: {"fields": {key: value}, "tensor_types": {name: type}, "tensor_bytes": {name: n},
    "tensor_shapes": {name: [..]}}. Vocabularies (arrays of strings, and numeric arrays longer than MAX_PER_LAYER) are
    given as {"array_len": n}; absurdly large string metadata is refused.

    The header is walked here rather than by gguf-py's GGUFReader, which makes a numpy view of every element of every
    array: 9 s per read of a GGUF with Qwen2's or Llama 3's 150k tokens and merges, and a run reads its GGUFs 7 times
    (0.2 s here). Files this walk does not take (big-endian, arrays of arrays) go through GGUFReader.
    """
    import mmap
    import struct

    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk_gguf(buf, Path(path))
    except _NotWalked:
        return _read_gguf_with_reader(Path(path))
    except (ValueError, OSError, IndexError, struct.error, UnicodeDecodeError) as e:  # say which file, as for any other
        if isinstance(e, ValueError) and str(e).startswith(f"{Path(path).name}:"):
            raise
        raise ValueError(f"{Path(path).name}: not a readable GGUF file ({e}); re-export it") from None


class _NotWalked(Exception):
    """A GGUF layout _walk_gguf leaves to gguf-py's reader."""


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _walk_gguf(buf, path: Path) -> dict:
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if buf[:4] != b"GGUF":
        raise ValueError("GGUF magic invalid")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version & 0xFFFF == 0:   # written big-endian
        raise _NotWalked
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    offs = 24

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        if at + 8 + n > len(buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        return buf[at + 8:at + 8 + n].decode("utf-8"), at + 8 + n

    fields: dict = {}
    for _ in range(n_kv):
        key, offs = string(offs)
        (kind,) = struct.unpack_from("<I", buf, offs)
        offs += 4
        if kind == _STRING:
            value, offs = string(offs)
            if len(value) > MAX_METADATA_STRING:
                raise ValueError(f"{path.name}: metadata {key} is {len(value)} characters long; refusing a file this odd")
        elif kind == _ARRAY:
            item, n = struct.unpack_from("<IQ", buf, offs)
            offs += 12
            if item == _STRING:   # a vocabulary or its merges: only the length is kept, the strings skipped over
                for _ in range(n):
                    offs += 8 + struct.unpack_from("<Q", buf, offs)[0]
                value = {"array_len": n}
            elif item in _SCALARS:
                size = struct.calcsize(_SCALARS[item])
                # Hybrid models (Jamba, LFM2) give per-layer settings as short arrays of numbers: kept whole
                value = (list(struct.unpack_from(f"<{n}{_SCALARS[item][1]}", buf, offs)) if n <= MAX_PER_LAYER
                         else {"array_len": n})
                offs += size * n
            else:
                raise _NotWalked
        elif kind in _SCALARS:
            (value,) = struct.unpack_from(_SCALARS[kind], buf, offs)
            offs += struct.calcsize(_SCALARS[kind])
        else:
            raise ValueError(f"unknown metadata type {kind} for {key}")
        if key in fields:
            raise ValueError(f"duplicate metadata key {key}")
        fields[key] = value
    types, sizes, shapes = {}, {}, {}
    for _ in range(n_tensors):
        name, offs = string(offs)
        (n_dims,) = struct.unpack_from("<I", buf, offs)
        if n_dims > 4:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, offs + 4))
        (raw,) = struct.unpack_from("<I", buf, offs + 4 + 8 * n_dims)
        offs += 4 + 8 * n_dims + 4 + 8
        kind = GGMLQuantizationType(raw)
        block, size = GGML_QUANT_SIZES[kind]
        n = 1
        for d in dims:
            n *= d
        types[name], sizes[name], shapes[name] = kind.name, n * size // block, dims
    return {"fields": {k: v for k, v in fields.items() if not k.startswith("GGUF.")},
            "tensor_types": types, "tensor_bytes": sizes, "tensor_shapes": shapes}


def _read_gguf_with_reader(path: Path) -> dict:
    """read_gguf through gguf-py's GGUFReader (every layout it reads; slow on large vocabularies)."""
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
