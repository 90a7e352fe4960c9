"""A stage's result file: the one place that names it, writes it, reads it back and says whether the stage is done.

Each stage writes its result last, whole (a temporary file renamed over it), into its own directory; a stage that
finds its result and the outputs the result stands for still there skips its work and returns the result read back
(train, merge, export). The flow asks the same question before it reuses a stage's cached result, and the preflight's
disk check before it counts a stage's outputs as still to be written.
"""

from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

from stages import memory

FILES = {"preflight": "preflight.json", "train": "train_result.json", "merge": "merge_result.json",
         "export": "export_result.json", "smoke": "smoke_result.json"}
# What else a finished stage leaves in its directory that the next one reads, beside its result file; the files a
# Result stands for elsewhere it names itself (`outputs()`, kept in its record).
OUTPUTS = {"preflight": ["preflight.md"], "train": ["adapter/adapter_config.json"], "merge": ["model/config.json"]}


def path(stage_dir: Path, stage: str) -> Path:
    return Path(stage_dir) / FILES[stage]


def save(stage_dir: Path, stage: str, result) -> Path:
    """`result` (a stage's Result dataclass) as its stage's result file, with the files it stands for where it names
    them (`outputs()`)."""
    record = memory.jsonable(result)
    if hasattr(result, "outputs"):
        record["outputs"] = [str(f) for f in result.outputs()]
    final = path(stage_dir, stage)
    tmp = final.with_name(final.name + ".partial")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(tmp, final)
    return final


def restore(cls, record: dict, **values):
    """`cls` (a Result dataclass) from the record `save` wrote: paths, nested results and lists of them rebuilt from
    the fields' types; keys the class does not have (a record of an older version, a property saved beside the
    fields) are dropped, fields the record lacks take their defaults; `values` set fields over the record's."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    return cls(**{k: _typed(hints[k], v) for k, v in record.items() if k in known} | values)


def _typed(hint, value):
    if value is None:
        return None
    if typing.get_origin(hint) in (types.UnionType, typing.Union):   # X | None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is list and is_dataclass(item := (typing.get_args(hint) or (None,))[0]):
        return [restore(item, v) for v in value]
    if is_dataclass(hint):
        return restore(hint, value)
    return Path(value) if hint is Path else value


def load(stage_dir: Path, stage: str) -> dict:
    return json.loads(path(stage_dir, stage).read_text())


def done(stage_dir: Path, stage: str) -> bool:
    """The stage's result file is there, and so is every output it stands for (the export's: every GGUF it lists)."""
    return load_if_done(stage_dir, stage) is not None


def load_if_done(stage_dir: Path, stage: str, cls=None):
    """The stage's result, read once, when the stage is done (`done`): the record, or with `cls` the Result it was
    saved from, marked skipped (this process found it done rather than ran it); None when the stage is still to run."""
    stage_dir = Path(stage_dir)
    result = path(stage_dir, stage)
    if not result.is_file():
        return None
    record = json.loads(result.read_text())
    files = [stage_dir / f for f in OUTPUTS.get(stage, [])] + [Path(f) for f in record.get("outputs", [])]
    if not all(f.exists() for f in files):
        return None
    return record if cls is None else restore(cls, record, skipped=True)
