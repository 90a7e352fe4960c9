"""Keep what autograd saves for backward in pinned CPU memory instead of on the GPU.

With full checkpointing the tensors saved outside the checkpointed layers are mostly the
layers' inputs: 28 x 2 x 4096 x 3584 x 2 B = 1.6 GiB for a 7B at 2 x 4096 tokens, 16 GiB at
80k tokens. Moving them to the host is what lets a 7B QLoRA train under 8 GiB and at long
context under 24 GiB. That much pinned host memory is held per micro-batch, up to twice it
while torch's pinned allocator rounds blocks up to powers of two; train releases it at the end.

`torch.autograd.graph.save_on_cpu` does the same, but its device-to-host copy blocks the
host at every saved tensor and its host-to-device copy waits in the compute stream; on R7 (the Qwen2-7B benchmark shape)
it cost 8.5% of the tokens/s (docs/benchmarks.md: train_speed) that this hides: copies run on a side stream,
overlapping compute, and backward prefetches the next tensor it will need (the saved inputs
come back in reverse order). Parameters and small tensors stay where they are.

A saved tensor's GPU block is released at a fixed point of the program, not when its copy happens to finish: the
offload keeps it until the next tensor is packed (or backward starts), makes the compute stream wait for its copy
there, then drops it. `record_stream` would free it at once but let the allocator reuse the block only once the
copy had finished, so where later blocks went, and how much memory a step needed, followed the GPU's timing
(docs/benchmarks.md: gpu_figure, the offload's fixed-point release).
"""

from __future__ import annotations

import math

import torch

MIN_BYTES = 1 << 20  # below this a copy costs more than it saves


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Context manager for one forward pass; `reset()` between micro-batches frees host copies.

    Args:
        model: its parameters (and their views) are never offloaded.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        on_gpu = torch.cuda.is_available()  # without one every saved tensor stays where it is
        self.stream = torch.cuda.Stream() if on_gpu else None
        # The one stream whose blocks this offload releases by hand: every wait goes on it, and a tensor saved under
        # another stream stays on the GPU (releasing it safely would need a wait on that stream).
        self.compute = torch.cuda.current_stream() if on_gpu else None
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.host: list = []      # index -> (cpu tensor, device, copy-done event), until reset()
        self.fetched: dict = {}   # index -> (gpu tensor, event), prefetched in backward
        self.pending: tuple | None = None  # (gpu tensor, copy-done event): the last one packed, until _settle()
        self.pool = PinnedPool()
        self.offloaded_bytes = 0
        super().__init__(self._pack, self._unpack)

    def reset(self) -> None:
        self._settle()
        for _gpu, ready in self.fetched.values():  # prefetched, never used (a failed backward): the copy in ends first
            self.compute.wait_event(ready)
        self.pool.release()
        self.host.clear()
        self.fetched.clear()

    def _settle(self) -> None:
        """Release the last packed tensor: work queued on the compute stream from here on waits for its copy, so
        the allocator may hand its block to the next allocation at once."""
        if self.pending is not None:
            self.compute.wait_event(self.pending[1])  # the block's own stream, whichever is current here
            self.pending = None

    def __del__(self) -> None:
        # Dropped without reset(): blocks the side stream may still read or write are about to be freed.
        if getattr(self, "stream", None) is not None and (getattr(self, "pending", None) is not None or getattr(self, "fetched", None)):
            try:
                self.stream.synchronize()
            except Exception:
                pass

    def _pack(self, t: torch.Tensor):
        # A tensor kept where it is goes back detached: an op that saves its own output (softmax, exp, sigmoid) would
        # otherwise hold that output, and through its grad_fn itself, from inside the graph, where the collector
        # cannot see it. A forward that dies before its backward (an OOM, a capped probe) then left its whole graph,
        # the layers its checkpoints recompute and their weights, allocated for the rest of the process.
        # the storage's size, not the view's: an expanded tensor (a broadcast mask, a placeholder) is its storage
        if (not t.is_cuda or min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) < MIN_BYTES
                or t.untyped_storage().data_ptr() in self.param_ptrs):
            return t.detach()
        compute = torch.cuda.current_stream()
        if compute != self.compute:
            return t.detach()  # another stream's block: released by hand only on the stream the waits go on
        self.stream.wait_stream(compute)  # t is written by work queued on compute
        with torch.cuda.stream(self.stream):
            cpu = self.pool.take(t.shape, t.dtype)
            cpu.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        # One tensor behind: the previous copy has had this one's compute to run beside, so the wait rarely stalls.
        self._settle()
        self.pending = (t.detach(), done)  # the storage, not a failed forward's graph
        self.host.append((cpu, t.device, done))
        self.offloaded_bytes += cpu.numel() * cpu.element_size()
        return len(self.host) - 1

    def _fetch(self, i: int):
        cpu, dev, done = self.host[i]
        # Allocated from the compute stream's pool: a block owned by the side stream could not
        # be reused by compute, and that alone cost 0.45 GiB of reserve on R7.
        gpu = torch.empty(cpu.shape, dtype=cpu.dtype, device=dev)
        self.stream.wait_stream(torch.cuda.current_stream())  # the block may be in use by queued compute
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(done)
            gpu.copy_(cpu, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        # No record_stream: compute waits for `ready` before it uses gpu (or before reset() drops it), so every
        # compute-stream reuse of its block comes after the copy, at a point the program fixes.
        return gpu, ready

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        self._settle()  # backward has begun: the last tensor the forward packed is released
        i = packed
        gpu, ready = self.fetched.pop(i, None) or self._fetch(i)
        torch.cuda.current_stream().wait_event(ready)
        # backward walks the layers in reverse: start bringing the previous one back now
        j = i - 1
        if j >= 0 and j not in self.fetched:
            self.fetched[j] = self._fetch(j)
        return gpu


class PinnedPool:
    """Pinned host buffers kept across micro-batches, in power-of-two size classes.

    torch's pinned allocator gave the offload a cudaHostAlloc per saved tensor at every step on
    R7 (30 calls, 50 ms of host time in a ~500 ms step with dynamic padding; docs/benchmarks.md: packing_speed).
    A buffer handed out since the last release() is reused only after
    it: every copy into or out of it runs on the offload's one side stream, in order, so the next
    micro-batch's device-to-host copy cannot overtake the last host-to-device copy it served.
    """

    def __init__(self) -> None:
        self.free: dict[int, list[torch.Tensor]] = {}
        self.used: list[torch.Tensor] = []

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        size = 1 << max(nbytes - 1, 1).bit_length()
        bucket = self.free.get(size)
        buf = bucket.pop() if bucket else torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.used.append(buf)
        return buf[:nbytes].view(dtype).view(shape)

    def release(self) -> None:
        for buf in self.used:
            self.free.setdefault(buf.numel(), []).append(buf)
        self.used.clear()


class HostEmbedding(torch.nn.Module):
    """A frozen input embedding kept in pinned CPU memory: rows are gathered on the host and
    only the batch's hidden states cross to the GPU (58 MB at 2 x 4096 tokens, against a
    1.02 GiB table for a 152k vocabulary).

    The table is a plain attribute, not a parameter or buffer, so `model.to()` and the
    Trainer's device placement leave it on the host.
    """

    def __init__(self, emb: torch.nn.Embedding) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = emb.num_embeddings, emb.embedding_dim, emb.padding_idx
        self.device = emb.weight.device
        self.host_weight = emb.weight.detach().to("cpu").pin_memory()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = ids.to("cpu").reshape(-1)
        out = torch.empty((rows.numel(), self.embedding_dim), dtype=self.host_weight.dtype, pin_memory=True)
        torch.index_select(self.host_weight, 0, rows, out=out)
        return out.view(*ids.shape, self.embedding_dim).to(self.device, non_blocking=True)


def embeddings_to_host(model) -> float:
    """Move the (untied, frozen) input embedding to the host; returns the GiB freed on the GPU."""
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    if out is not None and out.weight.data_ptr() == emb.weight.data_ptr():
        return 0.0  # tied to lm_head, which must stay on the GPU
    freed = emb.weight.numel() * emb.weight.element_size() / 2**30
    model.set_input_embeddings(HostEmbedding(emb))
    del emb
    torch.cuda.empty_cache()
    return freed
