"""The train stage (stage.py) and its pieces: the model (model.py), micro-batches (batches.py, packing.py),
attention and kernels, offloads, the Trainer (hf_trainer.py), what a CUDA OOM leads to (oom.py), eval loss,
tracking, plots, the fit choice (autofit.py), the multi-process launcher (launch.py), FSDP (sharding.py) and the
analytic memory model (memory_model.py: the estimate the preflight and the plan for the card read).

    from stages import train
    result = train.run(cfg, out_dir)        # python -m stages.train --config ...

The stage's API is stage.py's and oom.py's, loaded on first use: the preflight and the memory model read a few
pieces (packing, eval_loss, kernels) without loading the Trainer, peft and accelerate with them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["TrainOOMError", "TrainResult", "choose_fit", "evaluation", "halve_micro_batch", "is_dataloader_shm_error", "main",
           "postmortem", "run"]

if TYPE_CHECKING:
    from stages.train.oom import TrainOOMError, halve_micro_batch, is_dataloader_shm_error, postmortem
    from stages.train.stage import TrainResult, choose_fit, evaluation, main, run

_IN_OOM = {"TrainOOMError", "halve_micro_batch", "is_dataloader_shm_error", "postmortem"}  # the rest is stage.py's


def __getattr__(name: str):
    if name in _IN_OOM:
        from stages.train import oom

        return getattr(oom, name)
    if name in __all__:
        from stages.train import stage

        return getattr(stage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
