# train-and-export on a CUDA host: the same install script as CI, with llama.cpp built for CUDA.
#   docker build -t train-and-export .
#   docker run --gpus all -v $PWD/artifacts:/app/artifacts -v /models:/models train-and-export
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    TAE_ACCEL=cuda CUDA_ARCHS="80;86;89;90" \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential cmake git ca-certificates \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . /app
# The CUDA toolkit's stub libcuda lets llama.cpp link without a GPU at build time.
RUN python3 -m venv /opt/venv \
    && LIBRARY_PATH=/usr/local/cuda/lib64/stubs bash scripts/install.sh

CMD ["python", "-m", "flows.train_and_export", "--config", "configs/default.yaml"]
