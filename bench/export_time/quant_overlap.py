"""Does running the two K-quantizations at once shorten the export? (issue 5's < 3 min goal)

    PYTHONPATH=.:$CONVERTER/gguf-py python3 bench/export_time/quant_overlap.py --out $OUT/quant_overlap.json

R7's shapes (random bf16 weights, Llama architecture as in bench/export_time/export_r7.py) converted to
f16 GGUF with the official converter, then, in the same run on the same file:
  sequential  Q4_K_M then Q5_K_S, all cores each (what stages/export/stage.py does)
  concurrent  both at once, half the cores each
llama_model_quantize is CPU work in any build of llama.cpp, so the CPU wheel suffices.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.export_time.export_r7 import make_model  # noqa: E402
from stages.quants import TYPES  # noqa: E402
from stages.export import llamacpp  # noqa: E402

QUANTS = ("Q4_K_M", "Q5_K_S")


def quantize_all(base: Path, work: Path, threads: int, concurrent: bool) -> dict:
    errors: dict[str, str] = {}
    seconds: dict[str, float] = {}

    def one(q: str) -> None:
        t = time.perf_counter()
        try:
            llamacpp.quantize(base, work / f"{q}.gguf", TYPES[q].ftype, threads)
        except Exception as e:  # a failed quantization must not read as a fast one
            errors[q] = f"{type(e).__name__}: {e}"
        seconds[q] = round(time.perf_counter() - t, 1)

    t = time.perf_counter()
    if concurrent:
        jobs = [threading.Thread(target=one, args=(q,)) for q in QUANTS]
        for j in jobs:
            j.start()
        for j in jobs:
            j.join()
    else:
        for q in QUANTS:
            one(q)
    row = {"threads_each": threads, "wall_s": round(time.perf_counter() - t, 1), "per_file_s": seconds,
           "mib": {q: round((work / f"{q}.gguf").stat().st_size / 2**20, 1) for q in QUANTS if (work / f"{q}.gguf").is_file()}}
    for q in QUANTS:
        (work / f"{q}.gguf").unlink(missing_ok=True)
    return row | ({"errors": errors} if errors else {})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="r7-llama")
    ap.add_argument("--work", type=Path, default=Path("/tmp/quant-overlap"))
    a = ap.parse_args()
    cores = os.cpu_count() or 2
    report: dict = {"shape": a.shape, "cores": cores, "llama_cpp_python": llamacpp.runtime_version()}

    def save() -> None:
        a.out.write_text(json.dumps(report, indent=1))

    t = time.perf_counter()
    model = make_model(a.shape, a.work / "models")
    report["setup_s"] = round(time.perf_counter() - t, 1)
    base = a.work / "model-f16.gguf"
    t = time.perf_counter()
    subprocess.run([sys.executable, str(llamacpp.converter_dir() / "convert_hf_to_gguf.py"), str(model), "--outfile", str(base),
                    "--outtype", "f16"], check=True, stdout=subprocess.DEVNULL)
    report["convert_f16_s"] = round(time.perf_counter() - t, 1)
    save()
    for name, threads, concurrent in [("sequential", cores, False), ("concurrent", max(1, cores // 2), True)]:
        report[name] = quantize_all(base, a.work, threads, concurrent)
        print(name, report[name], flush=True)
        save()
    report["concurrent_vs_sequential"] = round(report["concurrent"]["wall_s"] / report["sequential"]["wall_s"], 3)
    save()


if __name__ == "__main__":
    main()
