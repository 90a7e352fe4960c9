# train-and-export worker on a CUDA host: the same install script as CI, llama.cpp built for CUDA.
#   docker build -t train-and-export .
#   docker run --gpus all -e PREFECT_API_URL=http://<server>:4200/api \
#     -v $PWD/artifacts:/app/artifacts -v /models:/models train-and-export
# By default it serves the deployments (train-and-export/default, retrain-on-new-data/scheduled)
# and runs their flow runs on this host's GPUs; one-off: ... train-and-export python -m flows.train_and_export --config X
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

CMD ["python", "-m", "flows.deploy", "serve", "--config", "configs/default.yaml"]
