#!/usr/bin/env bash
# Install train-and-export into the current Python environment.
#
# One script for the README, .ci/run and the Dockerfile:
#   bash scripts/install.sh            # CPU (laptops, CI)
#   TAE_ACCEL=cuda bash scripts/install.sh   # CUDA build of llama.cpp (Dockerfile, GPU hosts)
#
# What it does (each step is skipped when its output is already there; llama.cpp compiles while torch and the rest install):
#   1. torch: the CPU build on CPU (a bare `pip install torch` pulls a multi-GB CUDA build).
#   2. llama-cpp-python: downloads the pinned sdist once, checks its sha256, and builds it.
#      A native (-march=native) build can use AMX and die with SIGILL on another CPU, so
#      the CPU build names its instruction sets.
#   3. The official GGUF converter (convert_hf_to_gguf.py, conversion/, gguf-py/) is taken
#      from that same sdist into the cache, so the converter always matches the runtime;
#      its gguf-py is installed as the `gguf` package.
#   4. This project (editable) with its pinned dependencies and test tools.
set -euo pipefail

LLAMA_CPP_VERSION=0.3.36
LLAMA_CPP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
TORCH_VERSION=2.13.0
ACCEL=${TAE_ACCEL:-cpu}
CACHE=${TAE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/train-and-export}
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check --no-input)

case "$ACCEL" in
  cpu)  CMAKE_ARGS_DEFAULT="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" ;;
  cuda) CMAKE_ARGS_DEFAULT="-DGGML_CUDA=on -DGGML_NATIVE=OFF -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-80;86;89;90}" ;;
  *) echo "TAE_ACCEL must be cpu or cuda, got '$ACCEL'" >&2; exit 2 ;;
esac
# llava/mtmd is not used by this project; skipping it saves a third of the build.
export CMAKE_ARGS="${CMAKE_ARGS:-$CMAKE_ARGS_DEFAULT} -DLLAVA_BUILD=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS

log() { printf '[install %(%H:%M:%S)T] %s\n' -1 "$*"; }
mkdir -p "$CACHE"

SDIST="$CACHE/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  log "1/5 downloading llama-cpp-python $LLAMA_CPP_VERSION sdist"
  # Straight from PyPI's simple index (1 s): `pip download` of an sdist first builds its metadata (scikit-build-core
  # in an isolated environment, ~40 s). pip is the fallback where another index is configured. The sha256 decides.
  if "$PY" - "$SDIST.part" "$LLAMA_CPP_VERSION" 2>/dev/null <<'PYEOF'
import re, sys, urllib.parse, urllib.request
out, version = sys.argv[1], sys.argv[2]
index = "https://pypi.org/simple/llama-cpp-python/"
html = urllib.request.urlopen(index, timeout=60).read().decode()
href = re.search(rf'href="([^"]*/llama_cpp_python-{re.escape(version)}\.tar\.gz[^"]*)"', html).group(1)
urllib.request.urlretrieve(urllib.parse.urljoin(index, href), out)
PYEOF
  then
    mv "$SDIST.part" "$SDIST"
  else
    rm -f "$SDIST.part"
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$CACHE/dl"
    mv "$CACHE/dl/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz" "$SDIST"
  fi
fi
echo "$LLAMA_CPP_SHA256  $SDIST" | sha256sum -c --quiet - \
  || { echo "sha256 of $SDIST differs from the pinned one: delete it and re-run" >&2; exit 1; }

CONVERTER="$CACHE/llama-cpp-converter-$LLAMA_CPP_VERSION"
if [ ! -f "$CONVERTER/VERSION" ]; then
  log "2/5 extracting the official converter into $CONVERTER"
  tmp=$(mktemp -d "$CACHE/extract.XXXX")
  top="llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp"
  tar -xzf "$SDIST" -C "$tmp" "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py" "$top/LICENSE"
  echo "$LLAMA_CPP_VERSION" > "$tmp/$top/VERSION"
  rm -rf "$CONVERTER" && mv "$tmp/$top" "$CONVERTER" && rm -rf "$tmp"
fi

WHEELS="$CACHE/wheels-$ACCEL"
EXTRAS=dev
if [ "$ACCEL" = cuda ]; then EXTRAS=dev,gpu; fi  # liger-kernel (Triton) only where there is a GPU
build_pid=
if ! ls "$WHEELS"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl >/dev/null 2>&1; then
  log "3/5 building llama-cpp-python $LLAMA_CPP_VERSION ($ACCEL, $JOBS jobs; ~3 min on 2 cores), beside steps 4-5"
  log "    CMAKE_ARGS=$CMAKE_ARGS"
  # The sdist forces llama.cpp's `common` library on (with cpp-httplib: half the build), for the llava/mtmd tools
  # switched off above; the Python package loads libllama and libggml only. Built from the verified sdist with
  # that one line turned off (2.8 min instead of 5.3 on 2 cores; the same llama_cpp/lib files).
  src=$(mktemp -d "$CACHE/src.XXXX")
  tar -xzf "$SDIST" -C "$src"
  cml="$src/llama_cpp_python-$LLAMA_CPP_VERSION/CMakeLists.txt"
  on='set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)'
  grep -qF "$on" "$cml" || { echo "$cml no longer forces LLAMA_BUILD_COMMON: review scripts/install.sh for this version" >&2; exit 1; }
  sed -i "s/${on//\//\\/}/${on/ ON / OFF }/" "$cml"
  # The compiler runs while pip unpacks the other dependencies (mostly I/O): ~2 min of a clean install saved.
  ( "$PY" -m pip wheel -q --no-deps "$src/llama_cpp_python-$LLAMA_CPP_VERSION" -w "$WHEELS.tmp" > "$CACHE/llama-build.log" 2>&1 \
      && mkdir -p "$WHEELS" && mv "$WHEELS.tmp"/*.whl "$WHEELS"/ && rm -rf "$WHEELS.tmp" "$src" ) &
  build_pid=$!
fi

log "4/5 torch ($ACCEL)"
# On a laptop, point TAE_TORCH_INDEX at https://download.pytorch.org/whl/cpu to get the
# small CPU build; CI machines have it on disk already.
"${PIP[@]}" -q "torch==$TORCH_VERSION" ${TAE_TORCH_INDEX:+--index-url "$TAE_TORCH_INDEX"}

log "5/5 train-and-export and its pinned dependencies"
# Everything but llama-cpp-python first (pip would build that one itself from the sdist, without the flags above).
reqs=$(mktemp)
"$PY" - "$REPO/pyproject.toml" "$EXTRAS" > "$reqs" <<'PYEOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = [x for e in sys.argv[2].split(",") for x in project["optional-dependencies"][e]]
print("\n".join(d for d in project["dependencies"] + extras if not d.startswith("llama-cpp-python")))
PYEOF
"${PIP[@]}" -q -r "$reqs"
rm -f "$reqs"
if [ -n "$build_pid" ]; then
  wait "$build_pid" || { echo "building llama-cpp-python failed; its log: $CACHE/llama-build.log" >&2; tail -30 "$CACHE/llama-build.log" >&2; exit 1; }
  log "    llama-cpp-python built"
fi
"${PIP[@]}" -q "$WHEELS"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl "$CONVERTER/gguf-py"
"${PIP[@]}" -q --no-deps -e "$REPO"
# A CUDA build of llama.cpp loads libcuda.so.1 on import: where no driver is (a `docker build`, a CPU build host)
# it is checked at container start instead (scripts/entrypoint.sh), not here.
if [ "$ACCEL" = cuda ] && ! "$PY" -c "import ctypes; ctypes.CDLL('libcuda.so.1')" 2>/dev/null; then
  "$PY" -c "import gguf, torch, transformers, peft, prefect, openai; from importlib.metadata import version; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| llama_cpp', version('llama_cpp_python'), '(not imported: no CUDA driver here) | prefect', prefect.__version__)"
else
  "$PY" -c "import llama_cpp, gguf, torch, transformers, peft, prefect, openai; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| llama_cpp', llama_cpp.__version__, '| prefect', prefect.__version__)"
fi
echo "converter: $CONVERTER"
