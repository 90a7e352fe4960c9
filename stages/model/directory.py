"""Where a base model's files are: a local directory, or a model already in the Hugging Face cache (never a
download). Ground floor: the config's input check, the architecture read and every stage find the model here."""

from __future__ import annotations

import json
import os
from pathlib import Path

from stages.errors import ModelError


GGUF_MAGIC = b"GGUF"


def resolve_model_dir(name_or_path: str) -> Path:
    """A local model directory for `name_or_path`, or a ModelError saying how to get one."""
    p = Path(name_or_path).expanduser()
    if p.is_file() or (not p.exists() and p.suffix.lower() == ".gguf"):
        raise ModelError(_not_a_directory(p))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(_no_config(p))
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


def config_text(model_dir: Path | str) -> str:
    """A model directory's config.json, the one place the stages read it (the architecture, the estimate, the model
    checks, merge and export take what they need of it through here)."""
    return (Path(model_dir) / "config.json").read_text(encoding="utf-8")


def config_json(model_dir: Path | str) -> dict:
    return json.loads(config_text(model_dir))


def language_config(model_dir: Path | str) -> dict:
    """config.json's language-model part: a multimodal checkpoint keeps it under text_config (its vocab_size, token
    ids), a text-only one at the top."""
    config = config_json(model_dir)
    return config.get("text_config") or config


def vocab_rows(model_dir: Path | str) -> int | None:
    """The rows of the model's token embedding as config.json gives them (vocab_size), None where it does not."""
    return language_config(model_dir).get("vocab_size")


HF_DIRECTORY = "the Hugging Face model directory (config.json, *.safetensors and the tokenizer files)"


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        return path.suffix.lower() == ".gguf"
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def _not_a_directory(p: Path) -> str:
    """A file given where a model directory goes: a GGUF (what llama.cpp serves, often what a user has of a model) is
    said to be one, since its fix is not "download it" but the checkpoint it was made from."""
    if _is_gguf(p):
        return (f"{p.resolve()} {'is' if p.exists() else 'names (and it does not exist)'} a GGUF file: a quantized inference file "
                "for llama.cpp, not a trainable checkpoint (its weights are rounded to a few bits and packed, and transformers does "
                f"not train on it); set model.name_or_path to {HF_DIRECTORY} it was made from, or that model's Hugging Face id if it "
                "is in the local cache")
    return (f"{p.resolve()} is a file, not a model directory; set model.name_or_path to {HF_DIRECTORY}"
            + (f", e.g. {p.parent.resolve()}, which holds it" if (p.parent / "config.json").is_file() else ""))


def _no_config(p: Path) -> str:
    """A directory without config.json: a PEFT adapter (an earlier run's train/adapter, a checkpoint) and a folder of
    GGUF files are named as what they are, with the model to give instead."""
    if (p / "adapter_config.json").is_file():
        try:
            base = json.loads((p / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (UnicodeDecodeError, ValueError, AttributeError):
            base = None
        trained_on = f"trained on top of {base}" if base else "trained on top of a base model its adapter_config.json does not name"
        return (f"{p.resolve()} is a PEFT adapter (adapter_config.json, adapter weights), not a base model: it holds only the low-rank "
                f"update {trained_on}, and cannot be trained on as a base; set model.name_or_path to "
                + (f"that base, {base}" if base else "the base model it was trained on")
                + " (to build on what the adapter learned, merge it into that base first with `python -m stages.merge --adapter "
                f"{p.resolve()} ...` and give the merged model directory)")
    ggufs = sorted(x.name for x in p.glob("*.gguf"))
    if ggufs:
        return (f"{p.resolve()} holds GGUF files ({', '.join(ggufs[:3])}{', ...' if len(ggufs) > 3 else ''}) and no config.json: GGUFs are "
                f"quantized inference files for llama.cpp, not trainable checkpoints; set model.name_or_path to {HF_DIRECTORY} they were "
                "made from")
    return f"{p.resolve()} has no config.json; point it at {HF_DIRECTORY}"
