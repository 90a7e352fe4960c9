# train-and-export worker: the same install script as CI; llama.cpp built for CUDA by default.
#   docker build -t train-and-export .                                    (CUDA; no GPU needed to build)
#   docker build --build-arg BASE=debian:bookworm --build-arg TAE_ACCEL=cpu -t train-and-export:cpu .
#   docker run --gpus all -e PREFECT_API_URL=http://<server>:4200/api \
#     -v $PWD/artifacts:/app/artifacts -v /models:/models train-and-export
# By default it serves the deployments (train-and-export/default, retrain-on-new-data/scheduled)
# and runs their flow runs on this host's GPUs; one-off: ... train-and-export python -m flows.train_and_export --config X
# scripts/build_image.sh builds the CPU image with buildah from a locally made Debian base and runs the default flow in it.
ARG BASE=nvidia/cuda:12.8.1-devel-ubuntu24.04
FROM ${BASE}
ARG TAE_ACCEL=cuda
ARG CUDA_ARCHS="80;86;89;90"
# PIP_FIND_LINKS: a folder of wheels in the build context (e.g. the CPU torch wheel where no index serves it)
ARG PIP_FIND_LINKS=""
# TAE_CACHE_DIR: install.sh's cache (the llama-cpp-python sdist, its built wheel, the converter); one in the build
# context is used instead of downloading and building again
ARG TAE_CACHE_DIR=/root/.cache/train-and-export
# PIP_CERT: a CA bundle in the build context, where a TLS-inspecting proxy stands between the build and PyPI
ARG PIP_CERT

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    TAE_ACCEL=${TAE_ACCEL} CUDA_ARCHS=${CUDA_ARCHS} PIP_FIND_LINKS=${PIP_FIND_LINKS} TAE_CACHE_DIR=${TAE_CACHE_DIR} \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential cmake git ca-certificates \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . /app
# The CUDA toolkit's stub libcuda lets llama.cpp link without a GPU; the runtime library is checked at container
# start (scripts/entrypoint.sh), where the driver is.
RUN python3 -m venv /opt/venv \
    && LIBRARY_PATH=/usr/local/cuda/lib64/stubs bash scripts/install.sh

ENTRYPOINT ["scripts/entrypoint.sh"]
CMD ["python", "-m", "flows.deploy", "serve", "--config", "configs/default.yaml"]
