"""The GGUF quantization types export offers, one record each: the schema validates `export.quant_types` and the
fidelity gate's defaults against them, the export quantizes and checks each file by them, the disk check sizes them.
A new type is one record here (plus, where llama.cpp's tensor-type rule has branches for it, their port in
stages/export/quant_types.py, which the export checks every file against)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantType:
    name: str
    ftype: int                 # llama.cpp's LLAMA_FTYPE_MOSTLY_*: the quantizer's argument and the file's general.file_type
    tensor_type: str           # llama_ftype_get_default_type: the type of every matrix no rule of the mix changes
    # quantized with and without an importance matrix, the fidelity gate keeps the closer: where the quantization reads
    # one and the type rule does not change with it (Q8_0 ignores it; Q4_0's first ffn_down layers would change type)
    imatrix: bool
    bits: float                # bits per weight of the mix, output layer included (llama.cpp's sizes for Llama-3-8B)
    fallback_bits: float       # the same where rows are not a multiple of the type's block (the fallback type instead)
    max_mean_kl: float | None = None   # the fidelity gate's default for this type; None: the gate's `default`
    min_top1: float | None = None


# The _M mixes keep about 1/7 of the weights (half the layers' attn_v and ffn_down) in Q6_K; rows not a multiple of 256
# fall back Q4_K -> Q5_0 (5.5 bits), Q5_K -> Q5_1 (6), Q6_K -> Q8_0 (8.5). Q4_0 packs 32 values in 18 bytes (4.5 bits)
# and has no fallback below a 32-value row.
TYPES: dict[str, QuantType] = {t.name: t for t in (
    QuantType("Q4_K_M", 15, "Q4_K", True, 4.89, 5.93, max_mean_kl=0.10, min_top1=0.85),
    QuantType("Q4_K_S", 14, "Q4_K", True, 4.67, 5.5),
    QuantType("Q5_K_S", 16, "Q5_K", True, 5.57, 6.0, max_mean_kl=0.06, min_top1=0.88),
    QuantType("Q5_K_M", 17, "Q5_K", True, 5.70, 6.36),
    QuantType("Q6_K", 18, "Q6_K", True, 6.56, 8.5),
    QuantType("Q8_0", 7, "Q8_0", False, 8.5, 8.5),
    # llama.cpp changes Q4_0's first ffn_down layers only when given an importance matrix, which export does not give it
    QuantType("Q4_0", 2, "Q4_0", False, 4.5, 4.5),
)}
# The output layer (the input table where tied) in every mix: Q6_K, Q8_0 where its rows are not a multiple of 256.
OUTPUT_BITS, OUTPUT_FALLBACK_BITS = 6.56, 8.5
UNQUANTIZED = ("f16", "bf16", "f32")   # the converter's own outtypes, which the fidelity gate also holds to thresholds
