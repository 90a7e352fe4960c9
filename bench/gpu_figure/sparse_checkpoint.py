"""A released model's checkpoint at full size that takes no disk, for shapes whose real checkpoint does not fit the
device's disk beside everything else (Qwen3-30B-A3B: 57 GiB bf16 on a 64 GiB disk).

`write`: save_pretrained of the model built on the meta device, every safetensors file written as its header (the
names, shapes and dtypes transformers writes, per-expert tensors included) and a hole where the data goes: the
model checks read it as a real checkpoint, and transformers' own loader reads it (zeros) through its real path,
expert fusion and 4-bit quantization at load included, so the load's memory is the real load's.

`randomized(load_base)`: load_base, then every weight given random values in place, so the steps route and
compute as on a trained model (an all-zero model routes every token to the same experts and its NF4 blocks have
no scale): 16-bit weights normal(0, 0.02) (norms 1), NF4 weights random 4-bit codes under block scales of
~0.02. Nothing is allocated beyond what the load holds.
"""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import torch

_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8", torch.int64: "I64"}


def _sparse_save(tensors: dict, filename, metadata=None) -> None:
    header, offset = {}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(filename, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)   # the data: a hole, read back as zeros


@contextlib.contextmanager
def _sparse_writes():
    import transformers.modeling_utils as mu

    real = mu.safe_save_file
    mu.safe_save_file = _sparse_save
    try:
        yield
    finally:
        mu.safe_save_file = real


def write(config, out: Path) -> Path:
    """save_pretrained of `config`'s model, built on the meta device, as sparse safetensors files."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with _sparse_writes():
        model.save_pretrained(out, max_shard_size="5GB")
    return out


@torch.no_grad()
def randomize(model, seed: int = 0) -> None:
    """Random values in place for every weight a load of a sparse checkpoint left at zero."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:   # NF4: random codes, block scales near 0.02 (nested: 8-bit scale codes over 0.02 / 127)
            p.data.copy_(torch.randint(0, 256, p.data.shape, dtype=torch.uint8, device=p.device, generator=gen))
            if getattr(state, "nested", False):
                state.absmax.copy_(torch.randint(0, 256, state.absmax.shape, dtype=torch.uint8, device=p.device, generator=gen))
                state.state2.absmax.fill_(0.02)
                state.offset = torch.tensor(0.02, device=p.device) if torch.is_tensor(state.offset) else 0.02
            else:
                state.absmax.fill_(0.02)
        elif p.dim() == 1:
            p.data.fill_(1.0 if "norm" in name else 0.0)
        elif p.is_floating_point():
            p.data.normal_(0.0, 0.02, generator=gen)


def randomized(load_base):
    """`load_base`, then `randomize` on what it returns."""

    def load(*args, **kwargs):
        model = load_base(*args, **kwargs)
        randomize(model)
        return model

    load.__wrapped__ = load_base
    return load
