"""The profiled steady step of run.py's `--profile` (profile_steps): GPU time by kernel kind, the GPU's busy share, the
host's top ops, the compute stream's idle time by cause and, with `stacks`, the host syncs' Python stacks. Moved from
bench/moe_stage_speed/run.py and bench/moe_profile/run.py (git history, bench/README.md "Removed (superseded)"). Not named
profile.py: run.py's folder comes first on its sys.path, where that name hides the standard library's (cProfile imports it)."""

from __future__ import annotations

import re
import time

import torch

KINDS = [  # first match wins: kernel-name patterns by what they do
    ("dequantize", r"dequant|kDequant"),
    ("optimizer", r"adam|multi_tensor|foreach|optimizer"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("compiled", r"^triton_(poi|per|red|tem)_"),   # inductor's fused kernels (the compiled routed math)
    ("liger", r"liger|_rms_norm|swiglu|rope|cross_entropy|_ce_|triton"),
    ("sort/route", r"sort|radix|topk|bincount|histogram|cumsum|scan"),
    ("index/gather/scatter", r"index|gather|scatter|embedding"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|sm90|sm100|wgmma|grouped|cublas"),
    ("copy", r"copy|memcpy|memset|cat|CatArray"),
    ("reduce", r"reduce|sum|norm"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
]


def kind(name: str) -> str:
    for k, pat in KINDS:
        if re.search(pat, name, re.I):
            return k
    return "other"


def summary(p, wall_s: float, steps: int) -> dict:
    """A finished torch.profiler run of `steps` steps over `wall_s` seconds, per step."""
    wall = wall_s / steps
    kernels: dict[str, list] = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time / 1e3   # ms
    total = sum(v[1] for v in kernels.values()) / steps
    kinds: dict[str, float] = {}
    for n, (_c, ms) in kernels.items():
        kinds[kind(n)] = kinds.get(kind(n), 0.0) + ms / steps
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:30]
    host = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:30]
    return {"wall_ms_per_step_profiled": round(wall * 1e3, 1), "kernel_ms_per_step": round(total, 1),
            "gpu_busy": round(total / (wall * 1e3), 3),
            "kernels_per_step": sum(v[0] for v in kernels.values()) // steps,
            "kinds_ms_per_step": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "host_top": [{"op": e.key[:120], "calls": e.count // steps, "self_cpu_ms": round(e.self_cpu_time_total / 1e3 / steps, 2)}
                         for e in host],
            "top": [{"kernel": n[:160], "kind": kind(n), "calls": c // steps, "ms": round(ms / steps, 2)} for n, (c, ms) in top]}


class SyncStacks:
    """torch's CUDA sync debug mode warning at every synchronizing op between start() and stop(); the Python
    stacks that warned, by count (`found()`)."""

    def __init__(self) -> None:
        import collections
        import warnings

        self.seen: collections.Counter = collections.Counter()
        self._catch = warnings.catch_warnings()

    def _record(self, message, category, filename, lineno, file=None, line=None):
        import traceback

        frames = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and "warnings" not in f.filename][-7:]
        self.seen[(str(message)[:80], tuple(frames))] += 1

    def start(self) -> None:
        import warnings

        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(None, None, None)

    def found(self) -> list[dict]:
        return [{"calls": n, "what": m, "stack": list(st)} for (m, st), n in self.seen.most_common(20)]


def profiled_after_first(trainer, stacks: bool) -> dict:
    """trainer.train() of 2 optimizer steps, the second one under torch.profiler (and with `stacks` torch's sync
    debug mode): a steady step, not the first, which also creates the optimizer's states."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    p = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    syncs = SyncStacks() if stacks else None
    window = {}

    class Window(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                torch.cuda.synchronize()
                window["t0"] = time.perf_counter()
                p.start()
                syncs.start() if syncs else None

        def on_train_end(self, args, state, control, **kwargs):
            syncs.stop() if syncs else None
            torch.cuda.synchronize()
            window["wall"] = time.perf_counter() - window["t0"]
            p.stop()

    trainer.add_callback(Window())
    trainer.train()
    try:
        timeline = streams(p)
    except Exception as e:  # noqa: BLE001 - the kernel summary stands without it
        timeline = {"error": repr(e)}
    return summary(p, window["wall"], 1) | {"streams": timeline} | ({"host_syncs": syncs.found()} if syncs else {})


def streams(p, gap_ns: int = 5_000, after_ns: int = 30_000) -> dict:
    """Where the compute stream (the one with the most kernel time) sat idle in a profiled window: each gap of at
    least `gap_ns` is put down to a copy on another stream when one ended inside it and compute started again within
    `after_ns` of that end (a wait on the copy's event), else to the host (nothing queued yet). Also how much of the
    other streams' copy time ran beside compute."""
    every = p.profiler.kineto_results.events()
    events = [e for e in every if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0]
    runtime = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()) for e in every
                     if e.device_type() == torch.autograd.DeviceType.CPU and e.name().startswith("cu") and e.duration_ns() > 100_000)
    by_stream: dict[int, list] = {}
    for e in events:
        by_stream.setdefault(e.device_resource_id(), []).append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()))
    if not by_stream:
        return {}
    compute = max(by_stream, key=lambda s: sum(b - a for a, b, _ in by_stream[s]))
    busy = []   # compute's busy intervals, merged
    for a, b, _ in sorted(by_stream[compute]):
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    copies = sorted((a, b, n) for s, ev in by_stream.items() if s != compute for a, b, n in ev if "Memcpy" in n)
    waits = {"host": [0, 0.0]}
    t0 = busy[0][0]
    big = []   # the gaps over 0.5 ms in order, with the host's long runtime calls during them
    for (_, g0), (g1, _) in zip(busy, busy[1:], strict=False):
        if g1 - g0 < gap_ns:
            continue
        ended = [c for c in copies if g0 <= c[1] <= g1 and g1 - c[1] <= after_ns]
        key = ("waited for " + ended[-1][2].split(" (")[0]) if ended else "host"
        if g1 - g0 > 500_000 and len(big) < 60:
            after = min((e for e in by_stream[compute] if e[0] >= g1), default=(0, 0, ""))[2][:60]
            big.append({"at_ms": round((g0 - t0) / 1e6, 2), "ms": round((g1 - g0) / 1e6, 2), "cause": key, "then": after,
                        "host_calls": [f"{n} {round((b - a) / 1e6, 2)}" for a, b, n in runtime if a < g1 and b > g0][:6]})
        w = waits.setdefault(key, [0, 0.0])
        w[0] += 1
        w[1] += (g1 - g0) / 1e6

    def overlapped(a: int, b: int) -> int:
        return sum(max(0, min(b, y) - max(a, x)) for x, y in busy if y > a and x < b)

    side = {}
    for a, b, n in copies:
        k = side.setdefault(n.split(" (")[0], {"calls": 0, "ms": 0.0, "beside_compute_ms": 0.0})
        k["calls"] += 1
        k["ms"] += (b - a) / 1e6
        k["beside_compute_ms"] += overlapped(a, b) / 1e6
    span = (busy[-1][1] - busy[0][0]) / 1e6
    timeline = [{"copy": n.split(" (")[0], "at_ms": round((a - t0) / 1e6, 2), "ms": round((b - a) / 1e6, 2),
                 "beside_compute_ms": round(overlapped(a, b) / 1e6, 2)} for a, b, n in copies[:60]]
    return {"compute_stream": compute, "span_ms": round(span, 1), "compute_busy_ms": round(sum(b - a for a, b in busy) / 1e6, 1),
            "idle_ms_by_cause": {k: {"gaps": n, "ms": round(ms, 1)} for k, (n, ms) in waits.items()},
            "side_copies": {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in side.items()},
            "other_streams": {s: round(sum(b - a for a, b, _ in ev) / 1e6, 1) for s, ev in by_stream.items() if s != compute},
            "gaps_over_half_ms": big, "copies": timeline}
