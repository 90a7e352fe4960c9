"""Prefect flows of train-and-export.

Prefect's telemetry is off for every process these flows start (the temporary local API
included), unless the user set it: offline, each heartbeat was an ERROR with a traceback in a
healthy run's log. prefect.toml at the repository root says the same to a `prefect server
start` run from there.
"""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
