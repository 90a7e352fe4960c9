"""One long causal row (32,768 tokens, Llama-3.1-8B / Qwen3-8B heads: 32 query, 8 KV, 128 wide), forward and
backward, bf16: torch's varlen flash attention (the stage's packed path) against scaled_dot_product_attention with
each backend torch has on this GPU. Which kernel should a micro-batch of one sample take?

    python bench/peers/attention_long.py --out attention_long.json     (a GPU; about a minute)
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import varlen_attn


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--out")
    a = ap.parse_args()
    n, h, kv, d = a.tokens, a.heads, a.kv_heads, a.dim
    q = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(n, kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    flops = 4 * n * n / 2 * d * h * 3.5   # causal: half the scores; forward 1x, backward 2.5x

    def varlen():
        import inspect
        params = inspect.signature(varlen_attn).parameters
        kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        kk, vv = (k, v) if "enable_gqa" in params else (k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1))
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        varlen_attn(q, kk, vv, cu, cu, n, n, **kw).backward(grad)

    def sdpa(backend):
        def run():
            with sdpa_kernel([backend]):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                    enable_gqa=True)
            out[0].transpose(0, 1).backward(grad)
        return run

    rows = {}
    for name, fn in [("varlen", varlen), ("sdpa-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)),
                     ("sdpa-flash", sdpa(SDPBackend.FLASH_ATTENTION)), ("sdpa-efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION))]:
        try:
            ms = timed(fn)
            rows[name] = {"ms": round(ms, 2), "tflops": round(flops / ms / 1e9, 1)}
        except Exception as e:  # noqa: BLE001 - a backend this GPU or build lacks
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(name, rows[name], flush=True)
    # the same inputs through both: the outputs and every gradient agree to bf16's rounding
    grads = {}
    for name, fn in [("varlen", varlen), ("sdpa-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))]:
        for x in (q, k, v):
            x.grad = None
        try:
            fn()
            grads[name] = [x.grad.float() for x in (q, k, v)]
        except Exception:  # noqa: BLE001 - reported in its row above
            pass
    if len(grads) == 2:
        rows["agreement"] = {w: round(float((a - b).abs().max() / b.abs().max()), 5)
                             for w, a, b in zip(("dq", "dk", "dv"), grads["sdpa-cudnn"], grads["varlen"], strict=True)}
        print("agreement (max |diff| / max |grad|)", rows["agreement"], flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": n, "heads": h, "kv_heads": kv,
           "dim": d, "rows": rows}
    if a.out:
        open(a.out, "w").write(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
