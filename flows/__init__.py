"""Prefect flows of train-and-export.

Prefect's telemetry is off for every process these flows start (the temporary local API
included), unless the user set it, and the temporary API has time to start on a busy machine: offline, each heartbeat was an ERROR with a traceback in a
healthy run's log. prefect.toml at the repository root says the same to a `prefect server
start` run from there.
"""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The temporary local API gets 20 s to start by default; on 2 busy cores (CI, a laptop training
# in another process) its SQLite migrations took longer and the run died before its first stage.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
