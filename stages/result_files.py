"""A stage's result file: the one place that names it, writes it, reads it back and says whether the stage is done.

Each stage writes its result last, whole (a temporary file renamed over it), into its own directory; a stage that
finds its result and the outputs the result stands for still there skips its work and returns the result read back
(train, merge, export). The flow asks the same question before it reuses a stage's cached result, and the preflight's
disk check before it counts a stage's outputs as still to be written.
"""

from __future__ import annotations

import json
import os
from dataclasses import is_dataclass
from pathlib import Path

from stages import memory

FILES = {"preflight": "preflight.json", "train": "train_result.json", "merge": "merge_result.json",
         "export": "export_result.json", "smoke": "smoke_result.json"}
# What else a finished stage leaves that the next one reads, beside its result file.
OUTPUTS = {"preflight": ["preflight.md"], "train": ["adapter/adapter_config.json"], "merge": ["model/config.json"]}


def path(stage_dir: Path, stage: str) -> Path:
    return Path(stage_dir) / FILES[stage]


def save(stage_dir: Path, stage: str, result) -> Path:
    """`result` (a stage's Result, or the dict it records) as its stage's result file."""
    final = path(stage_dir, stage)
    tmp = final.with_name(final.name + ".partial")
    tmp.write_text(json.dumps(memory.jsonable(result) if is_dataclass(result) else result, indent=2, default=str))
    os.replace(tmp, final)
    return final


def load(stage_dir: Path, stage: str) -> dict:
    return json.loads(path(stage_dir, stage).read_text())


def done(stage_dir: Path, stage: str) -> bool:
    """The stage's result file is there, and so is every output it stands for (the export's: every GGUF it lists)."""
    return load_if_done(stage_dir, stage) is not None


def load_if_done(stage_dir: Path, stage: str) -> dict | None:
    """The stage's result, read once, when the stage is done (`done`); None when it is still to run."""
    stage_dir = Path(stage_dir)
    result = path(stage_dir, stage)
    if not result.is_file():
        return None
    record = json.loads(result.read_text())
    files = [stage_dir / f for f in OUTPUTS.get(stage, [])]
    if stage == "export":
        files += [Path(f["path"]) for f in record.get("files", [])]
    return record if all(f.exists() for f in files) else None
