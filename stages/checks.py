"""Problems the run would hit after training, found before it starts (the preflight runs these first)."""

from __future__ import annotations

from pathlib import Path

from stages.config import RunConfig


def before_training(cfg: RunConfig, out_dir: Path) -> None:
    """Raise a UserError naming the first problem and its fix."""
