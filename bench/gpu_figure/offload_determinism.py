"""Does the activation offload make a step's memory follow the GPU's timing? (issue 21: the need's spread)

    python3 bench/gpu_figure/offload_determinism.py --out $OUT/offload_determinism.json

A small Llama (random init, 8 layers, width 1024, 2 x 2048 tokens, bf16, checkpointed, every parameter trained)
trains one micro-batch at a time with its saved tensors offloaded, 6 times, each from an emptied cache; before every
other one a ~20 ms kernel is queued on the offload's side stream, so the copies to the host finish later, as they do
on a GPU shared with other work (one unrecorded warm-up step first). The program and its starting state are the same every time: any difference between
the steps' allocator traces (addresses, sizes) or their page figures (stages.memory.pages_touched_peak: what a
capped run needs) is timing. Run for the offload as it was (`record_stream`: a freed block is reusable once its copy
has finished) and as it is (released at a fixed point, after the compute stream waits for the copy), each against
the same step without offload: the gradients must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as training runs (stages/model/load.py)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from stages.memory import GIB, pages_touched_peak  # noqa: E402
from stages.train.offload import MIN_BYTES, OffloadActivations  # noqa: E402


class RecordStreamOffload(OffloadActivations):
    """The offload before this change: each saved tensor freed under `record_stream`, no fixed release point (nothing
    is ever pending, so the inherited _settle() in reset() and _unpack() does nothing)."""

    def _pack(self, t):
        if (not t.is_cuda or t.numel() * t.element_size() < MIN_BYTES
                or t.untyped_storage().data_ptr() in self.param_ptrs):
            return t
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            cpu = self.pool.take(t.shape, t.dtype)
            cpu.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        t.record_stream(self.stream)
        self.host.append((cpu, t.device, done))
        return len(self.host) - 1

    def _fetch(self, i):
        gpu, ready = super()._fetch(i)
        gpu.record_stream(self.stream)
        return gpu, ready


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def step(model, ids, offload, delay: bool) -> None:
    if offload is not None:
        offload.reset()
        if delay:  # the side stream is busy: this step's copies to the host finish ~20 ms later
            with torch.cuda.stream(offload.stream):
                torch.cuda._sleep(40_000_000)
        with offload:
            loss = model(input_ids=ids, labels=ids).loss
    else:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if offload is not None:
        offload.reset()


def grads(model) -> list[torch.Tensor]:
    return [p.grad.float().clone() for p in model.parameters()]


def run(kind, model, ids, reference) -> dict:
    offload = kind(model)
    model.zero_grad(set_to_none=True)
    step(model, ids, offload, delay=False)  # warm-up, not recorded: the pinned pool fills, kernels load
    traces, pages, seconds, diffs = [], [], [], []
    for k in range(6):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        mem = torch.cuda.memory
        live = {b["address"]: b["size"] for seg in mem._snapshot()["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"}
        mem._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_000_000, clear_history=True)
        t0 = time.perf_counter()
        step(model, ids, offload, delay=k % 2 == 1)
        torch.cuda.synchronize()
        seconds.append(round(time.perf_counter() - t0, 4))
        events = mem._snapshot()["device_traces"][0]
        mem._record_memory_history(enabled=None)
        traces.append([(e["action"], e["addr"], e["size"]) for e in events if e["action"] in ("alloc", "free_requested")])
        pages.append(round(pages_touched_peak(live, events) / GIB, 4))
        diffs.append(max((a - b).abs().max().item() / (b.abs().max().item() or 1.0) for a, b in zip(grads(model), reference, strict=True)))
    # the sizes in order, apart from the addresses: a different trace with the same sizes is placement alone
    return {"same_trace_as_step_0": [t == traces[0] for t in traces],
            "same_sizes_as_step_0": [[x[::2] for x in t] == [x[::2] for x in traces[0]] for t in traces],
            "pages_gib": pages, "seconds": seconds, "delayed_steps": [k % 2 == 1 for k in range(6)],
            "max_rel_grad_diff_vs_no_offload": diffs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    model = build()
    ids = torch.randint(0, 32000, (2, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    model.zero_grad(set_to_none=True)
    step(model, ids, None, False)
    reference = grads(model)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": "llama 8 x 1024, 2 x 2048 tokens, bf16",
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
           "record_stream": run(RecordStreamOffload, model, ids, reference),
           "fixed_release": run(OffloadActivations, model, ids, reference)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
