"""Which process state makes a CUDA build of llama.cpp crash while loading a model?

    python bench/llama_cuda/llama_gpu_diag.py MODEL.gguf --out diag.json

On the H200 the export's fidelity check segfaulted inside llama_model_load_from_file (in
print_info, right after torch had run the reference on the GPU in the same process). Each
case below loads `MODEL.gguf` fully onto the GPU and evaluates 8 tokens in a fresh
interpreter, after a different set of imports; exit code -11 means SIGSEGV.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

LOAD = """
import llama_cpp
llm = llama_cpp.Llama(model_path={path!r}, n_gpu_layers={ngl}, n_ctx=64, verbose=False)
llm.eval(list(range(1, 9)))
print("ok", llm.scores[7][:3].tolist())
"""

CASES = {
    "llama_cpp_alone": "",
    "llama_cpp_alone_cpu_layers": None,  # same, n_gpu_layers=0
    "after_import_torch": "import torch\n",
    "after_torch_cuda_init": "import torch\ntorch.ones(1, device='cuda').sum().item()\n",
    "after_transformers_sentencepiece_protobuf": "import transformers, sentencepiece, google.protobuf\n",
    "after_torch_cuda_and_transformers": "import torch, transformers\ntorch.ones(1, device='cuda').sum().item()\n",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    results = {}
    for name, prelude in CASES.items():
        code = (prelude or "") + LOAD.format(path=a.gguf, ngl=0 if prelude is None else -1)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True, timeout=300)
        results[name] = {"exit": p.returncode, "s": round(time.perf_counter() - t0, 1),
                         "stdout": p.stdout.strip()[-200:], "stderr_tail": p.stderr.strip()[-600:]}
        print(name, p.returncode, p.stdout.strip()[-80:], flush=True)
    json.dump(results, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
