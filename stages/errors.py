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
import sys
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
    """ENOSPC as one message: which file, which device, how much is free."""
    where = Path(path or err.filename or ".")
    probe = where if where.exists() else next((p for p in where.parents if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free / 2**30
    return DiskFull(errno.ENOSPC, f"no space left on the device of {probe} while writing {where} ({free:.2f} GiB free); "
                    "free some space (old runs under artifacts_dir/runs, the HF cache) or point artifacts_dir at a larger disk")


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
        e = e.__cause__ or e.__context__
    return None


def run_cli(main: Callable[[], object], prog: str, resume: str | None = None) -> int:
    """Run an entry point: 0 when it returns, 2 with one line for a user error, 130 on Ctrl-C.

    Args:
        resume: how to pick the run up again, said after Ctrl-C.
    """
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
