#!/usr/bin/env bash
# Build the CPU image here, with buildah (no Docker engine, no registry: the Debian base is made locally with
# mmdebstrap), then run the default flow inside it and check both GGUFs answer 50/50.
#   bash scripts/build_image.sh            (needs root, Debian's buildah and mmdebstrap; apt-get install buildah mmdebstrap)
# Logs: $TAE_IMAGE_WORK/build.log and run.log (default /var/tmp/tae-image). The CUDA image is the same Dockerfile with
# its defaults (`docker build .` on a machine that can pull nvidia/cuda); only its build, not its run, needs no GPU.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${TAE_IMAGE_WORK:-/var/tmp/tae-image}
BASE=localhost/tae-debian-bookworm
TAG=localhost/train-and-export:cpu
CACHE=${TAE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/train-and-export}
mkdir -p "$WORK"
log() { printf '[image %(%H:%M:%S)T] %s\n' -1 "$*"; }
t0=$SECONDS

if ! buildah images -q "$BASE" >/dev/null 2>&1; then
  log "1/4 Debian bookworm base with mmdebstrap"
  mmdebstrap --variant=minbase --include=ca-certificates bookworm "$WORK/base.tar" http://deb.debian.org/debian >"$WORK/base.log" 2>&1
  ctr=$(buildah from scratch)
  buildah add "$ctr" "$WORK/base.tar" / >/dev/null
  buildah commit -q "$ctr" "$BASE" >/dev/null
  buildah rm "$ctr" >/dev/null
fi

log "2/4 build context: the CPU torch wheel and install.sh's cache, where this machine has them"
rm -rf "$REPO/.image" && mkdir -p "$REPO/.image/wheels" "$REPO/.image/cache"
cp /opt/wheels/torch-*-cp311-*.whl "$REPO/.image/wheels/" 2>/dev/null || true
cp -r "$CACHE"/llama_cpp_python-*.tar.gz "$CACHE"/wheels-cpu "$CACHE"/llama-cpp-converter-* "$REPO/.image/cache/" 2>/dev/null || true
# this machine reaches PyPI through a TLS-inspecting proxy whose CA only its own bundle holds
cert=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
if [ -f "$cert" ]; then cp "$cert" "$REPO/.image/ca.crt"; else cert=; fi

log "3/4 buildah bud (log: $WORK/build.log)"
s=$SECONDS
buildah bud --isolation chroot --layers=false -f "$REPO/Dockerfile" -t "$TAG" \
  --build-arg BASE="$BASE" --build-arg TAE_ACCEL=cpu \
  --build-arg PIP_FIND_LINKS=/app/.image/wheels --build-arg TAE_CACHE_DIR=/app/.image/cache \
  ${cert:+--build-arg PIP_CERT=/app/.image/ca.crt} \
  "$REPO" >"$WORK/build.log" 2>&1
build_s=$((SECONDS - s))

log "4/4 the default flow inside the image (log: $WORK/run.log)"
s=$SECONDS
ctr=$(buildah from "$TAG")
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
buildah run --isolation chroot "$ctr" -- scripts/entrypoint.sh python -m flows.train_and_export --config configs/default.yaml \
  >"$WORK/run.log" 2>&1
run_s=$((SECONDS - s))
grep -E "smoke: Q4_K_M|smoke: Q5_K_S" "$WORK/run.log"
grep -q "smoke: Q4_K_M 50/50" "$WORK/run.log" && grep -q "smoke: Q5_K_S 50/50" "$WORK/run.log"
log "image $TAG built in ${build_s} s, default flow ran in ${run_s} s inside it; total $((SECONDS - t0)) s"
