"""Random-init models with the tokenizer files their family's releases ship, for the families test
(tests/test_families.py), the released configs (bench/released_configs: their header-only checkpoints and their
narrow copies) and the family sweeps under bench/.

The tokenizer is one of the embedded assets: SentencePiece (assets/tiny-llama) or byte-level BPE (assets/tiny-chatml),
written as the family's releases write it: a tokenizer.json beside tokenizer.model where transformers reads the
model_type with a generic class, Phi-3's own special tokens, Gemma's `legacy: false`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WITH_TOKENIZER_JSON = {"mistral", "mixtral", "phi3"}   # transformers reads these model_types with a generic class
PHI3_TOKENS = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]   # llama.cpp's Phi-3 loader looks these up


def tokenizer_files(model_type: str, asset: str, out: Path, *, released: bool = True) -> tuple[int, dict]:
    """The asset's tokenizer files in `out` as a `model_type` release ships them (released=False: the asset's files
    only); returns the vocabulary size and the special token ids a config.json of that model takes."""
    from transformers import AutoTokenizer

    src = REPO / "assets" / asset
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    ids = json.loads((src / "config.json").read_text())
    vocab = ids["vocab_size"]
    if released and model_type in WITH_TOKENIZER_JSON and (src / "tokenizer.model").is_file():
        tok = AutoTokenizer.from_pretrained(src)
        if model_type == "phi3":
            tok.add_special_tokens({"additional_special_tokens": PHI3_TOKENS})
        tok.save_pretrained(out)   # tokenizer.json beside the copied tokenizer.model
        vocab = len(tok)
    if model_type.startswith("gemma"):   # Gemma's GGUF has no word-start space after special tokens, nor has its tokenizer
        tc = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps(tc | {"legacy": False}))
    special = {k: ids[k] for k in ("bos_token_id", "eos_token_id") if ids.get(k) is not None}
    return vocab, special | {"pad_token_id": ids.get("pad_token_id") or 0}


def random_model(model_type: str, values: dict, asset: str, out: Path, *, released_tokenizer: bool = True) -> Path:
    """A random-init (seed 0) `model_type` model of config `values` in `out`, its vocabulary and special token ids the
    asset tokenizer's (whatever `values` says)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab, special = tokenizer_files(model_type, asset, out, released=released_tokenizer)
    config = AutoConfig.for_model(model_type, **values | special | {"vocab_size": vocab})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out
