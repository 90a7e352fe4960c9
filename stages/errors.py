"""The one boundary between a user's mistake and a traceback.

Every problem in what the user gave (the config, the data, the model files, the budget, the
run id, the disk) is a `UserError` whose message names the input, the problem and the fix.
Every entry point (the flow's CLI, each stage's CLI, flows.deploy) runs through `run_cli`:
one line on stderr and exit 2 for those, no traceback unless TAE_DEBUG=1 (or --debug) asks for it.
Inside a Prefect run, `quiet_prefect_tracebacks` keeps Prefect's task and flow loggers to that
one line as well.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

DEBUG_ENV = "TAE_DEBUG"


class UserError(Exception):
    """A problem in the user's inputs or environment; the message says what and how to fix it."""


class ConfigError(UserError, ValueError):
    """A config that cannot run; the message lists every problem and its fix."""


class ModelError(UserError, ValueError):
    """The base model directory cannot be used as it is."""


class MissingInput(UserError, FileNotFoundError):
    """A file or directory an entry point was pointed at is not there or not what it should be."""


class RunError(UserError):
    """The run id or run directory cannot be used (another run holds it, it already published, ...)."""


class DiskFull(UserError, OSError):
    """No space left while writing a run's files."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # the message, without OSError's "[Errno 28]"


def no_space(err: OSError, path: str | os.PathLike | None = None) -> DiskFull:
    """ENOSPC as one message: which file, which filesystem (its mount point), how much is free there.

    Args:
        path: what was being written when `err` does not say (a write() on an open file names no file).
    """
    where = Path(err.filename or path or ".").resolve()  # a relative name is relative to this process's directory
    fs = Filesystem.of(where)
    return DiskFull(errno.ENOSPC, f"no space left on the filesystem mounted at {fs.mount} ({fs.describe()}) while writing {where}; "
                    "free some space there (old runs under artifacts_dir/runs, the HF cache) or point artifacts_dir at a larger disk")


class Filesystem:
    """The filesystem a path is on (or would be, once created): its mount point and space."""

    def __init__(self, existing: Path) -> None:
        self.existing = existing                 # the path, or its nearest existing parent
        self.device = existing.stat().st_dev
        self.mount = mount_point(existing)
        usage = shutil.disk_usage(existing)
        self.free, self.total = usage.free, usage.total

    @classmethod
    def of(cls, path: str | os.PathLike) -> Filesystem:
        p = Path(path).resolve()
        return cls(next(q for q in (p, *p.parents) if q.exists()))

    def describe(self) -> str:
        return f"{gib(self.free)} free of {gib(self.total)}"


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding `path` (an existing path): the highest parent on the same device."""
    path = Path(path).resolve()
    device = path.stat().st_dev
    for parent in path.parents:
        if parent.stat().st_dev != device:
            return path
        path = parent
    return path


def gib(n: float) -> str:
    """A size for a message: GiB, or MiB below 1 GiB (a small tmpfs would read 0.00 GiB)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class MissingPackage(UserError, ImportError):
    """A package the pipeline needs is not importable in this environment."""


# Imported where they are used, after training, by stages that would otherwise fail with a bare ModuleNotFoundError.
REQUIRED_PACKAGES = {"llama_cpp": "llama-cpp-python", "gguf": "gguf"}


def missing_package(err: ModuleNotFoundError) -> MissingPackage | None:
    """A ModuleNotFoundError for one of REQUIRED_PACKAGES as the install problem it is; None for any other module."""
    name = (err.name or "").split(".")[0]
    if name not in REQUIRED_PACKAGES:
        return None
    return MissingPackage(f"the Python package {REQUIRED_PACKAGES[name]} (`import {name}`) is not installed in {sys.executable}'s "
                          "environment; run `bash scripts/install.sh` in it (it builds llama-cpp-python and installs gguf from the "
                          "converter's gguf-py)")


INJECT_ENV = "TAE_INJECT"  # test hook: the fault point to fail at, e.g. export-quantize


def inject(point: str, path: Path | None = None) -> None:
    """Test hook: a full disk at `point` when TAE_INJECT names it (a tmpfs cannot be mounted everywhere tests
    run), or this process killed there (SIGKILL) when it says `<point>:kill`."""
    wanted = os.environ.get(INJECT_ENV)
    if wanted == point:
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path) if path else None)
    if wanted == f"{point}:kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def as_user_error(err: BaseException) -> UserError | None:
    """The user error behind `err` (itself, or what it was raised from), or None for a bug."""
    seen = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, UserError):
            return e
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return no_space(e)
        if isinstance(e, ModuleNotFoundError) and (missing := missing_package(e)) is not None:
            return missing
        e = e.__cause__ or e.__context__
    return None


# Ctrl-C as state as well as an exception: Python raises KeyboardInterrupt in whatever Python code the main thread
# runs next, and when that is a finalizer (a __del__ or weakref callback run by the garbage collector mid-step, an
# asyncio transport's __del__ in the flow) it prints "Exception ignored ... Traceback" and drops it: the run went on
# training (a suite run's Ctrl-C test hung this way), and the user read a traceback after Ctrl-C. So the handler
# also sets a flag that long loops check (each training step, each flow stage's start: check_interrupted),
# and while an entry point runs, a KeyboardInterrupt dropped by a finalizer is not printed: the check raises it.
# (Delivering it again at once, with _thread.interrupt_main, runs the handler inside the hook itself, and a delayed
# delivery can land after the entry point has returned.)
INTERRUPTED = threading.Event()


def _on_sigint(signum, frame) -> None:
    INTERRUPTED.set()
    signal.default_int_handler(signum, frame)


def _quiet_lost_ctrl_c(previous: Callable[[object], None]) -> Callable[[object], None]:
    def hook(unraisable) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt) and INTERRUPTED.is_set():
            return  # check_interrupted raises it again
        previous(unraisable)

    return hook


def check_interrupted() -> None:
    """Raise KeyboardInterrupt if Ctrl-C came and its exception was lost; called between training steps and stages."""
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt


def run_cli(main: Callable[[], object], prog: str, resume: str | None = None) -> int:
    """Run an entry point: 0 when it returns, 2 with one line for a user error, 130 on Ctrl-C.

    Args:
        resume: how to pick the run up again, said after Ctrl-C.
    """
    # only where Python's own Ctrl-C handler is in place (not where SIGINT is ignored, or another handler owns it)
    ours = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        INTERRUPTED.clear()
        signal.signal(signal.SIGINT, _on_sigint)
        unraisablehook, sys.unraisablehook = sys.unraisablehook, _quiet_lost_ctrl_c(sys.unraisablehook)
    try:
        main()
        return 0
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted." + (f" Nothing was published; to resume: {resume}" if resume else ""), file=sys.stderr)
        return 130
    except BaseException as e:  # noqa: BLE001 - sorting bugs from user errors is this function's job
        user = as_user_error(e)
        if user is None or os.environ.get(DEBUG_ENV):
            raise
        print(f"\n{prog} stopped: {type(user).__name__}: {user}", file=sys.stderr)
        return 2
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            sys.unraisablehook = unraisablehook
            # the flag belongs to this entry point's run: left set, the next run in this process (a notebook, a
            # test session, a flow's next task) would stop at its first step for a Ctrl-C already answered
            INTERRUPTED.clear()


class _NoUserErrorTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and as_user_error(record.exc_info[1]) is not None \
                and not os.environ.get(DEBUG_ENV):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_prefect_tracebacks() -> None:
    """A task or flow that fails on a user error logs its one line, not the traceback above it."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoUserErrorTracebacks) for f in logger.filters):
            logger.addFilter(_NoUserErrorTracebacks())
