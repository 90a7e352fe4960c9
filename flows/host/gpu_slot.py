"""One GPU job per GPU, whichever way a run starts; no lock where there is no GPU.

With a Prefect server (PREFECT_API_URL: `prefect deployment run`, `flows.deploy serve`) the GPU
stages hold a slot of the global concurrency limit `gpu`, created on first use when missing.
Without one, each `python -m flows.train_and_export` starts its own temporary local API, which
cannot see another run's slots: the stages then hold an exclusive lock on a file every process
on the host opens, named for the GPUs it guards (TAE_GPU_LOCK, default
<tmp>/train-and-export-gpu-<GPUs>.lock): runs pinned to other GPUs (CUDA_VISIBLE_DEVICES) do not
wait for each other. On a machine with no GPU nothing is locked: runs there share only CPUs.
The GPUs are NVML's, as CUDA_VISIBLE_DEVICES selects them; TAE_GPU_IDS (comma-separated) names
them instead where NVML cannot see them. The log says which GPUs and how they are held, and each stage that held
them records when and how in its directory (`stage_slot`, <stage dir>/gpu_slot.json).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

GPU_LIMIT = os.environ.get("TAE_GPU_LIMIT", "gpu")  # a Prefect global concurrency limit
RECORD = "gpu_slot.json"  # in a stage's directory: when the stage held the GPU(s), and how


def visible_gpus() -> list[str]:
    """The GPUs this process's stages would use: NVML's devices (by UUID) as CUDA_VISIBLE_DEVICES selects
    them, or TAE_GPU_IDS; [] without a GPU or a driver. Read without importing torch (a second of start-up)."""
    named = os.environ.get("TAE_GPU_IDS")
    if named is not None:
        return [g for g in named.split(",") if g.strip()]
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver, no library: no GPU this process could use
        return []
    try:
        gpus = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()
    gpus = [g.decode() if isinstance(g, bytes) else g for g in gpus]
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if chosen is None:
        return gpus
    picked = []
    for c in (x.strip() for x in chosen.split(",") if x.strip()):
        if c.isdigit():
            if int(c) >= len(gpus):
                break  # CUDA stops at the first invalid entry
            picked.append(gpus[int(c)])
        else:  # a UUID (or its prefix)
            picked += [g for g in gpus if g.startswith(c) or g.removeprefix("GPU-").startswith(c)][:1]
    return picked


def lock_path(gpus: list[str]) -> Path:
    """The lock file of these GPUs: one per GPU set, so runs pinned to other GPUs never wait on each other."""
    if os.environ.get("TAE_GPU_LOCK"):
        return Path(os.environ["TAE_GPU_LOCK"])
    name = "-".join(g.removeprefix("GPU-")[:8] for g in gpus)
    return Path(tempfile.gettempdir()) / f"train-and-export-gpu-{name}.lock"


def ensure_gpu_limit(slots: int | None = None, *, resize: bool = True) -> int:
    """Create the `gpu` global concurrency limit (or, resize=True, set its slots); returns its slots.

    One slot per host by default: a run's stages use the host's GPU (cuda:0, or every GPU under
    launcher: accelerate). More slots only make sense with one serve process per GPU, each
    pinned by CUDA_VISIBLE_DEVICES and given its own TAE_GPU_LIMIT name.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    slots = slots or int(os.environ.get("TAE_GPU_SLOTS", "1"))
    with get_client(sync_client=True) as client:
        try:  # read first: a create of an existing limit makes the server log an IntegrityError traceback
            existing = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        except ObjectNotFound:
            existing = None
        if existing is None:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=slots))
                return slots
            except ObjectAlreadyExists:  # another run created it in between
                existing = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        if not resize:  # someone (flows.deploy, an admin, an earlier run) set it: theirs stands
            return existing.limit
        if existing.limit != slots:
            client.update_global_concurrency_limit(GPU_LIMIT, GlobalConcurrencyLimitUpdate(limit=slots))
    return slots


def _print(msg: str) -> None:
    print(msg)  # looked up when called: inside a task, Prefect's log_prints has replaced print by then


@contextlib.contextmanager
def host_lock(path: Path, holder: str, log=None) -> Iterator[None]:
    """An exclusive flock on `path`, waited for; the holder's description is written into the file."""
    log = log or _print
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(OSError):  # another user's runs must be able to open it too
        os.fchmod(fd, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"gpu: waiting for the host lock {path}, held by {os.pread(fd, 4096, 0).decode(errors='replace').strip() or 'another run'}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "holder": holder, "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock; so does the process dying, however it dies


@contextlib.contextmanager
def gpu_slot(holder: str, log=None) -> Iterator[str]:
    """Hold the GPU(s) for one stage; yields "prefect", "host-lock" or "no-gpu", whichever kept runs apart (or did not
    need to)."""
    log = log or _print
    from prefect.settings import PREFECT_API_URL

    gpus = visible_gpus()
    if not gpus:
        log(f"gpu: {holder} runs without the GPU lock: no GPU on this machine")
        yield "no-gpu"
        return
    url = PREFECT_API_URL.value()
    if url:
        from prefect.concurrency.sync import concurrency

        slots = ensure_gpu_limit(resize=False)
        with concurrency(GPU_LIMIT, occupy=1, strict=True):
            log(f"gpu: {holder} holds a slot of Prefect's global concurrency limit '{GPU_LIMIT}' ({slots} slot(s), {url})")
            yield "prefect"
    else:
        path = lock_path(gpus)
        with host_lock(path, f"{holder} on GPU {', '.join(gpus)}", log):
            log(f"gpu: {holder} holds the host lock {path} for GPU {', '.join(gpus)} (no Prefect server: the temporary local API "
                "cannot see other runs' slots)")
            yield "host-lock"


@contextlib.contextmanager
def stage_slot(stage: str, stage_dir: Path, flow_run_id: str | None) -> Iterator[None]:
    """Hold the GPU(s) for one stage of a flow run; once the stage completed, record in <stage_dir>/gpu_slot.json when
    the slot was held and how (the record of one GPU job at a time; a stage that failed leaves none).

    Args:
        stage: the stage's name, as the log and the record say it.
        stage_dir: the stage's directory of the run, where the record goes.
        flow_run_id: the Prefect flow run's id; None outside one (a `local` holder).
    """
    with gpu_slot(f"stage {stage} of flow run {flow_run_id or 'local'}") as how:
        acquired = time.time()
        yield
        slot = {"stage": stage, "acquired": acquired, "released": time.time(), "flow_run_id": str(flow_run_id), "by": how}
        (Path(stage_dir) / RECORD).write_text(json.dumps(slot))
