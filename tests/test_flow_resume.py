"""A failed flow run, run again, skips the stages that completed (Prefect's persisted, input-keyed cache)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import write_config

pytestmark = pytest.mark.slow


def _task_states(flow_run_id) -> dict[str, str]:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with get_client() as c:
            runs = await c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            return {r.name.rsplit("-", 1)[0]: r.state.name for r in runs}

    return asyncio.run(read())


def test_rerun_after_a_failure_skips_training(tmp_path, monkeypatch, prefect_harness):
    from flows.train_and_export import train_and_export

    def crash(*args, **kwargs):
        raise RuntimeError("injected failure at the start of merge")

    cfg = str(write_config(tmp_path, training={"max_steps": 10, "save_steps": 5}, smoke={"min_accuracy": 0.0, "max_prompts": 5}))
    with monkeypatch.context() as m:
        m.setattr("stages.merge.run", crash)  # what the merge task calls, looked up when it starts
        failed = train_and_export(config=cfg, run_id="resume-me", return_state=True)
    assert failed.is_failed() and "injected failure at the start of merge" in str(failed.message)
    train_dir = tmp_path / "artifacts" / "runs" / "resume-me" / "train"
    trained_at = (train_dir / "train_result.json").stat().st_mtime_ns

    again = train_and_export(config=cfg, run_id="resume-me", return_state=True)
    assert again.is_completed()
    states = _task_states(again.state_details.flow_run_id)
    assert states["preflight"] == states["train"] == "Cached", states
    assert states["merge"] == states["handoff"] == "Completed", states
    assert (train_dir / "train_result.json").stat().st_mtime_ns == trained_at  # training did not run again
    assert json.loads((train_dir / "train_result.json").read_text())["steps"] == 10


def test_config_errors_are_not_retried(tmp_path):
    """Retries are for transient errors; a bad config would fail identically every time."""
    from prefect.states import Failed

    from flows.train_and_export import retry_transient
    from stages.config import ConfigError

    def state_of(exc):
        return Failed(data=exc)

    assert retry_transient(None, None, state_of(ConnectionError("reset by peer")))
    assert not retry_transient(None, None, state_of(ConfigError("bad key")))
    assert not retry_transient(None, None, state_of(RuntimeError("CUDA out of memory")))
