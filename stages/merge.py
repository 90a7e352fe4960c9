"""Merge the trained adapter into a 16-bit base and save a standalone model.

    python -m stages.merge --config configs/default.yaml --adapter artifacts/runs/<id>/train/adapter --out DIR

Never into 4-bit weights: rounding would swallow the update. For QLoRA two 16-bit bases
are candidates (the original weights, or the NF4 weights the adapter trained against,
dequantized); both are measured against the adapter on NF4 and the closer one is kept
(`merge.base`). The merged model is saved as safetensors in the base model's own dtype,
with its tokenizer (including the SentencePiece model the GGUF converter reads), chat
template and generation config.

Every merge is checked before saving: its logits must equal the unmerged adapter's on the
same base (up to dtype rounding), so a broken merge stops here, not with the serving team.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import PeftModel

from stages import errors, inputs, memory, result_files
from stages.artifact import Artifact
from stages.config import RunConfig
from stages.errors import MissingInput
from stages.export import fidelity
from stages.memory import MemoryReport
from stages.model.directory import config_json, resolve_model_dir
from stages.model.experts import lora as expert_lora
from stages.model.experts import nf4 as expert_nf4
from stages.model.experts import structure
from stages.model.load import load_base, load_tokenizer

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
KL_TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@dataclass
class MergeResult:
    merged_dir: Path
    save_dtype: str
    max_abs_logit_diff: float   # merged vs adapter-on-the-same-base, before casting to save_dtype
    memory: MemoryReport | None
    skipped: bool = False
    base: str = "16bit"         # what the adapter was merged into: 16bit or dequantized-nf4
    # QLoRA: mean KL(adapter on the NF4 base it trained with || merged) per choice, and top-1 agreement
    kl: dict = field(default_factory=dict)

    def artifacts(self) -> list[Artifact]:
        return []  # its figures are in the merge's memory table and the hand-off manifest


def run(cfg: RunConfig, adapter_dir: Path, out_dir: Path) -> MergeResult:
    """Merge `adapter_dir` into the base model and save it to <out_dir>/model.

    LoRA: into the 16-bit base. QLoRA: the adapter learned against the NF4-rounded base, so
    two merges are candidates: into the original 16-bit weights, or into the NF4 weights
    dequantized to 16 bits. Both are compared with the adapter running on the NF4 base (the
    model training actually produced) on held-out texts; `merge.base: auto` keeps the
    closer one, and both figures are recorded. Never into 4-bit weights: rounding would
    swallow the update.
    """
    out_dir, adapter_dir = Path(out_dir), Path(adapter_dir)
    merged_dir = out_dir / "model"
    if (done := result_files.load_if_done(out_dir, "merge", MergeResult)) is not None:
        print(f"merge: already merged in {merged_dir}; skipping")
        return done
    if not (adapter_dir / "adapter_config.json").is_file():
        raise MissingInput(
            f"{adapter_dir.resolve()} holds no adapter (adapter_config.json missing); point --adapter at the "
            "`adapter` directory written by the train stage (artifacts/runs/<run-id>/train/adapter)"
        )

    base_dir = resolve_model_dir(cfg.model.name_or_path)
    save_dtype = _checkpoint_dtype(base_dir)
    tokenizer = load_tokenizer(cfg.model)
    # full-vocabulary log-probs are kept per position: held-out texts cut to the fidelity check's length
    sequences = fidelity.held_out_ids(cfg, tokenizer, cfg.merge.samples, min(cfg.data.max_length, fidelity.MAX_TOKENS))
    kl: dict = {}
    with memory.track("merge", out_dir) as meter:
        qlora = cfg.quantization.load_in_4bit
        choices = ["16bit"] if not qlora else (["16bit", "dequantized-nf4"] if cfg.merge.base == "auto" else [cfg.merge.base])
        if qlora:
            with structure.peft_targets_as_given():
                trained = PeftModel.from_pretrained(load_base(cfg.model, cfg.quantization), adapter_dir)
            expert_lora.use_grouped_lora(trained)   # NF4 expert stacks compute through the grouped path only
            reference = fidelity.log_probs(trained, sequences)
            del trained
            memory.free_gpu()
        for choice in choices:
            merged, diff = _merge(cfg, adapter_dir, choice, sequences)
            if qlora:
                d, top1 = fidelity.compare(reference, fidelity.log_probs(merged, sequences))
                kl[choice] = {"mean_kl": round(float(d.mean()), 8), "top1_agreement": round(top1, 4)}
                print(f"merge: into the {choice} base: mean KL {kl[choice]['mean_kl']:.3g} to the adapter on NF4, top-1 {top1:.1%}")
            if choice != choices[-1]:
                del merged  # one 16-bit model in memory at a time (two would double the peak: 32 GiB on a 7B)
                memory.free_gpu()
        best = min(kl, key=lambda k: kl[k]["mean_kl"]) if kl else choices[-1]
        if best != choice:  # the earlier candidate won: drop the later one, build the winner again
            del merged
            memory.free_gpu()
            merged, diff = _merge(cfg, adapter_dir, best, sequences)
        choice = best
        errors.inject("merge-save")  # a library's write that names no file, as safetensors' does
        merged.to(save_dtype).save_pretrained(merged_dir, safe_serialization=True)
        meter.extra |= {"max_abs_logit_diff": diff, "base": choice, "kl": kl}
    save_tokenizer(tokenizer, base_dir, merged_dir)
    keep_release_names(base_dir, merged_dir)
    if (base_dir / "generation_config.json").is_file():
        shutil.copy2(base_dir / "generation_config.json", merged_dir / "generation_config.json")
    result = MergeResult(merged_dir, str(save_dtype).removeprefix("torch."), diff, meter.report, base=choice, kl=kl)
    result_files.save(out_dir, "merge", result)
    return result


def keep_release_names(base_dir: Path, merged_dir: Path) -> None:
    """The base's `architectures` (and `auto_map`) in the merged config.json. save_pretrained writes transformers' class
    name, which is not always the release's (Phi-3.5-MoE: PhimoeForCausalLM for PhiMoEForCausalLM), and llama.cpp's
    converter knows the release's: the preflight checked the base's name, the export must meet the same one."""
    base, merged, path = config_json(base_dir), config_json(merged_dir), merged_dir / "config.json"
    kept = {k: base[k] for k in ("architectures", "auto_map") if k in base}
    if any(merged.get(k) != v for k, v in kept.items()):
        path.write_text(json.dumps(merged | kept, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _merge(cfg: RunConfig, adapter_dir: Path, choice: str, sequences: list[list[int]]):
    """The adapter merged into the 16-bit base or the dequantized NF4 base; checked against
    the unmerged adapter on that same base (a broken merge stops here)."""
    if choice == "16bit":
        base = load_base(cfg.model, cfg.quantization, quantized=False)
    else:
        base = load_base(cfg.model, cfg.quantization, quantized=True)
        expert_nf4.dequantize_all(base)   # transformers' dequantize() knows the linear layers only
        base = base.dequantize()
    with structure.peft_targets_as_given():
        model = PeftModel.from_pretrained(base, adapter_dir)
    model.eval()
    probe = {"input_ids": torch.tensor([sequences[0]], device=model.device)}
    with torch.no_grad():
        before = model(**probe).logits.float()
        merged = model.merge_and_unload()
        after = merged(**probe).logits.float()
    diff = (before - after).abs().max().item()
    # Rounding in a 16-bit merge moves a 7B's logits by up to 0.36 and its next-token
    # distribution by KL 0.002 (measured, a random r=64 adapter): judge the merge by KL,
    # which a wrong scale or a missed module inflates by orders of magnitude.
    kl = float(fidelity.compare([torch.log_softmax(before[0], -1)], [after[0]])[0].mean())
    tol = KL_TOLERANCE.get(merged.dtype, 1e-3)
    if kl > tol:
        raise RuntimeError(f"merged model's next-token distribution differs from the adapter's by KL {kl:.3g} (> {tol}; "
                           f"max |logit diff| {diff:.3g}) on the {choice} base; the merge is broken")
    return merged, diff


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
    cfg = config_json(model_dir)
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return getattr(torch, name) if name in ("bfloat16", "float16", "float32") else torch.bfloat16


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Merge a LoRA adapter into its 16-bit base (a stage of train-and-export).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--adapter", type=Path, required=True, help="the train stage's adapter directory")
    ap.add_argument("--out", type=Path, required=True, help="stage directory; the model goes to <out>/model")
    a = ap.parse_args(argv)
    r = run(inputs.load(a.config), a.adapter, a.out)
    print(f"merged model: {r.merged_dir} ({r.save_dtype}, max |logit diff| {r.max_abs_logit_diff:.2e})")


if __name__ == "__main__":
    import sys

    from stages.errors import run_cli

    sys.exit(run_cli(main, "merge"))
