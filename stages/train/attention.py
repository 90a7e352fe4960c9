"""The attention kernel a model's shapes get, and (for packed micro-batches) attention that
never crosses a sample boundary: torch's varlen flash kernel, flex attention, or SDPA with
transformers' block-diagonal mask."""

from __future__ import annotations

import functools

import torch

from stages.model.load import compute_dtype, device


def attention_kernel(model) -> str:
    """Which SDPA kernel the model's attention shapes get on this device, checked once here.

    Checked on a same-shaped call, never by wrapping the forward in `sdpa_kernel`: that
    context is gone when checkpointing recomputes the layer in backward, which then picks
    another kernel and fails the recompute's metadata check.
    """
    impl = model.config._attn_implementation
    if device().type != "cuda" or impl != "sdpa":
        return f"{impl} ({device().type})"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q = torch.randn(1, c.num_attention_heads, 256, head_dim, device="cuda", dtype=compute_dtype("auto"))
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            return f"sdpa: {name}"
        except RuntimeError:
            continue
    print("train: WARNING: neither flash nor memory-efficient SDPA runs here: attention falls back to the math kernel "
          "(memory quadratic in sequence length)")
    return "sdpa: math (quadratic memory)"


def avoid_cudnn_sdpa() -> None:
    """SDPA picks flash (then memory-efficient) attention, not cuDNN's, on CUDA.

    torch puts cuDNN attention first on Hopper, and cuDNN builds an execution plan for every new
    sequence length: with dynamic padding nearly every step has a new width. In the profile of a
    2 x ~300-token step on R7 (docs/benchmarks.md: packing_speed) cuDNN attention's
    host side took 144 of its ~500 ms. A process-wide switch, not an `sdpa_kernel` context, for the
    reason attention_kernel() gives.
    """
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)


VARLEN = "tae_varlen"  # the name the varlen attention is registered under in transformers


def varlen_available() -> bool:
    """torch's variable-length flash kernel (torch >= 2.10, CUDA); on CPU the per-sample loop always is."""
    if device().type != "cuda":
        return True
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability()[0] >= 8  # flash attention: Ampere and later


def use_packed_attention(model, kind: str) -> None:
    """Switch a loaded model to the attention that keeps packed samples apart.

    `mask` leaves the model's own attention (sdpa, eager, flash_attention_2), which reads the
    sample boundaries from the restarting position ids.
    """
    if kind == "varlen":
        _register_varlen()
        model.set_attn_implementation(VARLEN)
    elif kind == "flex_attention":
        model.set_attn_implementation("flex_attention")


def _register_varlen() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(VARLEN, varlen_attention)
    # No mask tensor at all: the boundaries come as cu_seq_lens (stages/packing.collate).
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, lambda *args, **kwargs: None)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, cu_seq_lens_q=None,
                     cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """transformers' attention-function signature over one packed row: query [1, heads, tokens, dim],
    key/value [1, kv_heads, tokens, dim]; returns [1, tokens, heads, dim] and no weights."""
    if cu_seq_lens_q is None:  # no boundaries from the collator: one row, its samples told apart by restarting positions
        if query.shape[0] != 1 or attention_mask is not None:
            raise RuntimeError("varlen attention got a padded batch: it runs on packed micro-batches (stages.train.packing.collate "
                               "with varlen=True) or single rows; set training.packed_attention: mask")
        cu_seq_lens_q = cu_seq_lens_k = _bounds_from_positions(kwargs.get("position_ids"), query.shape[2], query.device)
        max_length_q = max_length_k = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    if (rows := _equal_rows(query, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)) is not None:
        return _causal_rows(query, key, value, rows, scaling), None
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [tokens, heads, dim]
    if device().type == "cuda":
        out = _flash_varlen(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scaling)
    else:
        out = _per_sample(q, k, v, cu_seq_lens_q, scaling)
    return out.unsqueeze(0), None


def _equal_rows(query, value, cu_q, cu_k, max_q, max_k) -> int | None:
    """How many samples the packed row holds where they all have one length (full rows cut at data.max_length, one
    long sample), else None. Known on the host without reading the boundaries off the GPU: the samples' count is
    the boundaries' shape, and the longest times the count is the row only where every sample is the longest."""
    if not isinstance(max_q, int) or max_q != max_k or cu_q.shape != cu_k.shape or value.shape[-1] != query.shape[-1]:
        return None
    rows = cu_q.shape[0] - 1
    return rows if rows >= 1 and max_q * rows == query.shape[2] else None


def _causal_rows(query, key, value, rows: int, scale):
    """Attention over a row of `rows` equal samples as a batch of `rows` causal rows: scaled_dot_product_attention,
    which on Hopper takes cuDNN's fused attention, forward and backward 1.7x torch's varlen flash kernel on one
    32,768-token sample and 3.3x on 4,096 (docs/benchmarks.md: peers, attention). query [1, heads, tokens, dim]
    (key and value with their own heads); returns [1, tokens, heads, dim]."""
    from torch.nn.attention import sdpa_kernel

    def split(x):   # [1, heads, rows x length, dim] -> [rows, heads, length, dim], no copy
        return x[0].unflatten(1, (rows, -1)).transpose(0, 1)

    # Chosen inside the attention call: checkpointing's recompute runs this function again, under the same choice
    with sdpa_kernel(_sdpa_order(), **({"set_priority": True} if _sdpa_priority() else {})):
        out = torch.nn.functional.scaled_dot_product_attention(split(query), split(key), split(value), is_causal=True,
                                                               scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).reshape(1, query.shape[2], query.shape[1], value.shape[-1])


@functools.cache
def _sdpa_order() -> list:
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@functools.cache
def _sdpa_priority() -> bool:
    """Whether this torch's sdpa_kernel takes an order (2.6 and later); before, it picks among the allowed by its own."""
    import inspect

    from torch.nn.attention import sdpa_kernel

    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def _bounds_from_positions(position_ids, tokens: int, dev) -> torch.Tensor:
    """cu_seq_lens of one row from its position ids (a sample starts where they restart at 0), as
    transformers' flash-attention path reads a flattened batch; no position ids: one sample."""
    starts = [0]
    if position_ids is not None and position_ids.shape[0] == 1:
        starts = (position_ids[0] == 0).nonzero().flatten().tolist() or [0]
        if starts[0] != 0:
            starts.insert(0, 0)
    return torch.tensor([*starts, tokens], dtype=torch.int32, device=dev)


@functools.cache
def _varlen_params() -> frozenset[str]:
    """varlen_attn's keyword names, read once: its signature changed between torch 2.10 and 2.12, and reading it
    in every layer's attention cost host time on every step."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    if v.shape[-1] != q.shape[-1]:   # the flash kernel takes one head width; latent attention's values are narrower
        # (DeepSeek-V2: queries and keys 192 wide, values 128): zero columns change no sum; as transformers' flash path does
        width = v.shape[-1]
        return _flash_varlen(q, k, torch.nn.functional.pad(v, (0, q.shape[-1] - width)), cu_q, cu_k, max_q, max_k, scale)[..., :width]
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    if q.shape[1] != k.shape[1] and "enable_gqa" not in params:  # torch 2.10/2.11: heads must match
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    kw = {"scale": scale} if "scale" in params else {}
    if "is_causal" in params:  # torch 2.10-2.11
        kw["is_causal"] = True
    else:  # torch >= 2.12: causal is a window reaching no future token
        kw["window_size"] = (-1, 0)
    if "enable_gqa" in params:
        kw["enable_gqa"] = q.shape[1] != k.shape[1]
    return varlen_attn(q, k, v, cu_q, cu_k, int(max_q), int(max_k), **kw)


def _per_sample(q, k, v, cu, scale):
    """The same attention one sample at a time with causal SDPA: exact on any device, no
    tokens x tokens mask (CPU, tests)."""
    bounds = cu.tolist()
    parts = [torch.nn.functional.scaled_dot_product_attention(
        q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return torch.cat(parts)
