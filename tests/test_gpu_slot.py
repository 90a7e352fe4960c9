"""One GPU job per host for every way a run starts: Prefect's limit with a server, a host lock without."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from tests.conftest import REPO


def test_without_a_server_runs_queue_on_a_host_lock(tmp_path, monkeypatch):
    """Two `python -m flows.train_and_export` runs each start a temporary local API that cannot see the
    other's slots: a file lock keeps their GPU stages apart, and the second says whom it waits for."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.host import gpu_slot

    lock = tmp_path / "gpu.lock"
    monkeypatch.setenv("TAE_GPU_LOCK", str(lock))
    monkeypatch.setenv("TAE_GPU_IDS", "GPU-test0")  # a GPU to guard (CI has none: there nothing is locked)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from flows.host.gpu_slot import host_lock
        with host_lock(Path({str(lock)!r}), "stage train of run A"):
            print("held", flush=True)
            time.sleep(3)
    """)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    said = []
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        t0 = time.monotonic()
        with gpu_slot.gpu_slot("stage preflight of run B", log=said.append) as how:
            waited = time.monotonic() - t0  # the first run's stage held it for 3 s
    holder.wait()
    assert how == "host-lock" and waited > 1.5
    assert any("waiting for the host lock" in s and "stage train of run A" in s for s in said), said
    assert any("holds the host lock" in s and "for GPU GPU-test0" in s and "no Prefect server" in s for s in said), said


def test_a_crashed_holder_does_not_keep_the_gpu(tmp_path):
    """flock is released by the kernel when its process dies, even by SIGKILL: no stale lock file to clean."""
    from flows.host.gpu_slot import host_lock

    lock = tmp_path / "gpu.lock"
    holder = subprocess.Popen([sys.executable, "-c", f"from pathlib import Path\nfrom flows.host.gpu_slot import host_lock\n"
                               f"import time\nwith host_lock(Path({str(lock)!r}), 'x'):\n    print('held', flush=True)\n    time.sleep(60)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    t0 = time.monotonic()
    with host_lock(lock, "y"):
        assert time.monotonic() - t0 < 2


def test_with_a_server_the_limit_is_created_on_first_use(prefect_harness, monkeypatch):
    from prefect.client.orchestration import get_client

    from flows.host import gpu_slot

    monkeypatch.setenv("TAE_GPU_IDS", "GPU-test0")

    said = []
    with gpu_slot.gpu_slot("stage train of run C", log=said.append) as how:
        pass
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(gpu_slot.GPU_LIMIT)
    assert how == "prefect" and limit.limit == 1
    assert any("global concurrency limit 'gpu'" in s for s in said), said
    # a limit someone sized stands
    gpu_slot.ensure_gpu_limit(3)
    assert gpu_slot.ensure_gpu_limit(resize=False) == 3
    gpu_slot.ensure_gpu_limit(1)


def test_a_healthy_offline_run_logs_no_warning_or_error_and_says_how_it_holds_the_gpu(tmp_path):
    """`python -m flows.train_and_export` as users start it: no Prefect server, no internet. Nothing the
    project can prevent shows as WARNING or ERROR (Prefect's telemetry heartbeat was an ERROR with a
    traceback; bitsandbytes' CPU kernel notice and the converter's rope-type notice were WARNINGs), and
    each GPU stage says it holds the host lock."""
    import os

    from tests.conftest import write_config

    cfg = write_config(tmp_path, training={"max_steps": 10, "save_steps": 5}, smoke={"min_accuracy": 0.0, "max_prompts": 5},
                       export={"imatrix": "off"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {
        "PREFECT_HOME": str(tmp_path / "prefect"), "TAE_GPU_LOCK": str(tmp_path / "gpu.lock"), "HF_HUB_OFFLINE": "1",
        "TAE_GPU_IDS": "GPU-test0"}
    p = subprocess.run([sys.executable, "-m", "flows.train_and_export", "--config", str(cfg), "--run-id", "quiet"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    noisy = [line for line in out.splitlines() if "WARNING" in line or "ERROR" in line or "Traceback" in line]
    assert not noisy, noisy
    held = [line for line in out.splitlines() if "holds the host lock" in line]
    assert len(held) == 5 and all(str(tmp_path / "gpu.lock") in line for line in held), held


def test_no_gpu_no_lock_and_the_lock_is_named_for_its_gpus(tmp_path, monkeypatch):
    """A CPU-only machine serializes nothing (unrelated clones waited 48-61 s on each other's lock); with GPUs the
    lock file and its holder name the GPUs, so runs pinned to other GPUs do not wait."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.host import gpu_slot

    monkeypatch.delenv("TAE_GPU_LOCK", raising=False)
    monkeypatch.setenv("TAE_GPU_IDS", "")
    said = []
    with temporary_settings(restore_defaults={PREFECT_API_URL}), gpu_slot.gpu_slot("stage train of run D", log=said.append) as how:
        assert how == "no-gpu" and not list(tmp_path.glob("*.lock"))
    assert said == ["gpu: stage train of run D runs without the GPU lock: no GPU on this machine"]
    a, b = gpu_slot.lock_path(["GPU-aaaaaaaa-1111"]), gpu_slot.lock_path(["GPU-bbbbbbbb-2222", "GPU-cccccccc-3333"])
    assert a.name == "train-and-export-gpu-aaaaaaaa.lock" and b.name == "train-and-export-gpu-bbbbbbbb-cccccccc.lock"
    monkeypatch.setenv("TAE_GPU_IDS", "GPU-bbbbbbbb-2222")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    said.clear()
    with temporary_settings(restore_defaults={PREFECT_API_URL}), gpu_slot.gpu_slot("stage train of run E", log=said.append) as how:
        assert how == "host-lock" and "GPU-bbbbbbbb-2222" in (tmp_path / "train-and-export-gpu-bbbbbbbb.lock").read_text()
