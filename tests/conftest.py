"""Shared fixtures: an isolated Prefect, configs that write under tmp, and one real
end-to-end run of the default pipeline that several tests inspect.

`python -m pytest` runs on 2 pytest-xdist workers (pyproject's addopts: `-n 2 --dist loadgroup`). Each worker is
its own process: it imports this file, so it has its own PREFECT_HOME, its own temporary Prefect API and its
own basetemp; every test writes under tmp_path and every server listens on a free port. Tests that share an
expensive module- or session-scoped fixture (one run that several tests inspect) are kept on one worker
(`xdist_group`, set below from the fixtures they use), so that run happens once. `-n 0` runs serially."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

# Before prefect is imported anywhere: its home (SQLite DB, settings) in a temp dir, and
# never a user's server.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="tae-prefect-")
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One torch thread per process: the suite runs a test process beside flow, server and training subprocesses on
# 2 cores, and torch's intra-op threads spinning for a core another process holds made 40 training steps take
# 208 s instead of 12 s. Set before torch is imported here, inherited by every subprocess the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "configs" / "default.yaml"


def write_config(tmp: Path, base: Path = DEFAULT, **sections) -> Path:
    """`base` (configs/default.yaml) with absolute asset paths, outputs under `tmp`, and `sections` merged in."""
    raw = yaml.safe_load(base.read_text())
    raw["model"]["name_or_path"] = str(REPO / raw["model"]["name_or_path"])
    for key in ("train_file", "eval_file"):
        raw["data"][key] = str(REPO / raw["data"][key])
    raw["artifacts_dir"] = str(tmp / "artifacts")
    raw["handoff"]["dir"] = str(tmp / "handoff")
    for name, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(name, {}).update(values)
        else:
            raw[name] = values
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def killed_then_rerun(cfg_path: Path, out: Path, checkpoint: int) -> dict:
    """`python -m stages.train` on `cfg_path` into `out`, killed with SIGKILL once checkpoint-`checkpoint` is
    written (no adapter published yet), then the same command run to its end; returns its train_result.json."""
    import signal
    import time

    import torch

    cmd = [sys.executable, "-m", "stages.train", "--config", str(cfg_path), "--out", str(out)]
    env = os.environ | {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (out / "checkpoints" / f"checkpoint-{checkpoint}" / "trainer_state.json").is_file():
        assert proc.poll() is None and time.time() < deadline, "training ended before it could be killed"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "adapter").exists()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((out / "train_result.json").read_text())


def killed_rerun_against_straight(cfg_path: Path, tmp: Path, checkpoint: int) -> tuple[dict, dict]:
    """The train stage on `cfg_path` run straight through (in this process), then killed_then_rerun: asserts both
    adapters are the same bit for bit; returns the rerun's train_result.json and the adapter's tensors."""
    import torch
    from safetensors.torch import load_file

    from stages.config import load_config
    from stages.train import stage

    stage.run(load_config(cfg_path), tmp / "straight")
    result = killed_then_rerun(cfg_path, tmp / "crashed", checkpoint)
    a = load_file(tmp / "straight" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp / "crashed" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return result, a


_PREFECT_TEMPLATE: list[Path] = []


def seeded_prefect_home(home: Path) -> Path:
    """`home` made a Prefect home whose SQLite database is already migrated, as any earlier Prefect run leaves it:
    a `python -m flows.train_and_export` on an empty home spends about 8 s of its temporary API's start-up creating
    the tables. The migrated database is made once per test process (`prefect server database upgrade`) and copied."""
    if not _PREFECT_TEMPLATE:
        template = Path(tempfile.mkdtemp(prefix="tae-prefect-template-"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {"PREFECT_HOME": str(template)}
        subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env, check=True,
                       capture_output=True, timeout=300)
        _PREFECT_TEMPLATE.append(template / "prefect.db")
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "prefect.db").exists():
        shutil.copyfile(_PREFECT_TEMPLATE[0], home / "prefect.db")
    return home


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def e2e(tmp_path_factory, prefect_harness):
    """One run of the whole default flow; returns (result dict, config path, flow run id)."""
    from flows.train_and_export import train_and_export

    tmp = tmp_path_factory.mktemp("e2e")
    cfg = write_config(tmp)
    state = train_and_export(config=str(cfg), return_state=True)
    assert state.is_completed(), state
    return state.result(), cfg, state.state_details.flow_run_id


# An expensive fixture -> the xdist group of every test that uses it (directly or through another fixture).
SHARED_RUNS = {
    "e2e": "e2e",                  # the default flow end to end (session)
    "chatml": "chatml",            # tests/test_chatml_e2e.py: the ChatML default end to end
    "server": "deployment",        # tests/test_deployment.py: a Prefect server + served deployments
    "runs": "fsdp",                # tests/test_fsdp.py: one-process and 2-process FSDP training runs
    "uninterrupted": "kill-9",     # tests/test_reliability.py: the reference run of the kill -9 tests
    "qlora": "qlora",              # tests/test_train_merge.py: a QLoRA run with checkpoints
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        groups = sorted({g for f, g in SHARED_RUNS.items() if f in getattr(item, "fixturenames", ())})
        if groups:
            item.add_marker(pytest.mark.xdist_group("+".join(groups)))
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under --dist loadgroup (absent without xdist)
        return
    # --dist loadgroup schedules by the "<nodeid>@<group>" a worker reports. pytest-xdist 3.8 appends the group by
    # setting item._nodeid, which pytest 9 no longer reads (the nodeid is item._id, a NodeId): without this, every
    # test would be scheduled on its own and each worker would repeat the shared runs (the Prefect server tests,
    # which build on each other, would even fail).
    from _pytest.nodeid import NodeId

    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
        if groups and isinstance(getattr(item, "_id", None), NodeId) and "@" not in item.nodeid.rpartition("]")[2]:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


# tests/test_reliability.py counts the cases it tried and passed per category into tests/reliability_summary.json
# (the README quotes it). Under xdist the cases run on several workers: each worker sends its counts to the
# controller, which writes the sum once, after every worker has finished.
RELIABILITY_SUMMARY = REPO / "tests" / "reliability_summary.json"


def _reliability_counts() -> tuple[Counter, Counter]:
    mod = sys.modules.get("tests.test_reliability")
    return (Counter(mod.TRIED), Counter(mod.RESULTS)) if mod else (Counter(), Counter())


def pytest_configure(config):
    config._reliability = (Counter(), Counter())


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: called on the controller as each worker finishes
def pytest_testnodedown(node, error):
    sent = getattr(node, "workeroutput", {}).get("reliability")
    if sent:
        tried, passed = json.loads(sent)
        node.config._reliability[0].update(tried)
        node.config._reliability[1].update(passed)


def _whole_suites(config) -> bool:
    """No test was picked out (-k, -m, a node id, --lf, -x): the counts are the whole suite's, not a few cases'."""
    o = config.option
    return (not o.keyword and not o.markexpr and not getattr(o, "lf", False) and not o.maxfail
            and all("::" not in a for a in config.args))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    tried, passed = _reliability_counts()
    if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller sums and writes
        session.config.workeroutput["reliability"] = json.dumps([tried, passed])
        return
    tried.update(session.config._reliability[0])
    passed.update(session.config._reliability[1])
    if not tried or not _whole_suites(session.config):  # the reliability suite did not run here, or only part of it
        return
    by = sorted(set(tried))
    RELIABILITY_SUMMARY.write_text(json.dumps({"categories": {c: {"tried": tried[c], "passed": passed[c]} for c in by},
                                               "tried": sum(tried.values()), "passed": sum(passed.values())}, indent=1) + "\n")
