"""Fused MoE expert stacks stored in NF4 under QLoRA, quantized as they load.

transformers' bitsandbytes loader quantizes nn.Linear modules only, so without this a QLoRA MoE keeps its routed
experts -- most of its weights -- in 16 bits (Qwen3-30B-A3B: 57 of 59 GiB). Within `quantized_at_load()` the
loader treats each fused stack (stages.model.experts.structure.ExpertStack) like a Linear4bit weight: the meta parameter becomes a
bitsandbytes Params4bit with the run's quant type and double quantization, and the loader quantizes it on its
device as soon as its per-expert checkpoint tensors are fused, one stack at a time, so no 16-bit copy of all
the experts is ever resident. A stack is always dequantized whole, so a block of 64 may span two experts.

A quantized stack keeps its 3-D shape in `quant_state.shape` and, for peft's ParamWrapper (which reads
`ds_shape` before `shape`, for DeepSpeed's partitioned parameters), in `ds_shape` (`show_shapes`).
stages.model.experts.lora.use_nf4_stacks points each experts module holding one at the grouped path, which dequantizes a
stack for its grouped matmul and again in backward (nothing 16-bit is kept between them: the memory of one stack,
transient). peft's own ParamWrapper forward cannot run on it (it would add the delta to packed bytes):
stages.model.experts.lora routes every adapted experts module through the grouped path, adapters disabled included.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from stages.model.experts import structure

BLOCKSIZE = 64   # bitsandbytes' Linear4bit default: the stacks quantize like the model's linear layers


def is_nf4(param) -> bool:
    return getattr(param, "quant_state", None) is not None


def dequantize(param: torch.Tensor) -> torch.Tensor:
    import bitsandbytes.functional as F

    return F.dequantize_4bit(param.data, param.quant_state)


@contextlib.contextmanager
def quantized_at_load():
    """Within, transformers' bitsandbytes 4-bit loader quantizes the fused expert stacks of the experts modules
    stages.model.experts.lora can compute, besides the linear layers."""
    import bitsandbytes as bnb
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer as Quantizer

    before, needs = Quantizer._process_model_before_weight_loading, Quantizer.param_needs_quantization

    def _before(self, model, device_map, **kwargs):
        before(self, model, device_map, **kwargs)
        c = self.quantization_config
        for stack in structure.fused_experts(model).stacks:
            module_name, _, leaf = stack.name.rpartition(".")
            module = model.get_submodule(module_name)
            if not structure.computable(module):
                continue  # a forward of the family's own reads the stack
            old = getattr(module, leaf)
            module.source_cls = type(module)   # what the loader's quantize step asks of a Linear4bit (GPT-2's Conv1D is transposed)
            setattr(module, leaf, bnb.nn.Params4bit(old.data, requires_grad=False, blocksize=BLOCKSIZE,
                                                     compress_statistics=c.bnb_4bit_use_double_quant,
                                                     quant_type=c.bnb_4bit_quant_type, quant_storage=c.bnb_4bit_quant_storage))

    def _needs(self, model, param_name, **kwargs):
        if needs(self, model, param_name, **kwargs):
            return True
        module_name, _, leaf = param_name.rpartition(".")
        return isinstance(getattr(model.get_submodule(module_name), leaf, None), bnb.nn.Params4bit)

    Quantizer._process_model_before_weight_loading, Quantizer.param_needs_quantization = _before, _needs
    try:
        yield
    finally:
        Quantizer._process_model_before_weight_loading, Quantizer.param_needs_quantization = before, needs


def stacks(model: nn.Module) -> dict[str, list[str]]:
    """The experts modules holding NF4 stacks, with those stacks' parameter names."""
    found: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if is_nf4(param) and len(param.quant_state.shape) == 3:
                found.setdefault(name, []).append(pname)
    return found


def show_shapes(model: nn.Module) -> int:
    """After the load: every NF4 stack shows peft its 3-D shape (ParamWrapper sizes the adapter from it).
    Returns how many experts modules hold NF4 stacks."""
    found = stacks(model)
    for name, leaves in found.items():
        for leaf in leaves:
            param = getattr(model.get_submodule(name), leaf)
            param.ds_shape = torch.Size(param.quant_state.shape)
    return len(found)


def dequantize_all(model: nn.Module) -> int:
    """Every NF4 stack back to a 16-bit parameter of its shape (the merge into the dequantized NF4 base); the
    experts modules compute with transformers' own forward again. Returns how many stacks changed."""
    n = 0
    for name, leaves in stacks(model).items():
        module = model.get_submodule(name)
        for leaf in leaves:
            setattr(module, leaf, nn.Parameter(dequantize(getattr(module, leaf)), requires_grad=False))
            n += 1
        module.__dict__.pop("forward", None)
    return n
