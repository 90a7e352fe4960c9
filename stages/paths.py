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
# Names a run id cannot take: the bundle directory beside the versions that always points at the newest promoted one.
RESERVED = ("latest",)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def check_run_id(run_id: str) -> str:
    """`run_id` if it can name a run directory and a bundle version; RunError saying why not."""
    example = "e.g. --run-id 20261201-qwen-v2, or leave --run-id out for a new one"
    if not isinstance(run_id, str) or not run_id.strip():
        raise RunError(f"run id {run_id!r} is empty: give a plain name ({example})")
    if run_id.lower() in RESERVED:
        raise RunError(f"run id {run_id!r} is reserved: <handoff.dir>/<model_name>/latest is the link to the newest promoted "
                       f"bundle, so no version may be named so; use another --run-id ({example})")
    if not RUN_ID.match(run_id) or ".." in run_id:
        raise RunError(f"run id {run_id!r} is not a plain name: use letters, digits, '.', '_' and '-' (no '/', no '..', "
                       f"at most 128 characters, starting with a letter or digit), {example}")
    return run_id


def bundle_in_the_way(bundle: Path) -> RunError | None:
    """Why version `bundle` cannot be published: it was published already, or something else holds its name."""
    if not (bundle.exists() or bundle.is_symlink()):
        return None
    run_id = bundle.name
    if bundle.is_dir() and (bundle / "manifest.json").is_file():
        return RunError(f"run {run_id} already published {bundle.resolve()}; bundles are immutable: start a new run with "
                        "another --run-id (or none, for a new one)")
    what = ("a dangling symbolic link" if not bundle.exists() else "a file" if not bundle.is_dir()
            else "an empty directory" if not any(bundle.iterdir()) else "a directory without manifest.json")
    return RunError(f"{bundle} is {what}, not a published bundle, and the bundle of run {run_id} would go there; remove or "
                    "rename it, or use another --run-id")


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
        run_id = check_run_id(new_run_id() if run_id is None else run_id)
        in_the_way = bundle_in_the_way(Path(cfg.handoff.dir) / cfg.handoff.model_name / run_id)
        if in_the_way:
            raise in_the_way
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
