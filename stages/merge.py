"""Merge the trained adapter into the 16-bit base and save a standalone model.

    python -m stages.merge --config configs/default.yaml --adapter artifacts/runs/<id>/train/adapter

For QLoRA the adapter is merged into the *unquantised* base: merging into 4-bit weights
would round the update away (and re-quantise the base twice). The merged model is saved
as safetensors in the base model's own dtype, with its tokenizer (including the
SentencePiece model the GGUF converter reads), chat template and generation config.

A check runs before saving: on a few training prompts, the merged model's logits must
equal the adapter-on-base logits (up to dtype rounding); the largest difference is
recorded, so a broken merge stops here instead of in the serving team's hands.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from stages import data, memory
from stages.config import RunConfig, load_config
from stages.memory import MemoryReport
from stages.modelio import load_base, load_tokenizer, resolve_model_dir

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
LOGIT_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}


@dataclass
class MergeResult:
    merged_dir: Path
    save_dtype: str
    max_abs_logit_diff: float   # merged vs adapter-on-base, before casting to save_dtype
    memory: MemoryReport | None
    skipped: bool = False


def run(cfg: RunConfig, adapter_dir: Path, out_dir: Path) -> MergeResult:
    """Merge `adapter_dir` into the base model and save it to <out_dir>/model."""
    from peft import PeftModel

    out_dir, adapter_dir = Path(out_dir), Path(adapter_dir)
    merged_dir = out_dir / "model"
    done = out_dir / "merge_result.json"
    if done.is_file() and (merged_dir / "config.json").is_file():
        print(f"merge: already merged in {merged_dir}; skipping")
        d = json.loads(done.read_text())
        return MergeResult(merged_dir, d["save_dtype"], d["max_abs_logit_diff"], None, skipped=True)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{adapter_dir.resolve()} holds no adapter (adapter_config.json missing); point --adapter at the "
            "`adapter` directory written by the train stage (artifacts/runs/<run-id>/train/adapter)"
        )

    base_dir = resolve_model_dir(cfg.model.name_or_path)
    save_dtype = _checkpoint_dtype(base_dir)
    tokenizer = load_tokenizer(cfg.model)
    with memory.track("merge", out_dir) as meter:
        # Never into 4-bit: the unquantised base, whatever the adapter was trained on.
        model = PeftModel.from_pretrained(load_base(cfg.model, cfg.quantization, quantized=False), adapter_dir)
        model.eval()
        probe = _probe_batch(cfg, tokenizer, model.device)
        with torch.no_grad():
            before = model(**probe).logits.float()
            merged = model.merge_and_unload()
            after = merged(**probe).logits.float()
        diff = (before - after).abs().max().item()
        tol = LOGIT_TOLERANCE.get(merged.dtype, 0.25)
        if diff > tol:
            raise RuntimeError(f"merged logits differ from adapter logits by {diff:.4g} (> {tol}); the merge is broken")
        merged.to(save_dtype).save_pretrained(merged_dir, safe_serialization=True)
        meter.extra["max_abs_logit_diff"] = diff
    save_tokenizer(tokenizer, base_dir, merged_dir)
    if (base_dir / "generation_config.json").is_file():
        shutil.copy2(base_dir / "generation_config.json", merged_dir / "generation_config.json")
    result = MergeResult(merged_dir, str(save_dtype).removeprefix("torch."), diff, meter.report)
    done.write_text(json.dumps({"save_dtype": result.save_dtype, "max_abs_logit_diff": diff}, indent=2))
    return result


def save_tokenizer(tokenizer, base_dir: Path, merged_dir: Path) -> None:
    """The base's own tokenizer files, unchanged; save_pretrained only where one is missing.

    transformers 5 does not write tokenizer.model, but llama.cpp's converter needs it to
    build a SentencePiece vocabulary, so the originals are copied.
    """
    for name in TOKENIZER_FILES:
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, merged_dir / name)
    if not (merged_dir / "tokenizer_config.json").is_file():
        tokenizer.save_pretrained(merged_dir)


def _checkpoint_dtype(model_dir: Path) -> torch.dtype:
    cfg = json.loads((model_dir / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return getattr(torch, name) if name in ("bfloat16", "float16", "float32") else torch.bfloat16


def _probe_batch(cfg: RunConfig, tokenizer, device) -> dict:
    samples = data.read_jsonl(cfg.data.train_file)[:4]
    text = [tokenizer.apply_chat_template(list(s.messages), tokenize=False) for s in samples]
    enc = tokenizer(text, add_special_tokens=False, padding=True, truncation=True, max_length=cfg.data.max_length, return_tensors="pt")
    return {k: v.to(device) for k, v in enc.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Merge a LoRA adapter into its 16-bit base (a stage of train-and-export).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--adapter", type=Path, required=True, help="the train stage's adapter directory")
    ap.add_argument("--out", type=Path, required=True, help="stage directory; the model goes to <out>/model")
    a = ap.parse_args(argv)
    r = run(load_config(a.config), a.adapter, a.out)
    print(f"merged model: {r.merged_dir} ({r.save_dtype}, max |logit diff| {r.max_abs_logit_diff:.2e})")


if __name__ == "__main__":
    main()
