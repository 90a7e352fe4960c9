"""Serve the deployments: train-and-export on demand, and retraining when new data lands.

    prefect server start --host 127.0.0.1 --port 4200 &      # SQLite under $PREFECT_HOME
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    python -m flows.deploy serve                              # leave running; UI at http://127.0.0.1:4200
    prefect deployment run train-and-export/default --param config=configs/default.yaml
    python -m flows.deploy notify --config configs/default.yaml   # "new data landed" (event path)

Deployments (all served by this one process; each flow run is a subprocess):
  train-and-export/default           the pipeline; parameters config, overrides, run_id
  retrain-on-new-data/scheduled      cron (TAE_RETRAIN_CRON, default hourly) and the event
                                     `dataset.updated`: starts train-and-export only when the
                                     data fingerprint differs from the last published bundle's

One GPU job at a time: the GPU stages hold a slot of the global concurrency limit `gpu`
(one slot per host: TAE_GPU_SLOTS to change), set here (flows.host.gpu_slot).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prefect import flow, get_run_logger, serve
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.events import DeploymentEventTrigger, emit_event
from prefect.events.worker import EventsWorker

from flows.host.gpu_slot import ensure_gpu_limit
from flows.train_and_export import data_fingerprint, train_and_export
from stages import champion, errors, inputs
from stages.config import ConfigError, RunConfig

PIPELINE = "train-and-export/default"
EVENT = "dataset.updated"


def last_published_fingerprint(cfg: RunConfig) -> str | None:
    """The data fingerprint in the manifest `latest` points at (None before the first bundle, or when that manifest
    cannot be read: then the data is retrained on, and the hand-off names the damaged bundle in its comparison)."""
    manifest = champion.latest_manifest(Path(cfg.handoff.dir) / cfg.handoff.model_name)
    return manifest.get("data_fingerprint") if manifest else None


@flow(name="retrain-on-new-data", log_prints=True)
def retrain_on_new_data(config: str = "configs/default.yaml", overrides: list[str] | None = None) -> dict:
    """Start train-and-export if the data changed since the last published bundle.

    The idempotency key is the data fingerprint, so a schedule and an event (or two events)
    for the same data start one run, not two.
    """
    log = get_run_logger()
    cfg = inputs.load(config, overrides)
    new, last = data_fingerprint(cfg), last_published_fingerprint(cfg)
    if new == last:
        log.info(f"data {new[:12]} is what the last bundle was trained on: nothing to do")
        return {"started": False, "fingerprint": new}
    tag = f"data-{new[:16]}"
    # The key dedupes a schedule and an event for the same data; a failed or cancelled run of
    # it must not block that data forever, so each such run moves the key on.
    dead = sum(r.state is not None and r.state.type in (StateType.FAILED, StateType.CRASHED, StateType.CANCELLED)
               for r in _runs_tagged(tag))
    run = run_deployment(PIPELINE, parameters={"config": config, "overrides": overrides or []}, timeout=0, as_subflow=False,
                         tags=[tag], idempotency_key=f"{cfg.handoff.model_name}-data-{new[:32]}-attempt-{dead}")
    log.info(f"data {new[:12]} (last bundle: {last and last[:12]}): flow run {run.name} ({run.id})")
    return {"started": True, "fingerprint": new, "flow_run_id": str(run.id)}


def _runs_tagged(tag: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))


def deployments(config: str, cron: str):
    return [
        train_and_export.to_deployment(name="default", parameters={"config": config, "overrides": []}),
        retrain_on_new_data.to_deployment(
            name="scheduled", cron=cron, parameters={"config": config, "overrides": []},
            triggers=[DeploymentEventTrigger(expect={EVENT}, parameters={"config": "{{ event.payload.config }}"})],
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Serve train-and-export deployments, or announce new data.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the deployments (needs PREFECT_API_URL: a `prefect server start`)")
    s.add_argument("--config", default="configs/default.yaml", help="default config of both deployments")
    s.add_argument("--cron", default=os.environ.get("TAE_RETRAIN_CRON", "0 * * * *"), help="when to check for new data")
    s.add_argument("--limit", type=int, default=4, help="flow runs at once (GPU stages still queue on the gpu limit)")
    n = sub.add_parser("notify", help=f"emit `{EVENT}`: retrain if the data of this config changed")
    n.add_argument("--config", required=True)
    a = ap.parse_args(argv)

    def go() -> None:
        if not os.environ.get("PREFECT_API_URL"):
            raise ConfigError("PREFECT_API_URL is not set: start `prefect server start --host 127.0.0.1` and export "
                              "PREFECT_API_URL=http://127.0.0.1:4200/api (deployments, schedules and events need a server)")
        if a.cmd == "notify":
            cfg = inputs.load(a.config)
            emit_event(event=EVENT, resource={"prefect.resource.id": f"train-and-export.dataset.{cfg.handoff.model_name}"},
                       payload={"config": a.config, "fingerprint": data_fingerprint(cfg)})
            EventsWorker.drain_all()  # sent before this short process exits
            print(f"emitted {EVENT} for {a.config}")
            return
        inputs.load(a.config)  # a broken default config fails here, not at the first scheduled run
        print(f"gpu concurrency limit: {ensure_gpu_limit()} slot(s)")
        serve(*deployments(a.config, a.cron), limit=a.limit)

    return errors.run_cli(go, f"flows.deploy {a.cmd}")


if __name__ == "__main__":
    sys.exit(main())
