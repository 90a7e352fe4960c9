"""Whether a run config's inputs exist before anything runs: the base model (a local directory or the HF cache,
whose files the loader can read), the data files, and directories this user can write.

The schema (stages.config) says whether a config is well-formed; this says whether it can run here, reading the
disk to answer. Every entry point (the flow, its CLI, the deployments, each stage's CLI) loads a config through
`load`, so a run that cannot start stops before Prefect or torch loads, with every missing input named at once.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from stages import data
from stages.config import ConfigError, RunConfig, load_config
from stages.errors import UserError
from stages.model.check import check_model_dir
from stages.model.directory import resolve_model_dir


def load(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """The config at `path` with `overrides`, validated (stages.config.load_config) and its inputs checked.

    Raises:
        ConfigError: every schema problem at once, else every missing input at once, each with the fix.
    """
    cfg = load_config(path, overrides)
    check(cfg, path)
    return cfg


def check(cfg: RunConfig, source: str | Path = "the config") -> None:
    """Raises ConfigError listing every input of `cfg` that is missing or unusable (`source` names the config)."""
    found = problems(cfg)
    if found:
        raise ConfigError(f"{source}: config cannot run:\n" + "\n".join(f"  - {p}" for p in found))


def problems(cfg: RunConfig) -> list[str]:
    """Inputs that must exist before anything runs."""
    found = []
    try:
        model_dir = resolve_model_dir(cfg.model.name_or_path)
    except UserError as e:
        found.append(f"model.name_or_path: {e}")
    else:
        found += [f"model.name_or_path: {p}" for p in check_model_dir(model_dir, cfg.model.trust_remote_code)]
    inputs = [("data.train_file", cfg.data.train_file), ("data.eval_file", cfg.data.eval_file)]
    inputs += [(f"data.sources[{k}].path", Path(src.path)) for k, src in enumerate(cfg.data.sources)]
    for key, f in inputs:
        if f is not None and not f.exists() and not _hub_id_in_cache(str(f)):
            found.append(f"{key}: {f.resolve()} does not exist (nor is {str(f)!r} a dataset in the local HF cache); point it at "
                            "a data file, a folder of them, or a dataset saved with save_to_disk")
    for key, d in (("artifacts_dir", cfg.artifacts_dir), ("handoff.dir", cfg.handoff.dir / cfg.handoff.model_name)):
        problem = unwritable(d)
        if problem:
            found.append(f"{key}: {problem}; point {key} at a directory this user can write (it is created if missing)")
    if cfg.smoke.check == "exact" and cfg.data.eval_file is None and not cfg.data.eval_split:
        found.append("smoke.check is `exact` but there is no held-out data; set data.eval_file or data.eval_split, "
                        "or use smoke.check: stops")
    return found


def unwritable(d: Path) -> str | None:
    """Why the run could not create files in directory `d` (made first, as the run makes it), or None. Tried, not read
    off permission bits: root ignores them, a read-only mount does not."""
    for p in reversed((d, *d.parents)):
        if p.is_symlink() and not p.exists():
            return f"{p} is a symbolic link to {os.readlink(p)}, which does not exist"
        if p.exists() and not p.is_dir():
            return f"{p.resolve()} is a file, not a directory"
    existing = next(p for p in (d, *d.parents) if p.exists())
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".tae-write-check-"):
            return None
    except OSError as e:
        return f"{existing.resolve()} cannot be written ({e.strerror or e})"


def _hub_id_in_cache(name: str) -> bool:
    return "/" in name and not name.startswith((".", "/")) and bool(data.hub_cache_files(name))
