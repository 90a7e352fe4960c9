"""Training as `accelerate launch` (DDP or FSDP over N GPUs, on one or more machines; torchrun with
gloo on CPU) in a subprocess whose output streams into this process's log, and whose processes
never outlive it.

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

from stages import result_files
from stages.config import ConfigError, RunConfig

LAUNCHED = "TAE_LAUNCHED"  # set in the processes `accelerate launch` starts for this stage


def launch(cfg: RunConfig, out_dir: Path) -> None:
    """Run `python -m stages.train` under the launcher for `training.num_processes` processes on this
    machine (of `training.num_machines`), output streamed line by line; raises unless it succeeded and,
    on machine 0, wrote <out_dir>/train_result.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t = cfg.training
    # machines of a multi-node run share out_dir on a shared file system: each its own copy
    resolved = out_dir / ("launch_config.yaml" if t.machine_rank == 0 else f"launch_config-machine{t.machine_rank}.yaml")
    resolved.write_text(cfg.to_yaml())
    n = t.num_processes
    if torch.cuda.is_available() and n > torch.cuda.device_count():
        raise ConfigError(f"training.num_processes: {n}, but this machine shows {torch.cuda.device_count()} GPU(s) "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); one process per GPU: "
                          f"set it to at most {torch.cuda.device_count()}")
    cmd = [sys.executable, "-m", *launcher_args(cfg, torch.cuda.is_available()), "-m", "stages.train", "--config", str(resolved),
           "--out", str(out_dir)]
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
    if rc != 0 or (t.machine_rank == 0 and not result_files.path(out_dir, "train").is_file()):
        raise RuntimeError(f"accelerate launch of stages.train exited with {rc}; its output is above")


def machine_result(out_dir: Path, machine_rank: int) -> Path:
    """Where a machine other than 0 keeps the train result its processes got from process 0, for its launcher:
    machine 0's files may not be on this machine (each its own copy, like its launch config)."""
    return Path(out_dir) / f"train_result-machine{machine_rank}.json"


def launcher_args(cfg: RunConfig, cuda: bool) -> list[str]:
    """The launcher module and its arguments: `accelerate launch` on GPUs; torchrun on CPU, whose gloo
    backend it wraps (accelerate's own multi-CPU path needs MPI). Multi-node: the same rendezvous
    (machine 0's address and port) on every machine, each with its own rank."""
    t = cfg.training
    if not cuda and t.distributed == "fsdp" and t.world_size == 1:
        raise ConfigError("distributed: fsdp on CPU needs at least 2 processes (gloo starts no process group for one); "
                          "set training.num_processes: 2 or distributed: ddp")
    if cuda:
        args = ["accelerate.commands.launch", "--num_processes", str(t.world_size), "--num_machines", str(t.num_machines),
                "--mixed_precision", "no", "--dynamo_backend", "no"]
        if t.num_machines > 1:
            args += ["--machine_rank", str(t.machine_rank), "--main_process_ip", t.main_process_ip,
                     "--main_process_port", str(t.main_process_port)]
        # torchrun even for one process with fsdp: the Trainer shards only in a process group
        return args + (["--multi_gpu"] if t.world_size > 1 or t.distributed == "fsdp" else [])
    args = ["torch.distributed.run", "--nproc_per_node", str(t.num_processes)]
    if t.num_machines == 1:
        return args + ["--standalone"]
    return args + ["--nnodes", str(t.num_machines), "--node_rank", str(t.machine_rank), "--master_addr", t.main_process_ip,
                   "--master_port", str(t.main_process_port)]


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
