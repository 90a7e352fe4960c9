#!/usr/bin/env bash
# Container start: what the image build could not check (no GPU driver at build time), then the command.
set -euo pipefail
if [ "${TAE_ACCEL:-cpu}" = cuda ]; then
  if ! python -c "import llama_cpp" 2>/tmp/llama_cpp_import.err; then
    echo "train-and-export: llama.cpp (CUDA build) does not load: $(tail -1 /tmp/llama_cpp_import.err)." >&2
    echo "Run the container with the GPU driver visible: docker run --gpus all (NVIDIA Container Toolkit), or build the CPU" >&2
    echo "image (--build-arg TAE_ACCEL=cpu --build-arg BASE=debian:bookworm)." >&2
    exit 2
  fi
fi
exec "$@"
