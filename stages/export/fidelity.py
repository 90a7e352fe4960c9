"""How far each GGUF drifted from the merged model: next-token KL divergence and top-1 agreement.

On held-out chat texts (token ids identical on both sides: export checks tokenization
first), the merged HF model's next-token distribution P is compared at every position with
each GGUF's Q, computed by llama.cpp itself (`logits_all`): mean KL(P || Q) and the fraction
of positions where both pick the same token. The unquantized GGUF is a conversion check
and must agree almost everywhere; the quantized files get configurable thresholds
(`export.fidelity`). For scale, llama.cpp reports on Llama-3-8B a mean KLD of 0.031 and
91.9% top-1 at Q4_K_M, 0.017 at Q5_K_S.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from stages import data, memory
from stages.config import FidelitySection
from stages.errors import UserError
from stages.export.llamacpp_process import LlamaProcess

# Full-vocabulary float32 log-probs are kept per position (152k vocab: 0.6 MB each), and
# llama.cpp's logits_all holds n_ctx x vocab: each text is cut to this many tokens.
MAX_TOKENS = 512


def held_out_ids(cfg, tokenizer, n: int, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Token ids of `n` held-out chat texts, as training tokenized them, each cut to `max_tokens`."""
    return [tokenizer(t, add_special_tokens=False)["input_ids"][:max_tokens] for t in data.held_out_texts(cfg, tokenizer, n)]


class FidelityError(UserError, RuntimeError):
    """A GGUF drifted further from the merged model than export.fidelity allows."""


@dataclass
class Fidelity:
    quant: str
    file: str
    positions: int
    mean_kl: float
    p99_kl: float
    top1_agreement: float
    max_mean_kl: float
    min_top1: float
    passed: bool


def log_probs(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Next-token log-probabilities (float32, positions x vocab, on CPU) of an HF model per sequence."""
    model.eval()
    out = []
    with torch.no_grad():
        for ids in sequences:
            logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0].float()
            out.append(torch.log_softmax(logits, dim=-1).cpu())
    return out


def load_merged(merged_dir: Path):
    """The merged HF model as the export measures it: its compute dtype, on this process's device."""
    from transformers import AutoModelForCausalLM

    from stages.model.load import attention_of_dir, compute_dtype, device

    return AutoModelForCausalLM.from_pretrained(merged_dir, dtype=compute_dtype("auto"), device_map={"": str(device())},
                                                use_safetensors=True, attn_implementation=attention_of_dir(merged_dir))


# Q's top token agrees with P where P gives it within this much of P's top log-probability: at a position where P's
# two likeliest tokens all but tie, which of them comes first is rounding. Counted as a disagreement, an adapter
# applied at run time by llama.cpp measured top-1 94.9% against the merged GGUF at a mean KL of 7e-6 (a tiny model,
# its prompt positions near-flat).
TIE_NATS = 1e-2


def compare(p_logs: list[torch.Tensor], q_logs: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """Per-position KL(P || Q) over all sequences, and the top-1 agreement (ties in P within TIE_NATS agree)."""
    kls, agree = [], 0
    for p, q in zip(p_logs, q_logs, strict=True):
        vocab = min(p.shape[-1], q.shape[-1])  # a GGUF vocabulary may be padded
        p, q = p[:, :vocab], torch.log_softmax(q[:, :vocab], dim=-1)
        kls.append((p.exp() * (p - q)).sum(-1).clamp_min(0))
        picked = p.gather(-1, q.argmax(-1, keepdim=True))[:, 0]
        agree += int((picked >= p.max(-1).values - TIE_NATS).sum())
    kl = torch.cat(kls)
    return kl, agree / kl.numel()


def measure(quant: str, gguf: Path, sequences: list[list[int]], ref: list[torch.Tensor], limits: FidelitySection,
            llm: LlamaProcess | None = None) -> Fidelity:
    """KL(P_hf || Q_gguf) and top-1 agreement of `gguf` over every position of `sequences`.

    llm: a llama.cpp process to load it in (one serves every file of an export: each load frees the model before);
    None starts one for this file."""
    if llm is None:
        with LlamaProcess(gguf.name) as own:  # llama.cpp never shares this (torch) process: see llamacpp_process
            return measure(quant, gguf, sequences, ref, limits, own)
    llm.what = gguf.name  # named if the process dies
    llm.call("load", str(gguf), n_ctx=max(len(s) for s in sequences), logits_all=True, n_gpu_layers="all")
    q_logs = [torch.from_numpy(llm.call("scores", ids)).float() for ids in sequences]
    kl, top1 = compare(ref, q_logs)
    max_kl, min_top1 = limits.thresholds(quant)
    mean = float(kl.mean())
    return Fidelity(quant, gguf.name, kl.numel(), round(mean, 6), round(float(kl.quantile(0.99)), 6), round(top1, 4),
                    max_kl, min_top1, passed=mean <= max_kl and top1 >= min_top1)


def gate(results: list[Fidelity]) -> None:
    bad = [r for r in results if not r.passed]
    if bad:
        raise FidelityError("; ".join(
            f"{r.file}: mean KL {r.mean_kl:.4f} (max {r.max_mean_kl}), top-1 agreement {r.top1_agreement:.1%} "
            f"(min {r.min_top1:.0%}) over {r.positions} positions" for r in bad)
            + ". Nothing was handed off. A quantized file that drifts this far needs a larger type (e.g. Q5_K_M, Q8_0 "
            "in export.quant_types); an unquantized one means the conversion is broken; thresholds: export.fidelity")
