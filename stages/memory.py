"""Memory measurement: the one helper every stage, the training callback and bench/ use.

`stats()` returns numbers (GiB, unit in the key); `track(stage_dir)` resets the peaks at a
stage boundary, and on exit writes `<stage_dir>/memory.json` covering that stage alone.

On CPU the figure is the process's peak resident set (VmHWM), reset per stage through
/proc/self/clear_refs, labelled `peak_rss_gib`; child processes (the GGUF converter) are
measured through a small launcher (stages/peak_rss.py) and reported as `child_peak_rss_gib`. On CUDA: torch's peak
allocated / reserved / active and NVML's device-wide used memory, which also counts
llama.cpp and other processes that torch cannot see.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

GIB = 1024**3
STEPS_FILE = "memory_steps.jsonl"  # one row per optimizer step, in the train stage's directory
# A torch process's CUDA context (driver, kernels): outside the allocator, so outside what the estimate and the probe
# count; a typical figure, not measured here. It comes off a GPU's budget first (preflight, autofit).
CUDA_CONTEXT_GIB = 0.5


@dataclass
class MemoryReport:
    stage: str
    device: str                       # "cpu" or the CUDA device name
    wall_s: float
    peak_rss_gib: float               # this process, this stage
    child_peak_rss_gib: float | None  # largest child process of this stage (converter), if any
    peak_alloc_gib: float | None = None     # torch, CUDA only; counters reset at the stage start
    peak_reserved_gib: float | None = None
    peak_active_gib: float | None = None
    start_alloc_gib: float | None = None    # torch memory already held when the stage began (an earlier stage's)
    start_reserved_gib: float | None = None
    end_alloc_gib: float | None = None      # what the stage left allocated
    nvml_used_gib: float | None = None      # whole device, at the end of the stage
    device_total_gib: float | None = None
    extra: dict = field(default_factory=dict)  # stage-specific figures (e.g. llama.cpp's device use)

    @property
    def peak_gib(self) -> float:
        """The headline number: peak reserved on GPU, else the larger of own and child peak RSS."""
        if self.peak_reserved_gib is not None:
            return self.peak_reserved_gib
        return max(self.peak_rss_gib, self.child_peak_rss_gib or 0.0)

    def to_json(self) -> dict:
        return asdict(self) | {"peak_gib": self.peak_gib}


def jsonable(result) -> dict:
    """A stage's result dataclass as JSON-ready data, its MemoryReport with the headline peak."""
    d = asdict(result)
    if getattr(result, "memory", None) is not None:
        d["memory"] = result.memory.to_json()
    return json.loads(json.dumps(d, default=str))


def _read_status_kib(key: str, pid: int | str = "self") -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> None:
    # Writing 5 resets VmHWM to the current RSS (Linux >= 4.0); elsewhere the peak stays
    # process-wide, which over- rather than under-states a stage.
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_gib() -> float:
    kib = _read_status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024 / GIB


def _cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def free_gpu() -> None:
    """Return what dropped references held: Python garbage, the CUDA cache, and the pinned host
    blocks torch keeps cached (rounded up to powers of two) after the activation offload; the
    next stage in this process, or llama.cpp loading onto the same GPU, gets them."""
    import gc

    gc.collect()
    torch = _cuda()
    if torch is None:
        return
    torch.cuda.empty_cache()
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):
        if hasattr(torch._C, name):
            getattr(torch._C, name)()
            break


def card(requested_gib: float | None, index: int = 0) -> tuple[str, float]:
    """The training card's name and memory budget in GiB: `requested_gib` (preflight.gpu_memory_gib), at most the
    GPU's total, else the total; without CUDA, "cpu" and the available RAM (or `requested_gib`)."""
    torch = _cuda()
    if torch is not None:
        total = torch.cuda.get_device_properties(index).total_memory / GIB
        return torch.cuda.get_device_name(index), min(requested_gib or total, total)
    import psutil

    return "cpu", requested_gib or psutil.virtual_memory().available / GIB


def usable_gib(budget_gib: float, margin: float, on_gpu: bool) -> float:
    """What a run may use of a budget: the CUDA context (driver, kernels) comes off first, because it lives outside
    torch's allocator, which the estimate and the probe measure; then preflight.margin."""
    return (budget_gib - (CUDA_CONTEXT_GIB if on_gpu else 0.0)) * (1 - margin)


def nvml_used_gib(index: int = 0) -> tuple[float, float] | None:
    """(used, total) GiB of the whole device from NVML, or None without a GPU/driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            return info.used / GIB, info.total / GIB
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def stats() -> dict[str, float]:
    """Current and peak figures right now; cheap enough for every logging step."""
    out = {"rss_gib": (_read_status_kib("VmRSS") or 0) * 1024 / GIB, "peak_rss_gib": peak_rss_gib()}
    torch = _cuda()
    if torch is not None:
        s = torch.cuda.memory_stats()
        out |= {
            "alloc_gib": s.get("allocated_bytes.all.current", 0) / GIB,
            "reserved_gib": s.get("reserved_bytes.all.current", 0) / GIB,
            "active_gib": s.get("active_bytes.all.current", 0) / GIB,
            "peak_alloc_gib": s.get("allocated_bytes.all.peak", 0) / GIB,
            "peak_reserved_gib": s.get("reserved_bytes.all.peak", 0) / GIB,
            "peak_active_gib": s.get("active_bytes.all.peak", 0) / GIB,
        }
        nv = nvml_used_gib(torch.cuda.current_device())
        if nv:
            out["nvml_used_gib"] = nv[0]
    return out


class track:
    """Measure one stage; writes <stage_dir>/memory.json on exit, success or failure.

        with memory.track("export", out_dir) as meter:
            meter.run([sys.executable, "convert_hf_to_gguf.py", ...])   # child's own peak RSS too
            meter.extra["gguf_mib"] = 12.5
        meter.report.peak_gib

    The figures are the stage's own: what earlier stages dropped is collected and the CUDA
    cache emptied before the peak counters are reset, and what was still allocated then is
    recorded apart (start_alloc_gib). A stage that does not use torch on the GPU (gpu=False:
    hand-off, or smoke, whose llama.cpp runs in a child process measured by NVML) has no
    torch figures at all rather than a copy of what the process happened to hold.
    """

    def __init__(self, stage: str, stage_dir: Path, *, gpu: bool = True) -> None:
        self.stage, self.stage_dir, self.gpu = stage, Path(stage_dir), gpu
        self.child_peak_gib: float | None = None
        self.extra: dict = {}
        self.report: MemoryReport | None = None

    def __enter__(self) -> track:
        self._torch = _cuda() if self.gpu else None
        free_gpu()  # llama.cpp (smoke) too gets the GPU memory earlier stages dropped
        _reset_peak_rss()
        if self._torch is not None:
            self._torch.cuda.synchronize()
            self._torch.cuda.reset_peak_memory_stats()
            self._start = (self._torch.cuda.memory_allocated() / GIB, self._torch.cuda.memory_reserved() / GIB)
        self._t0 = time.perf_counter()
        return self

    def run(self, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run(cmd) that also records the child's own peak RSS.

        Through stages/peak_rss.py: ru_maxrss of a child forked from this (large) process
        would count the pages it shared at fork (0.7 GiB of torch for a 0.4 GiB child).
        """
        with tempfile.NamedTemporaryFile("r", suffix=".kib") as peak:
            launcher = [sys.executable, str(Path(__file__).with_name("peak_rss.py")), peak.name, "--", *cmd]
            proc = subprocess.run(launcher, **kwargs)
            text = Path(peak.name).read_text().strip()
        if text:
            self.child_peak_gib = max(self.child_peak_gib or 0.0, int(text) * 1024 / GIB)
        return subprocess.CompletedProcess(cmd, proc.returncode, proc.stdout, proc.stderr)

    def __exit__(self, *exc) -> None:
        r = MemoryReport(
            stage=self.stage,
            device="cpu",
            wall_s=round(time.perf_counter() - self._t0, 3),
            peak_rss_gib=peak_rss_gib(),
            child_peak_rss_gib=self.child_peak_gib,
            extra=self.extra,
        )
        torch = self._torch
        if torch is not None:
            torch.cuda.synchronize()
            s = stats()
            r.device = torch.cuda.get_device_name()
            r.peak_alloc_gib, r.peak_reserved_gib, r.peak_active_gib = (
                s["peak_alloc_gib"], s["peak_reserved_gib"], s["peak_active_gib"])
            r.start_alloc_gib, r.start_reserved_gib = (round(v, 4) for v in self._start)
            r.end_alloc_gib = round(s["alloc_gib"], 4)
            nv = nvml_used_gib(torch.cuda.current_device())
            if nv:
                r.nvml_used_gib, r.device_total_gib = nv
        self.report = r
        self.stage_dir.mkdir(parents=True, exist_ok=True)
        (self.stage_dir / "memory.json").write_text(json.dumps(r.to_json(), indent=2))


def markdown_table(reports: dict[str, dict | MemoryReport | None]) -> list[str]:
    """Each stage's own figures as Markdown rows, for the run summary and the model card (one layout).

    GPU: torch's peak reserved and allocated since the stage began, and what it found already
    held (an earlier stage's, normally 0.06 GiB of cuBLAS workspaces); host: its peak RSS and
    its child processes' (the converter, llama.cpp). A stage that does not use torch on the
    GPU shows "-" there, not what the process happened to hold.
    """
    def gib(v) -> str:
        return "-" if v is None else f"{v:.2f}"

    rows = ["| stage | wall s | GPU peak reserved GiB | GPU peak allocated GiB | GPU held at start GiB | host peak RSS GiB | child peak RSS GiB |",
            "|---|---|---|---|---|---|---|"]
    for name, r in reports.items():
        if r is None:
            rows.append(f"| {name} | skipped | - | - | - | - | - |")
            continue
        d = r.to_json() if isinstance(r, MemoryReport) else r
        rows.append(f"| {name} | {d['wall_s']:.1f} | {gib(d.get('peak_reserved_gib'))} | {gib(d.get('peak_alloc_gib'))} | "
                    f"{gib(d.get('start_reserved_gib'))} | {gib(d.get('peak_rss_gib'))} | {gib(d.get('child_peak_rss_gib'))} |")
    return rows


# With expandable_segments the caching allocator maps physical memory page by page: 2 MiB pages for its small
# pool (blocks of at most 1 MiB), 20 MiB pages (kLargeBuffer) for the large pool. Capped, it unmaps free pages
# when a request would pass the cap, so a capped run needs, at least, the most pages its live blocks touch at
# once: more than the peak allocated (a page that a live block shares with free space stays mapped), less than
# an uncapped run reserves (free pages it never had to give back).
SMALL_BLOCK, SMALL_PAGE, LARGE_PAGE = 1 << 20, 2 << 20, 20 << 20


def pages_touched_peak(live: dict[int, int], events: list[dict]) -> int:
    """Replay the allocator's events over the blocks `live` at the start (address -> size): the most bytes of
    pages that live blocks touched at one moment. Events are torch.cuda.memory._snapshot()'s device trace."""
    live = dict(live)  # the caller's record stays as it was
    count: dict[tuple[int, int], int] = {}
    mapped = 0

    def touch(addr: int, size: int, step: int) -> None:
        nonlocal mapped
        page = SMALL_PAGE if size <= SMALL_BLOCK else LARGE_PAGE
        for p in range(addr // page, (addr + size - 1) // page + 1):
            key = (page, p)
            n = count.get(key, 0) + step
            if n == 0:
                del count[key]
                mapped -= page
            else:
                if n == 1 and step == 1:
                    mapped += page
                count[key] = n

    for addr, size in live.items():
        touch(addr, size, 1)
    peak = mapped
    for e in events:
        if e["action"] == "alloc":
            if e["addr"] in live:  # freed before the record began, completed unseen
                touch(e["addr"], live.pop(e["addr"]), -1)
            live[e["addr"]] = e["size"]
            touch(e["addr"], e["size"], 1)
            peak = max(peak, mapped)
        elif e["action"] == "free_completed" and e["addr"] in live:
            touch(e["addr"], live.pop(e["addr"]), -1)
    return peak


class page_need:
    """What a capped run of the work inside needs at least: the allocator's events recorded (no stacks) and
    replayed page by page (pages_touched_peak). `.gib` after the block; None off CUDA or if the record overflowed.

        with memory.page_need() as need:
            trainer.train()
        need.gib
    """

    MAX_EVENTS = 3_000_000

    def __init__(self) -> None:
        self.gib: float | None = None
        self.torch = _cuda()

    def __enter__(self) -> page_need:
        if self.torch is not None:
            mem = self.torch.cuda.memory
            self.live = {b["address"]: b["size"] for seg in mem._snapshot()["segments"] for b in seg["blocks"]
                         if b["state"] == "active_allocated"}
            mem._record_memory_history(enabled="all", context=None, stacks="python", max_entries=self.MAX_EVENTS,
                                       clear_history=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.torch is None:
            return
        mem = self.torch.cuda.memory
        try:
            traces = mem._snapshot()["device_traces"]
        finally:
            mem._record_memory_history(enabled=None)
        events = traces[self.torch.cuda.current_device()] if traces else []
        if len(events) < self.MAX_EVENTS:  # a full ring buffer lost its oldest events: no figure rather than a low one
            self.gib = pages_touched_peak(self.live, events) / GIB
