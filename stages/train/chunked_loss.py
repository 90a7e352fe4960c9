"""The causal-LM loss without the tokens x vocab logits, for the families Liger's fused loss does not cover.

The stock loss computes every position's logits and upcasts them to fp32: 1.6 GB for 8,192 tokens of a 50k
vocabulary, 6.6 GB at 201k (GPT-OSS), and autograd keeps them (and their softmax) for backward. Here the loss-carrying
rows go through the output layer a chunk at a time: each chunk's logits, loss and gradient are computed in the
forward and only the gradient with respect to the hidden states ([rows, hidden], 16-bit) is kept; the chunk's logits
are freed before the next. Chunks are half Liger's size (`chunk_rows`), so what stages/train/memory_model.py counts for
Liger's loss holds for this one, and at least `min_logits` logits: a chunk of a few dozen rows reads the whole output
layer twice for little work (Qwen1.5-MoE's 151,936 x 2,048 head at 8,192 tokens: 128 chunks of 64 rows, bound by
memory reads; docs/benchmarks.md: peers), so a plan with the card's room (kernels.resolve_auto's `loss_chunk_logits`)
takes chunks of WIDE_CHUNK_LOGITS, where the matmul is bound by compute.

It is installed on the model's own forward: the output layer returns its input and the model's `loss_function`
receives the hidden states in place of the logits, so everything the family's forward does around the loss (the
router's auxiliary loss of a mixture of experts, a linear logit scale: Granite's 1/logits_scaling, Cohere's
logit_scale) stays the family's. A forward that does anything else to the logits (Gemma-2's soft-capping, a vocabulary
slice) is not linear in the hidden states: `unsupported` says so and the stock loss is kept.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import threading

import torch
from torch import nn

MIN_CHUNK_LOGITS = 1 << 22   # 16 MB of fp32 logits
WIDE_CHUNK_LOGITS = 1 << 28  # 1.5 GiB at 6 bytes a logit: >= 1,024 rows up to a 262k vocabulary
# The lines of a family's forward the hidden states may meet in place of the logits: what is linear in them.
_SCALE = r"( [*/] [\w.]+)?"
# the head's own line: the hidden states (their last positions, cast to the head's dtype), a scale, a cast after
_HEAD = re.compile(r"(\w*logits) = self\.{head}\(hidden_states(\[:, slice_indices, :\])?"
                   r"(\.to\((dtype=)?self\.{head}\.weight\.dtype\))?\)(\.float\(\)|\.contiguous\(\))?" + _SCALE)
# between the head and self.loss_function(...)
_BETWEEN = re.compile(r"(logits = logits [*/] [\w.]+|loss = None|if labels is not None:)")
# after it: the logits only handed on, to the loss's arguments or the returned output
_AFTER = re.compile(r"logits=\w*logits,.*|\w*logits,|output = \(logits,\) \+ .*|return \w+\(loss=loss, logits=logits, .*\)")
_IF_SET = re.compile(r"if self\.config\.(\w+) is not None:")


def unsupported(model_class: type, config=None, head: str = "lm_head") -> str | None:
    """Why this CausalLM class's forward cannot take the chunked loss, or None where it can: everything the forward does
    with the logits must be linear in the hidden states. `config` (the model's) lets a block under
    `if self.config.<key> is not None:` pass where the key is None (Gemma-3's soft-cap, off by default); `head` is the
    output layer's attribute name."""
    name = model_class.__name__
    try:
        source = inspect.getsource(model_class.forward)
    except (OSError, TypeError, AttributeError):
        return f"the source of {name}.forward cannot be read"
    at, loss = source.find(f"self.{head}("), source.find("self.loss_function(")
    if at < 0 or loss < at:
        return f"{name}.forward does not compute logits = self.{head}(...) and then self.loss_function(...)"
    lines = source[source.rfind("\n", 0, at) + 1:loss].splitlines()   # from the head's whole line
    first = lines[0].strip()
    if not re.compile(_HEAD.pattern.format(head=head)).fullmatch(first):
        return f"{name}.forward computes its logits as `{first}`"
    skip = None   # the indentation of an `if self.config.<key> is not None:` whose key is None: its block is not run
    for raw in lines[1:-1]:
        line, indent = raw.split("#")[0].strip(), len(raw) - len(raw.lstrip())
        if not line or (skip is not None and indent > skip):
            continue
        skip = None
        unset = _IF_SET.fullmatch(line)
        if unset and config is not None and getattr(config, unset.group(1), None) is None:
            skip = indent
        elif not _BETWEEN.fullmatch(line):
            return f"{name}.forward changes the logits before the loss ({line})"
    for raw in source[loss:].splitlines()[1:]:
        line = raw.split("#")[0].strip()
        if re.search(r"\blogits\b", line) and not _AFTER.fullmatch(line):
            return f"{name}.forward uses the logits after the loss ({line})"
    return None


def chunk_rows(rows: int, vocab: int, hidden: int, min_logits: int = MIN_CHUNK_LOGITS) -> int:
    """Half Liger's chunk (the rows whose logits are about as many elements as the hidden states of all rows): a chunk
    here holds its logits in 16 bits and their log-probabilities in 32, then the logits and their gradient in 16 (6
    bytes a logit against the 4 that stages/train/memory_model.py counts per logit of Liger's chunk), and at least
    `min_logits` logits (never under MIN_CHUNK_LOGITS: a small hidden size over a big vocabulary, the tests' tiny models
    on real tokenizers, would otherwise loop a row at a time)."""
    liger = 1 << max(0, math.ceil(math.log2(max(1, math.ceil(rows / math.ceil(vocab / hidden))))))
    return max(1, liger // 2, max(min_logits, MIN_CHUNK_LOGITS) // vocab)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(hidden @ weight.T + bias, targets), the gradients computed chunk by chunk in
    the forward (where a gradient is wanted) and scaled by the incoming one in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, grad_mode: bool, min_logits: int):
        # forward runs without grad mode: whether the caller's had it comes in `grad_mode`, what wants one from ctx
        want_h, want_w, want_b = (grad_mode and wanted for wanted in ctx.needs_input_grad[:3])
        # the chunk's ops in the dtype autocast would give its matmul, with autocast off: under it the softmaxes would
        # first copy the 16-bit logits to fp32 and write fp32 (10 bytes a logit at the peak, not 6), and an fp32
        # residual stream would make an fp32 copy of the output layer that each matmul casts back
        dev = hidden.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
        with torch.autocast(dev, enabled=False):
            return _LinearCrossEntropy._chunks(ctx, hidden, weight, bias, targets, min_logits, dtype, want_h, want_w, want_b)

    @staticmethod
    def _chunks(ctx, hidden, weight, bias, targets, min_logits: int, dtype, want_h: bool, want_w: bool, want_b: bool):
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        step = chunk_rows(hidden.shape[0], weight.shape[0], weight.shape[1], min_logits)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        for start in range(0, hidden.shape[0], step):
            h, t = hidden[start:start + step].to(dtype), targets[start:start + step]
            logits = h @ w.T if b is None else torch.addmm(b, h, w.T)
            # one pass reading the 16-bit logits, writing fp32 log-probabilities (the stock loss's fp32 upcast, without
            # the separate copy, max, exp and sum passes of logits.float().logsumexp())
            logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            total -= logp.gather(1, t[:, None]).sum()
            del logp
            if not (want_h or want_w or want_b):
                continue
            # d(sum of losses)/d logits = softmax - one-hot: the softmax in one pass, in the dtype the matmul below
            # takes (fp32 where the output layer's own gradient is wanted)
            grad = torch.softmax(logits, dim=-1, dtype=torch.float32 if want_w or want_b else None)
            del logits
            grad.scatter_add_(1, t[:, None], torch.full((t.shape[0], 1), -1.0, dtype=grad.dtype, device=grad.device))
            if want_h:
                grad_h[start:start + step] = grad.to(dtype) @ w
            if want_w:
                grad_w += grad.T @ h.float()
            if want_b:
                grad_b += grad.sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        # grad_out (1 / the loss tokens) in the hidden states' dtype: a 16-bit scalar moves every gradient by the same
        # factor (<= 0.4%), which AdamW's update does not see; scaling in fp32 would hold a [rows, hidden] fp32 copy
        return (grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None,
                (grad_w * grad_out).to(ctx.dtypes[0]) if grad_w is not None else None,
                (grad_b * grad_out).to(ctx.dtypes[1]) if grad_b is not None else None, None, None, None)


def use(model: nn.Module, min_logits: int = MIN_CHUNK_LOGITS) -> None:
    """The chunked loss on this CausalLM instance (before peft wraps it): in a forward given labels its output layer
    hands the hidden states to its `loss_function`, which computes ForCausalLMLoss's value (transformers.loss.loss_utils)
    from them, in chunks of at least `min_logits` logits; a forward without labels returns the logits as before."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or not head.weight.is_floating_point():
        raise ValueError(f"the chunked loss needs a plain nn.Linear output layer with a 16- or 32-bit weight, not "
                         f"{type(head).__name__}; set training.cross_entropy: plain")
    linear, family_forward = head.forward, model.forward
    passing = threading.local()   # set for the length of one forward given labels

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:
        return hidden if getattr(passing, "on", False) else linear(hidden)

    @functools.wraps(family_forward)
    def forward(*args, **kwargs):
        passing.on = kwargs.get("labels") is not None
        try:
            return family_forward(*args, **kwargs)
        finally:
            passing.on = False

    head.forward, model.forward = head_forward, forward
    head.chunked_loss = True

    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **_):
        # `logits` are the hidden states here (the output layer passed them through), under the stock loss's name
        if shift_labels is None:   # tokens < n predict n, as ForCausalLMLoss shifts
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        rows = logits.reshape(-1, logits.shape[-1])
        targets = shift_labels.reshape(-1).to(rows.device)
        kept = (targets != ignore_index).nonzero().squeeze(1)   # only loss-carrying rows meet the output layer
        total = _LinearCrossEntropy.apply(rows.index_select(0, kept), head.weight, head.bias, targets.index_select(0, kept),
                                          torch.is_grad_enabled(), min_logits)
        if num_items_in_batch is None:   # the mean over loss-carrying tokens (NaN where there are none, as the stock loss)
            return total / kept.numel()
        return total / (num_items_in_batch.to(total.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)

    model.loss_function = loss_function


def installed(model: nn.Module) -> bool:
    """Whether `use` put the chunked loss on this model (or the model peft wraps)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    return head is not None and getattr(head, "chunked_loss", False)
