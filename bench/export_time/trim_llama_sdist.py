"""Trim the pinned llama-cpp-python sdist so it fits the GPU host's 64 MiB upload.

    python bench/export_time/trim_llama_sdist.py ~/.cache/train-and-export/llama_cpp_python-0.3.36.tar.gz .sdist/llama_cpp_python-0.3.36.tar.gz

Dropped: a stray .git pack (38 MB), llama.cpp's docs, test vocabularies (models/), tests,
benches, media, CI files, examples and tools (built with -DLLAMA_BUILD_TOOLS=OFF
-DLLAVA_BUILD=OFF), and the sources of backends this build does not use (Vulkan,
Metal, SYCL, CANN, ...). Kept: everything the CUDA/CPU build, the converter
(convert_hf_to_gguf.py, conversion/, gguf-py/) and the Python package need.
"""

from __future__ import annotations

import re
import sys
import tarfile

DROP = re.compile(
    r"^[^/]+/(\.git/|vendor/llama\.cpp/(\.git|\.github/|\.devops/|docs/|models/|tests/|benches/|media/|pocs/|ci/|app/|"
    r"examples/|tools/|ggml/src/ggml-(vulkan|metal|sycl|cann|opencl|musa|hip|webgpu|zdnn|kompute|openvino|zendnn|hexagon|virtgpu)/))"
)


def main(src: str, dst: str) -> None:
    kept = dropped = 0
    with tarfile.open(src) as tin, tarfile.open(dst, "w:gz", compresslevel=9) as tout:
        for m in tin.getmembers():
            if DROP.match(m.name):
                dropped += 1
                continue
            kept += 1
            tout.addfile(m, tin.extractfile(m) if m.isfile() else None)
    print(f"kept {kept} members, dropped {dropped}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
