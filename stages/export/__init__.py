"""The export stage: GGUF conversion (convert.py) and quantization with its checks (stage.py, quant_types.py,
fidelity.py, imatrix.py), llama.cpp (llamacpp.py, and llamacpp_process.py, its torch-free child process), the
served endpoint (serving.py) and the model card (modelcard.py). Merge and smoke are stages of their own
(stages/merge.py, stages/smoke.py) that use these pieces.

    from stages import export
    result = export.run(cfg, merged_dir, out_dir)   # python -m stages.export --config ...

The export stage's API is stage.py's, loaded on first use: `python -m stages.export.llamacpp_process`
imports this package and must not import torch (llama.cpp's CUDA build crashes in a process that has).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["ExportResult", "GgufFile", "measure_fidelity", "check_quant_types", "main", "quant_summary", "run"]

if TYPE_CHECKING:
    from stages.export.stage import (
        ExportResult,
        GgufFile,
        measure_fidelity,
        check_quant_types,
        main,
        quant_summary,
        run,
    )


def __getattr__(name: str):
    if name in __all__:
        from stages.export import stage

        return getattr(stage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
