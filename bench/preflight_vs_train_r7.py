"""The preflight estimate against the training stage's own GPU defaults (CPU; no GPU needed).

    python bench/preflight_vs_train_r7.py      # -> bench/results/preflight_vs_train_r7.json

The estimate's coefficients were fitted on the preflight grid, measured before activation
offload, host embeddings, Liger RMSNorm/SwiGLU, the tiled MLP and the 8-bit default
existed. Here it is compared with the stage rows of bench/results/train_r7_raw_run{3,4}.json
(same R7 shapes and LoRA), each row's settings as that run had them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from preflight_grid import SHAPES  # noqa: E402

from stages import preflight  # noqa: E402
from stages.config import RunConfig  # noqa: E402

# (run file, row name, mode, seq) -> training settings that row ran with
ROWS = [
    ("train_r7_raw_run4.json", "stage (defaults: fit memory)", "qlora", 4096, {}),
    ("train_r7_raw_run4.json", "ablation: embeddings on the GPU", "qlora", 4096, {"offload_embeddings": "off"}),
    ("train_r7_raw_run3.json", "ablation: no activation offload", "qlora", 4096, {"offload_embeddings": "off", "offload_activations": "off"}),
    ("train_r7_raw_run4.json", "stage (defaults: fit memory)", "bf16", 4096, {}),
    ("train_r7_raw_run4.json", "ablation: embeddings on the GPU", "bf16", 4096, {"offload_embeddings": "off"}),
    ("train_r7_raw_run3.json", "stage long context (24 GiB cap)", "qlora", 65536, {"offload_embeddings": "off", "tiled_mlp": "off"}),
    ("train_r7_raw_run3.json", "stage long context (24 GiB cap)", "qlora", 98304, {"offload_embeddings": "off"}),
    ("train_r7_raw_run3.json", "stage long context (24 GiB cap)", "qlora", 131072, {"offload_embeddings": "off"}),
    ("train_r7_raw_run3.json", "stage long context (24 GiB cap)", "qlora", 163840, {"offload_embeddings": "off"}),
]


def main() -> None:
    shapes = preflight.Shapes.from_config(dict(SHAPES["qwen2-7b"]))
    out = []
    for run, name, mode, seq, training in ROWS:
        raw = json.loads((REPO / "bench" / "results" / run).read_text())["rows"]
        tiled = training.get("tiled_mlp") != "off" if seq > 4096 else None
        row = next(r for r in raw if r["name"] == name and r.get("mode") == mode and r.get("seq") == seq
                   and (tiled is None or r.get("tiled_mlp") == tiled))
        mb = row["micro_batch"]
        cfg = RunConfig.model_validate({
            "model": {"name_or_path": "/x", "torch_dtype": "bfloat16"},
            "data": {"train_file": "x.jsonl", "max_length": seq},
            "lora": {"r": 64, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj", "o_proj"], "lora_dropout": 0.05},
            "quantization": {"load_in_4bit": mode == "qlora"},
            "training": {"per_device_train_batch_size": mb, **training},
            "handoff": {"model_name": "b"},
        })
        est = preflight.estimate(cfg, shapes, seq, on_gpu=True).total_gib
        out.append({"run": run, "name": name, "mode": mode, "seq": seq, "micro_batch": mb, "settings": training,
                    "estimate_gib": round(est, 3), "measured_gib": row["peak_reserved_gib"],
                    "error": round(est / row["peak_reserved_gib"] - 1, 3)})
        print(f"{mode:5s} {seq:6d} x {mb} {name[:40]:40s} est {est:6.2f} measured {row['peak_reserved_gib']:6.2f} {out[-1]['error']:+.1%}")
    (REPO / "bench" / "results" / "preflight_vs_train_r7.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
