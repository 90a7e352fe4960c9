"""Training as `accelerate launch` (DDP over N GPUs; torchrun with gloo on CPU) in a subprocess
whose output streams into this process's log, and whose processes never outlive it.

If the caller is interrupted (a cancelled flow run: SIGTERM, or an exception) the launcher's
process group is stopped; if the caller is killed outright, the kernel sends the launcher
SIGTERM (PR_SET_PDEATHSIG), and each rank gets the same from the launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from stages.config import ConfigError, RunConfig

LAUNCHED = "TAE_LAUNCHED"  # set in the processes `accelerate launch` starts for this stage


def launch(cfg: RunConfig, out_dir: Path) -> None:
    """Run `python -m stages.train` under the launcher for `training.num_processes` processes,
    output streamed line by line; raises unless it wrote <out_dir>/train_result.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    resolved = out_dir / "launch_config.yaml"
    resolved.write_text(cfg.to_yaml())
    n = cfg.training.num_processes
    if torch.cuda.is_available() and n > torch.cuda.device_count():
        raise ConfigError(f"training.num_processes: {n}, but this machine shows {torch.cuda.device_count()} GPU(s) "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); one process per GPU: "
                          f"set it to at most {torch.cuda.device_count()}")
    if torch.cuda.is_available():
        launcher = ["accelerate.commands.launch", "--num_processes", str(n), "--num_machines", "1", "--mixed_precision", "no",
                    "--dynamo_backend", "no", *(["--multi_gpu"] if n > 1 else [])]
    else:  # accelerate's multi-CPU path needs MPI; torchrun (what it wraps on GPUs) does CPU with gloo
        launcher = ["torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]
    cmd = [sys.executable, "-m", *launcher, "-m", "stages.train", "--config", str(resolved), "--out", str(out_dir)]
    print("train: " + " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=os.environ | {LAUNCHED: "1", "PYTHONUNBUFFERED": "1"}, preexec_fn=die_with_parent)
    # A cancelled flow run gets SIGTERM: stop the launcher first, then let Prefect's own handler act.
    installed, previous = _stop_on_sigterm(proc)
    try:
        for line in proc.stdout:
            print(line.rstrip())
        rc = proc.wait()
    except BaseException:
        _stop(proc)
        raise
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous)
    if rc != 0 or not (out_dir / "train_result.json").is_file():
        raise RuntimeError(f"accelerate launch of stages.train exited with {rc}; its output is above")


try:  # loaded before any fork: only the prctl call itself runs between fork and exec
    import ctypes

    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not Linux
    _LIBC = None


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies, even by SIGKILL (PR_SET_PDEATHSIG).
    Set in the launcher (whose parent is the flow run) and in each rank (whose parent is the launcher)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)


def _stop_on_sigterm(proc):
    """Install a SIGTERM handler that stops `proc`'s group and then defers to the previous handler."""
    def handler(signum, frame):
        _stop(proc)
        if callable(previous):
            previous(signum, frame)
        raise SystemExit(f"train: stopped by signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: the launcher still dies with this process (PDEATHSIG)
        return False, None
    return True, signal.SIG_DFL if previous is None else previous


def _stop(proc, grace_s: float = 10) -> None:
    """SIGTERM to the launcher's process group (torchrun forwards it to the ranks), SIGKILL after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
