"""Where a run's files go: artifacts/runs/<run-id>/<stage>/, next to the config that made them."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from stages.config import RunConfig

STAGES = ("preflight", "train", "merge", "export", "smoke", "handoff")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class RunPaths:
    run_id: str
    root: Path

    @classmethod
    def for_run(cls, cfg: RunConfig, run_id: str | None = None) -> RunPaths:
        """The run directory, created, with the resolved config written into it."""
        run_id = run_id or new_run_id()
        root = Path(cfg.artifacts_dir) / "runs" / run_id
        root.mkdir(parents=True, exist_ok=True)
        (root / "config.yaml").write_text(cfg.to_yaml())
        return cls(run_id, root)

    def stage(self, name: str) -> Path:
        assert name in STAGES, name
        return self.root / name
