"""The pipeline as users run it: a real Prefect server (SQLite, loopback), the deployments
served by `python -m flows.deploy serve`, runs started with `prefect deployment run`."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from stages.paths import STAGES
from tests.conftest import REPO, write_config

pytestmark = pytest.mark.slow
# the imatrix (a pass over the training data, each type quantized and measured twice) is tested in tests/test_imatrix.py,
# the adapter's proof (the base converted again, both served and compared) in tests/test_adapter_handoff.py
FAST = {"training": {"max_steps": 10, "save_steps": 5}, "smoke": {"min_accuracy": 0.0, "max_prompts": 5}, "export": {"imatrix": "off"},
        "handoff": {"adapter": "off"}}
GPU_STAGES = ("preflight", "train", "merge", "export", "smoke")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str, every: float = 1.0):
    end = time.time() + timeout
    while time.time() < end:
        got = predicate()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


class Server:
    """A prefect server + `flows.deploy serve`, and a sync client against them."""

    def __init__(self, tmp: Path) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}/api"
        self.env = os.environ | {"PREFECT_HOME": str(tmp / "prefect"), "PREFECT_API_URL": self.url, "PREFECT_SERVER_UI_ENABLED": "false",
                                 "PREFECT_LOGGING_LEVEL": "INFO", "TAE_GPU_SLOTS": "1",
                                 # the runner asks for scheduled runs every 2 s, not 10: each run here started idle 5 s on average
                                 "PREFECT_RUNNER_POLL_FREQUENCY": "2",
                                 "TAE_GPU_IDS": "GPU-test0"}  # a GPU to guard: CI has none, and a GPU-less machine locks nothing
        self.log = (tmp / "server.log").open("w")
        self.server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                       env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait(self._healthy, 180, "the Prefect server")
        # the data lives in tmp so a test can change it
        data = tmp / "data"
        data.mkdir()
        for f in ("translate_train.jsonl", "translate_eval.jsonl"):
            shutil.copy(REPO / "assets" / "data" / f, data / f)
        self.config = write_config(tmp, **FAST, data={"train_file": str(data / "translate_train.jsonl"),
                                                      "eval_file": str(data / "translate_eval.jsonl")})
        self.serve_log = (tmp / "serve.log").open("w")
        self.serve = subprocess.Popen([sys.executable, "-m", "flows.deploy", "serve", "--config", str(self.config), "--cron", "0 0 1 1 *"],
                                      cwd=REPO, env=self.env, stdout=self.serve_log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait(lambda: self._deployment("train-and-export/default") and self._deployment("retrain-on-new-data/scheduled"),
              120, "the served deployments")

    def _healthy(self) -> bool:
        try:
            return urllib.request.urlopen(self.url + "/health", timeout=2).status == 200
        except OSError:
            return False

    def client(self):
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        class Ctx:
            def __enter__(ctx):
                ctx.settings = temporary_settings({PREFECT_API_URL: self.url})
                ctx.settings.__enter__()
                ctx.client = get_client(sync_client=True)
                return ctx.client.__enter__()

            def __exit__(ctx, *exc):
                ctx.client.__exit__(*exc)
                ctx.settings.__exit__(*exc)

        return Ctx()

    def _deployment(self, name: str):
        from prefect.exceptions import ObjectNotFound

        try:
            with self.client() as c:
                return c.read_deployment_by_name(name)
        except ObjectNotFound:
            return None

    def cli_run(self, deployment: str, **params) -> str:
        args = [sys.executable, "-m", "prefect", "deployment", "run", deployment]
        for k, v in params.items():
            args += ["--param", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
        out = subprocess.run(args, env=self.env, capture_output=True, text=True, check=True).stdout
        return re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1)

    def wait_done(self, flow_run_id: str, timeout: float = 420):
        def final():
            with self.client() as c:
                fr = c.read_flow_run(flow_run_id)
            return fr if fr.state and fr.state.is_final() else None

        return _wait(final, timeout, f"flow run {flow_run_id}", every=2)

    def runs_of(self, deployment: str) -> list:
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

        dep = self._deployment(deployment)
        with self.client() as c:
            return c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))

    def close(self) -> None:
        for p in (self.serve, self.server):
            try:
                os.killpg(p.pid, 15)
                p.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, 9)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("deploy"))
    yield s
    s.close()


def _artifact_keys(server, flow_run_id) -> set[str]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with server.client() as c:
        return {a.key for a in c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))}


def test_two_deployment_runs_started_together_complete_with_memory_artifacts_and_never_share_the_gpu(server):
    ids = [server.cli_run("train-and-export/default", config=str(server.config)) for _ in range(2)]
    runs = [server.wait_done(i) for i in ids]
    assert all(r.state.is_completed() for r in runs), ([r.state for r in runs], server.serve_log.name)
    for r in runs:  # every stage's memory record, the fidelity gate and the summary, as Prefect artifacts of each run
        assert {f"memory-{s}" for s in STAGES} | {"fidelity", "run-summary"} <= _artifact_keys(server, r.id)
    # both flow runs were live at the same time: the queueing was real
    assert max(r.start_time for r in runs) < min(r.end_time for r in runs)
    slots = {}
    for f in Path(server.config).parent.glob("artifacts/runs/*/*/gpu_slot.json"):
        s = json.loads(f.read_text())
        if s["flow_run_id"] in ids:
            slots.setdefault(s["flow_run_id"], []).append((s["acquired"], s["released"], s["stage"]))
    assert [len(slots[i]) for i in ids] == [len(GPU_STAGES)] * 2
    for a0, a1, sa in slots[ids[0]]:
        for b0, b1, sb in slots[ids[1]]:
            assert a1 <= b0 or b1 <= a0, f"{sa} of run 1 and {sb} of run 2 held the GPU at once"


def test_new_data_starts_exactly_one_run_and_no_change_none(server):
    def pipeline_runs():
        return len(server.runs_of("train-and-export/default"))

    def checks():
        return server.runs_of("retrain-on-new-data/scheduled")

    def notify():
        seen = {r.id for r in checks()}
        subprocess.run([sys.executable, "-m", "flows.deploy", "notify", "--config", str(server.config)], cwd=REPO, env=server.env, check=True)
        new = _wait(lambda: [r for r in checks() if r.id not in seen], 120, "the event-triggered check")
        return server.wait_done(new[0].id, timeout=120)

    # the earlier tests published bundles of this data: nothing to do
    before = pipeline_runs()
    check = notify()
    assert check.state.is_completed() and pipeline_runs() == before
    # new data lands, with a new held-out set: one run, judged against the champion on the new held-out prompts (the
    # champion's GGUFs answer them too), promoted or kept as a candidate, never a crash after training
    data = yaml.safe_load(Path(server.config).read_text())["data"]
    train_file, eval_file = Path(data["train_file"]), Path(data["eval_file"])
    train_file.write_text(train_file.read_text() + train_file.read_text().splitlines()[0] + "\n")
    held_out = eval_file.read_text()
    eval_file.write_text("".join(held_out.splitlines(True)[10:]))
    notify()
    _wait(lambda: pipeline_runs() == before + 1, 60, "the retraining run")
    newest = max(server.runs_of("train-and-export/default"), key=lambda r: r.created)
    state = server.wait_done(newest.id).state
    cfg = yaml.safe_load(Path(server.config).read_text())
    root = Path(cfg["handoff"]["dir"]) / cfg["handoff"]["model_name"]
    retrain = max((p for p in root.iterdir() if p.is_dir() and not p.is_symlink()), key=lambda p: p.stat().st_mtime)
    comparison = (retrain / "comparison.md").read_text()
    assert "the champion re-asked the current held-out prompts" in comparison and "the held-out data changed" in comparison, comparison
    promoted = (root / "latest").resolve() == retrain.resolve()
    assert (state.is_completed() and promoted) or (state.is_failed() and not promoted and "worse than the bundle" in state.message), state
    if not promoted:  # the champion was judged on the earlier held-out set: the tests after this one compare on its data
        eval_file.write_text(held_out)
    # the same new data again (a second event): the run it caused is the only one
    notify()
    assert pipeline_runs() == before + 1


def test_cancelling_a_run_stops_its_training_processes(server):
    """`prefect flow-run cancel` on a run training under `launcher: accelerate` (2 ranks):
    the run ends Cancelled and no training process is left to hold the GPUs."""
    import psutil

    def training_processes():
        procs = []
        for p in psutil.Process(server.serve.pid).children(recursive=True):
            try:
                if "stages.train" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                    procs.append(p)
            except psutil.NoSuchProcess:
                pass
        return procs

    run = server.cli_run("train-and-export/default", config=str(server.config),
                         overrides=["training.launcher=accelerate", "training.num_processes=2", "training.max_steps=100000"])
    procs = _wait(lambda: (lambda ps: ps if len(ps) >= 3 else None)(training_processes()), 240, "the launcher and its 2 ranks")
    subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", run], env=server.env, check=True, capture_output=True)
    # Prefect 3.9's engine first records the SIGTERM as Crashed; its runner then marks the run Cancelled
    def settled():
        with server.client() as c:
            state = c.read_flow_run(run).state
        return state if state.is_cancelled() else None

    _wait(settled, 120, "the run to be Cancelled")
    def alive(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # reaped between the two calls
            return False

    _wait(lambda: not any(alive(p) for p in procs), 60, "the training processes to exit")


def test_a_worse_retrain_through_the_deployment_is_a_candidate_not_latest(server):
    """Champion/challenger through the served deployment: a deliberately worse retrain of the same model name (5 steps
    at a learning rate that teaches nothing, so its eval loss on the same held-out data stays at the base's) fails its
    flow run (what an automation alerts on), its bundle is published as a candidate with its comparison, and
    `latest` still points at the champion."""
    cfg = yaml.safe_load(Path(server.config).read_text())
    root = Path(cfg["handoff"]["dir"]) / cfg["handoff"]["model_name"]
    champion = (root / "latest").resolve().name  # the earlier tests published this data's bundles
    fr = server.wait_done(server.cli_run("train-and-export/default", config=str(server.config),
                                         overrides=["training.max_steps=5", "training.learning_rate=1.0e-6"]))
    assert fr.state.is_failed() and "worse than the bundle `latest` points at" in (fr.state.message or ""), fr.state
    assert (root / "latest").resolve().name == champion
    candidate = max((p for p in root.iterdir() if p.is_dir() and p.name != champion), key=lambda p: p.stat().st_mtime)
    assert "**worse** (eval loss" in (candidate / "comparison.md").read_text()
    assert "champion-challenger" in _artifact_keys(server, fr.id)
