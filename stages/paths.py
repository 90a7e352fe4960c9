"""Where a run's files go: artifacts/runs/<run-id>/<stage>/, next to the config that made them.

A run id names a directory under `runs/` and a bundle version, whoever supplies it (the CLI's
--run-id, the `run_id` parameter of `prefect deployment run`): it is checked like
handoff.model_name, so it can never name a path outside the artifacts dir. A run directory
belongs to one config: running its id again with another config is refused, not mixed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stages.config import RunConfig
from stages.errors import RunError

STAGES = ("preflight", "train", "merge", "export", "smoke", "handoff")
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID.match(run_id) or ".." in run_id:
        raise RunError(f"run id {run_id!r} is not a plain name: use letters, digits, '.', '_' and '-' (no '/', no '..', "
                       "at most 128 characters), e.g. --run-id 20261201-qwen-v2")
    return run_id


@dataclass(frozen=True)
class RunPaths:
    run_id: str
    root: Path

    @classmethod
    def for_run(cls, cfg: RunConfig, run_id: str | None = None) -> RunPaths:
        """The run directory, created, with the resolved config written into it.

        Raises:
            RunError: the id is not a plain name, it already published a bundle, or its
                directory holds a run of another config.
        """
        run_id = check_run_id(run_id or new_run_id())
        bundle = Path(cfg.handoff.dir) / cfg.handoff.model_name / run_id
        if bundle.exists():
            raise RunError(f"run {run_id} already published {bundle.resolve()}; bundles are immutable: "
                           "start a new run with another --run-id (or none, for a new one)")
        root = Path(cfg.artifacts_dir) / "runs" / run_id
        root.mkdir(parents=True, exist_ok=True)
        config = root / "config.yaml"
        if config.is_file() and config.read_text() != cfg.to_yaml():
            raise RunError(f"run {run_id} in {root.resolve()} was started with another config ({_differences(config.read_text(), cfg)}); "
                           "its stages would mix the two: rerun it with its own config.yaml, or use another --run-id")
        config.write_text(cfg.to_yaml())
        return cls(run_id, root)

    def stage(self, name: str) -> Path:
        assert name in STAGES, name
        return self.root / name

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the run directory for this process; a second process running the same id is refused at once."""
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
                raise RunError(f"run {self.run_id} is in use by {holder}; wait for it to end, or start this one with another --run-id") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
            yield
        finally:
            os.close(fd)  # the kernel releases the lock with it, and when the holder dies


def _differences(old_yaml: str, cfg: RunConfig) -> str:
    """The dotted keys whose values differ between the run's config.yaml and `cfg`."""
    import yaml

    def flat(d, prefix=""):
        return {k: v for key, val in (d or {}).items()
                for k, v in (flat(val, f"{prefix}{key}.").items() if isinstance(val, dict) else [(f"{prefix}{key}", val)])}

    old, new = flat(yaml.safe_load(old_yaml)), flat(json.loads(cfg.model_dump_json()))
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return "changed: " + ", ".join(keys[:8]) + (" ..." if len(keys) > 8 else "") if keys else "changed"
