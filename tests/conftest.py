"""Shared fixtures: an isolated Prefect, configs that write under tmp, and one real
end-to-end run of the default pipeline that several tests inspect."""

from __future__ import annotations

import os
import tempfile
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
