"""The type llama.cpp's quantizer gives each tensor of a K-quant or Q8_0 file, so export can check a file against it.

A port of llama_tensor_get_type and tensor_type_fallback (src/llama-quant.cpp of the llama-cpp-python 0.3.36 sdist)
for the file types export offers (stages/quants.py), as export calls the quantizer: no imatrix, no --pure, no
per-tensor overrides. Branches for other file types (IQ*, Q2_K, Q3_K, MXFP4) are left out.

K-quants pack 256 values per super-block. A matrix whose rows (ne[0], the input width) are not a multiple of 256 gets
the type tensor_type_fallback names instead (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; F16 if not even 32 divides the
rows), and llama.cpp counts it ("N of M tensor(s) required fallback quantization"). Widths 576 (SmolLM2-135M),
896 (Qwen2.5-0.5B) and 960 (SmolLM2-360M) fall back on nearly every matrix; so does every published Q4_K_M of them.
The output matrix (and tied token embeddings) of such a width is Q8_0 by the output rule itself, not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.quants import TYPES

# tensor_type_fallback's switch, for the types the rule below can pick.
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "Q4_0", "Q3_K": "Q4_0"}
BLOCK = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q2_K": 256, "Q3_K": 256,
         "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "F16": 1, "F32": 1}
# tensor_allows_quantization: 2-D+ tensors named *weight, except these (substrings; exact names below).
NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
                 "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight", "attn_rel_b.weight",
                 ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger",
                 "a.rvq.codebook", "mm.a.code_embd", *(f"time_mix_{x}.weight" for x in (
                     "first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2", "g1", "g2", "decay_w1", "decay_w2", "lerp_fused")))
NOT_QUANTIZED_NAMES = ("position_embd.weight", "token_types.weight")
# model.type == LLM_TYPE_70B (per-architecture layer counts in src/models/*.cpp) raises attn_v from Q3_K/Q4_K to Q5_K.
SEVENTY_B_LAYERS = {"llama": 80, "qwen2": 80, "deci": 80, "olmo": 80, "jais2": 68}


@dataclass(frozen=True)
class Choice:
    type: str                   # what llama.cpp writes for this tensor
    rule: str                   # what the mix asked for before the shape was considered
    row: int                    # ne[0]: the values per row that the block size must divide

    @property
    def fallback(self) -> str | None:
        """"Q4_K->Q5_0" when the row width made llama.cpp fall back, else None."""
        return f"{self.rule}->{self.type}" if self.type != self.rule and self.row % BLOCK[self.rule] else None


def expected(info: dict, quant: str) -> dict[str, Choice]:
    """The type of every tensor llama.cpp quantizes, from a GGUF's names, shapes and hyperparameters (llamacpp.read_gguf)."""
    f = info["fields"]
    arch = f.get("general.architecture", "")
    n_layer = int(f.get(f"{arch}.block_count") or 0)
    n_expert = int(f.get(f"{arch}.expert_count") or 0)
    heads, heads_kv = f.get(f"{arch}.attention.head_count"), f.get(f"{arch}.attention.head_count_kv")
    is_70b = n_layer == SEVENTY_B_LAYERS.get(arch) and not (arch == "llama" and heads == heads_kv)
    names = sorted(info["tensor_shapes"], key=_load_order)
    tied = "output.weight" not in names
    n_wv = sum(_category(n) == "attn_v" for n in names)
    i_wv = i_down = 0
    default = TYPES[quant].tensor_type
    out = {}
    for name in names:
        shape = info["tensor_shapes"][name]
        if not _quantized(name, shape):
            continue
        cat, new = _category(name), default
        if cat == "output" or (tied and cat == "token_embd"):
            if arch == "falcon" or shape[0] % BLOCK[new]:
                new = "Q8_0"
            elif new != "Q8_0":
                new = "Q6_K"
        elif cat == "attn_v":
            if quant in ("Q4_K_M", "Q5_K_M") and _more_bits(i_wv, n_wv):
                new = "Q6_K"
            elif quant == "Q4_K_S" and i_wv < 4:
                new = "Q5_K"
            if is_70b and new in ("Q3_K", "Q4_K"):
                new = "Q5_K"
            if n_expert == 8:
                new = "Q8_0"
            i_wv += 1
        elif cat == "attn_k":
            if n_expert == 8:
                new = "Q8_0"
        elif cat == "ffn_down":
            layer = _layer(name) if n_expert > 1 else i_down
            if quant == "Q4_K_M":
                if arch == "falcon":
                    new = "Q6_K" if layer < n_layer // 16 else "Q5_K" if _more_bits(layer, n_layer) else "Q4_K"
                elif _more_bits(layer, n_layer):
                    new = "Q6_K"
            elif quant == "Q5_K_M" and _more_bits(layer, n_layer):
                new = "Q6_K"
            elif quant == "Q4_K_S" and arch != "falcon" and layer < n_layer // 8:
                new = "Q5_K"
            i_down += 1
        elif cat == "attn_output":
            if arch != "falcon" and n_expert == 8 and quant in ("Q4_K_S", "Q4_K_M"):
                new = "Q5_K"
        out[name] = Choice(_fit(new, shape[0]), new, shape[0])
    return out


def fallbacks(choices: dict[str, Choice]) -> dict[str, int]:
    """How many tensors fell back, by "rule->type", most first."""
    counts: dict[str, int] = {}
    for c in choices.values():
        if c.fallback:
            counts[c.fallback] = counts.get(c.fallback, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _fit(rule: str, row: int) -> str:
    """tensor_type_fallback: the rule's type if its block divides the row, else its 32-block fallback, else F16."""
    if row % BLOCK[rule] == 0:
        return rule
    alt = FALLBACK.get(rule, rule)  # a 32-block type has no smaller block to go to
    return alt if row % BLOCK[alt] == 0 else "F16"


def _more_bits(i: int, n: int) -> bool:
    """use_more_bits: the first and last eighth of the layers, and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _category(name: str) -> str:
    """tensor_get_category, in its order of tests."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                     ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                     ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def _quantized(name: str, shape: list[int]) -> bool:
    dims = len(shape)
    while dims > 1 and shape[dims - 1] == 1:  # ggml_n_dims ignores trailing 1s
        dims -= 1
    return (dims >= 2 and name.endswith("weight") and not any(s in name for s in NOT_QUANTIZED)
            and name not in NOT_QUANTIZED_NAMES)


def _layer(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") and name.split(".")[1].isdigit() else -1


def _load_order(name: str) -> tuple[int, str]:
    """llama_model_loader's weights_map order (weight_name_comparer): by block number (-1 outside blocks), then name."""
    return _layer(name), name
