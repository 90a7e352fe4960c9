"""The stages of train-and-export: plain functions with typed inputs and results, no Prefect."""

import logging

# bitsandbytes warns at import on every CPU-only machine that an optional accelerated NF4 kernel
# package (`kernels`) is absent; NF4 runs without it. Errors from it still show.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
