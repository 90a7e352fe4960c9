"""The command line of the train-and-export flow: one run, locally.

    python -m flows.train_and_export --config configs/default.yaml [--set training.max_steps=50] [--run-id ID] [--debug]

It checks what it can before Prefect starts a server (the run id, the config), keeps the run's processes from
outliving it (flows.host.reaper) and, if the run stops, says the command that resumes it. The flow itself is
flows/train_and_export.py's, imported when the run starts.
"""

from __future__ import annotations

import argparse
import os

from flows.host import reaper
from stages import errors, inputs
from stages.paths import check_run_id, new_run_id

PROG = "python -m flows.train_and_export"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG,
                                 description="Run the train-and-export pipeline once, locally: preflight, train, merge, export, smoke, "
                                             "hand-off. Without PREFECT_API_URL a temporary local Prefect API runs beside it.")
    ap.add_argument("--config", default="configs/default.yaml", help="the run config (YAML, one schema: docs/config.md; default: %(default)s)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one config key, parsed as YAML, e.g. --set training.max_steps=50 (repeatable)")
    ap.add_argument("--run-id", help="name of the run directory under artifacts_dir/runs; an existing one resumes (default: a new one, "
                    "printed at the start)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a user error too (or TAE_DEBUG=1)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.debug:
        os.environ[errors.DEBUG_ENV] = "1"
    run_id = new_run_id() if a.run_id is None else a.run_id  # chosen here, so that an interrupted run can be named for its resumption
    resume = " ".join([PROG, "--config", a.config, *(f"--set {s}" for s in a.set), "--run-id", run_id])

    def go():
        check_run_id(run_id)  # an empty, reserved or path-like id, before anything starts
        inputs.load(a.config, a.set)  # a bad config fails here, before Prefect starts a server
        from flows.train_and_export import train_and_export  # here: the flow module imports this one

        reaper.watch()  # nothing this process starts outlives it, even after kill -9
        reaper.isolate_temporary_api()
        train_and_export(config=a.config, overrides=a.set, run_id=run_id)

    return errors.run_cli(go, "train-and-export", resume=resume)
