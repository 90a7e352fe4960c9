# Sourced by this folder's device-call scripts: the carried wheels (.whl/base: what every tool needs that the device
# image lacks; .whl/uns: Unsloth and what it needs beside them, datasets < 5 among them, in its own directory), the
# environment, and tool NAME SECONDS ARGS... (one tool in its own process; its JSON in $OUT/raw, its log appended to
# $OUT/log.txt).
set -u
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/base/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-uns .whl/uns/*.whl || exit 1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 \
       TOKENIZERS_PARALLELISM=false UNSLOTH_DISABLE_STATISTICS=1 HF_DATASETS_OFFLINE=1
mkdir -p "$OUT/raw" /tmp/peers
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
tool() {  # name, seconds, tool, args...
  local name=$1 secs=$2 tool=$3 path=/tmp/site:$PWD; shift 3
  [ "$tool" = unsloth ] && path=/tmp/site-uns:$path
  echo "=== $name ($tool $*)" >> "$OUT/log.txt"
  PYTHONPATH=$path timeout "$secs" python3 bench/peers/run.py "$tool" "$@" --name "$name" --run "$RUN" \
    --out "$OUT/raw/$name.json" >> "$OUT/log.txt" 2>&1
  echo "$name rc=$? at $((SECONDS - start)) s"
  grep -E "^(unsloth|stage|peft|peft-liger) (full|longtail|long) " "$OUT/log.txt" | tail -3 | cut -c1-330
}
finish() {  # the merged rows and every raw JSON in one archive (the device returns at most 8 files)
  PYTHONPATH=/tmp/site:$PWD python3 bench/peers/run.py merge "$OUT/results-$RUN.json" "$OUT"/raw/*.json
  tar -czf "$OUT/raw-$RUN.tar.gz" -C "$OUT" raw && rm -rf "$OUT/raw"
}
