"""Nothing outlives a flow process, however it ends.

Without a Prefect server, each run starts a temporary API server (uvicorn) as a child. Two
problems, measured: `kill -9` of the flow process left that server running; Ctrl-C reached the
server too (same process group), so the flow process spent ~75 s retrying a dead API before it
could report the interruption.

    python -m flows.host.reaper PID < pipe      # started by watch(); not for users

`watch()` starts a small watchdog holding the read end of a pipe whose write end only this
process has: when this process dies, by any signal, the pipe closes and the watchdog stops
the descendants it last saw. `isolate_temporary_api()` starts Prefect's temporary server in
its own session, so a terminal's Ctrl-C interrupts the flow and not the API it reports to.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys


def watch() -> None:
    """Start the watchdog for this process (idempotent)."""
    if getattr(watch, "started", False):
        return
    read, write = os.pipe()  # both ends close-on-exec: no other child inherits the write end
    subprocess.Popen([sys.executable, "-m", "flows.host.reaper", str(os.getpid())], stdin=read, start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(read)
    watch.started, watch.fd = True, write  # kept open for this process's life


def isolate_temporary_api() -> None:
    """Prefect's temporary API server in a session of its own (out of reach of the terminal's Ctrl-C)."""
    from prefect.server.api import server

    cls = server.SubprocessASGIServer
    if getattr(cls, "_tae_isolated", False):
        return
    original = cls._run_uvicorn_command

    def run_in_own_session(self):
        popen = subprocess.Popen

        def own_session(*args, **kwargs):
            return popen(*args, **kwargs, start_new_session=True)

        subprocess.Popen = own_session
        try:
            return original(self)
        finally:
            subprocess.Popen = popen

    cls._run_uvicorn_command, cls._tae_isolated = run_in_own_session, True


def _reap(parent: int, every_s: float = 0.5) -> None:
    import psutil

    seen: dict[int, float] = {}
    while True:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(parent).children(recursive=True):
                if p.pid != os.getpid():
                    with contextlib.suppress(psutil.Error):
                        seen[p.pid] = p.create_time()
        ready, _, _ = select.select([sys.stdin], [], [], every_s)
        if ready and not os.read(sys.stdin.fileno(), 1):  # EOF: the parent is gone
            break
    alive = []
    for pid, created in seen.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == created:  # the same process, not a reused pid
                p.send_signal(signal.SIGTERM)
                alive.append(p)
    _, still = psutil.wait_procs(alive, timeout=5)
    for p in still:
        with contextlib.suppress(psutil.Error):
            p.kill()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _reap(int(sys.argv[1]))
