#!/usr/bin/env bash
# One H200 call for the export bench (issue 5) and the last training rows (issue 4):
#   device run (carry .whl and .sdist): bash bench/export_time/gpu_session.sh      (SKIP_TRAIN=1: export only)
# .whl/  bitsandbytes, liger-kernel, pydantic (+core, deps), sentencepiece, protobuf, diskcache wheels (cp312)
# .sdist/ llama-cpp-python 0.3.36 trimmed by bench/export_time/trim_llama_sdist.py (4.4 MB)
# .llama-whl/ (optional) a CUDA llama-cpp-python wheel built elsewhere: skips the ~220 s build (one built here
#   is over the 16 MiB a file may have to come back from the device)
# .diag/tiny-f16.gguf (optional) a tiny GGUF (bench/export_time/export_r7.py --shape tiny-llama on CPU): bench/llama_cuda/llama_gpu_diag.py
#   loads it under the fresh build in several process states before the export starts
# TINY=1: the whole export of the tiny model through the CUDA build first
# The CUDA build of llama-cpp-python is CPU-bound and takes minutes: it runs niced in the
# background while the GPU measures training; the export waits for it. GGML_CUDA_FA=OFF
# skips llama.cpp's flash-attention kernel instances (most of the build time).
set -u
: "${OUT:?}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/base/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TAE_CACHE_DIR=/tmp/tae-cache
V=0.3.36
CONV=$TAE_CACHE_DIR/llama-cpp-converter-$V
# The converter first, in the foreground: a PYTHONPATH entry that does not exist yet when python
# starts is cached as missing, and gguf would never import.
rm -rf /tmp/x /tmp/bench-export /tmp/bench-export-tiny "$CONV"  # a warm machine keeps /tmp: start from nothing but a finished build
rm -f /tmp/llama-built.failed  # a failed build of an earlier call must not stop this one's wait
mkdir -p /tmp/x "$TAE_CACHE_DIR"
top=llama_cpp_python-$V/vendor/llama.cpp
tar -xzf .sdist/llama_cpp_python-$V.tar.gz -C /tmp/x "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py" \
  && mv /tmp/x/$top "$CONV" && echo $V > "$CONV/VERSION" || exit 1
(
  t0=$(date +%s)
  if [ -f /tmp/llama-built ] && python3 -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python: reusing this machine's build"
  elif ls .llama-whl/llama_cpp_python-$V-*.whl >/dev/null 2>&1 \
       && python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/site .llama-whl/llama_cpp_python-$V-*.whl; then
    echo "llama-cpp-python: the carried CUDA wheel (.llama-whl/)"; echo 0 > /tmp/llama-built
  elif rm -f /tmp/llama-built /tmp/llama-built.failed && CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF" \
     CMAKE_BUILD_PARALLEL_LEVEL=16 nice -n "${BUILD_NICE:-19}" python3 -m pip wheel -q --no-deps --no-build-isolation \
     .sdist/llama_cpp_python-$V.tar.gz -w /tmp/llw > "$OUT/build.log" 2>&1 \
     && python3 -m pip install -q --no-deps --no-index --target /tmp/site /tmp/llw/*.whl >> "$OUT/build.log" 2>&1; then
    t1=$(date +%s)
    # Before the export starts (it waits for /tmp/llama-built): which process state crashes this build's model load?
    [ -f .diag/tiny-f16.gguf ] && PYTHONPATH=/tmp/site python3 bench/llama_cuda/llama_gpu_diag.py .diag/tiny-f16.gguf --out "$OUT/llama_gpu_diag.json"
    echo "$(( t1 - t0 ))" > /tmp/llama-built
  else
    touch /tmp/llama-built.failed
  fi
) &
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  python3 bench/train_speed/train_r7.py --parts plain qlora bf16 liger --out "$OUT/train_r7_run4.json" --max-seconds 220 2>&1 \
    | grep -v "Warning\|Loading weights\|Writing model\|Backend impl\|train_runtime\|use_return_dict" | tail -20
  rm -rf /tmp/bench-models
fi
export PYTHONPATH=$PYTHONPATH:$CONV/gguf-py
python3 -c "import gguf" || exit 1
if [ "${TINY:-0}" = 1 ]; then  # the tiny model first (seconds): does this CUDA build of llama.cpp load and evaluate at all?
  TAE_LLAMA_VERBOSE=1 python3 -X faulthandler bench/export_time/export_r7.py --shape tiny-llama --out "$OUT/export_tiny.json" \
    --work /tmp/bench-export-tiny --wait-for /tmp/llama-built > "$OUT/export_tiny.log" 2>&1
  echo "tiny export exit status: $?"; grep "export: \|smoke: \|Error\|Fatal\|error" "$OUT/export_tiny.log" | tail -12
fi
# llama.cpp (CUDA) once died without a word in a process that had imported torch (bench/llama_cuda/llama_gpu_diag.py):
# keep llama.cpp's log and Python's crash report, and say how the process ended.
TAE_LLAMA_VERBOSE=1 python3 -X faulthandler bench/export_time/export_r7.py --out "$OUT/export_r7.json" --wait-for /tmp/llama-built --free-disk \
  > "$OUT/export_r7.log" 2>&1
echo "export_r7.py exit status: $? (137: SIGKILL, e.g. the OOM killer; 139: SIGSEGV; 134: abort)"
grep -v "Warning\|Loading weights\|Writing\|INFO:\|llama_model_loader: - \|print_info\|load_tensors: layer" "$OUT/export_r7.log" | tail -60
free -g | head -2; dmesg 2>/dev/null | grep -i "killed process\|out of memory" | tail -3
wait  # the background build, if the export stopped before it ended
echo "build seconds: $(cat /tmp/llama-built 2>/dev/null || echo failed)"; tail -5 "$OUT/build.log"; df -h /tmp | tail -1
