"""Where a base model's files are: a local directory, or a model already in the Hugging Face cache (never a
download). Ground floor: the config's input check, the architecture read and every stage find the model here."""

from __future__ import annotations

import os
from pathlib import Path

from stages.errors import ModelError


def resolve_model_dir(name_or_path: str) -> Path:
    """A local model directory for `name_or_path`, or a ModelError saying how to get one."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"{p.resolve()} has no config.json; point it at a Hugging Face model directory")
        if not any(p.glob("*.safetensors")):
            raise ModelError(
                f"{p.resolve()} has no *.safetensors weights (found: {sorted(x.name for x in p.iterdir())}); "
                "only safetensors are loaded: convert the checkpoint with `save_pretrained(..., safe_serialization=True)`"
            )
        return p
    if "/" in name_or_path and not p.exists():
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(name_or_path, local_files_only=True, allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt"]))
        except Exception:
            pass
    raise ModelError(
        f"'{name_or_path}' is neither a local directory nor a model in the HF cache "
        f"({os.environ.get('HF_HUB_CACHE', '~/.cache/huggingface/hub')}); download it beforehand "
        f"(`hf download {name_or_path}`) or set model.name_or_path to a local directory"
    )
