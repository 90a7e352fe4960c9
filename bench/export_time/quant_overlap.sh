#!/usr/bin/env bash
# One device call: are the two quantizations faster run at once? (bench/export_time/quant_overlap.py)
#   device run (carry .qo and .sdist): bash bench/export_time/quant_overlap.sh
# .qo/  the CPU llama-cpp-python 0.3.36 wheel (scripts/install.sh builds it; quantization is CPU work in any build)
#       with the sentencepiece, protobuf, pydantic (+core, typing-*, annotated-types) wheels (cp312)
# .sdist/ llama-cpp-python 0.3.36 trimmed by bench/export_time/trim_llama_sdist.py: the matching converter
set -u
: "${OUT:?}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .qo/*.whl || exit 1
V=0.3.36
CONV=/tmp/tae-cache/llama-cpp-converter-$V
top=llama_cpp_python-$V/vendor/llama.cpp
rm -rf /tmp/x /tmp/quant-overlap "$CONV" && mkdir -p /tmp/x /tmp/tae-cache
tar -xzf .sdist/llama_cpp_python-$V.tar.gz -C /tmp/x "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py" \
  && mv /tmp/x/$top "$CONV" && echo $V > "$CONV/VERSION" || exit 1
PYTHONPATH=/tmp/site:.:$CONV/gguf-py TAE_CACHE_DIR=/tmp/tae-cache PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  python3 bench/export_time/quant_overlap.py --out "$OUT/quant_overlap.json" 2>&1 | grep -v "^\[\|llama_model_\|^size\|converting to"
