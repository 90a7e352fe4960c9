"""Champion / challenger: a retrain becomes `latest` only if it is no worse than the bundle `latest` points at.

Scheduled retraining on new data can make a model worse (a bad batch of data, a regression in a template).
Before the hand-off switches `latest`, the new bundle (the challenger) is compared with the current one (the
champion) on what both were judged by:

  smoke accuracy   each GGUF's pass rate on the held-out prompts (higher is better). When the held-out prompts
                   changed since the champion was made, the champion's GGUFs answer the new ones here, so both
                   figures are on the same prompts.
  eval loss        the adapter kept, on the held-out texts (lower is better); compared only on the same
                   held-out data (the loss of other texts says nothing about which model is better).
  KL               each GGUF against its own merged model on the held-out texts (lower is better): how much
                   the quantization lost.

Within `handoff.promotion`'s tolerances the challenger is promoted; worse on any figure, it is published as a
candidate that `latest` does not point at, with the comparison in the bundle (comparison.md, comparison.json)
and as a Prefect artifact, and the flow run fails with the reason, for the deployment's automation to alert on.

The champion is verified before it judges anything: every file its SHA256SUMS lists (the manifest among them)
must hash as listed, and the manifest must hold the figures compared, in their types. A damaged champion, or a
`latest` that points at nothing, is named in comparison.md and treated as absent: the challenger is promoted.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from stages import checksums, data
from stages.config import RunConfig
from stages.errors import RunError, UserError

LATEST = "latest"


class Regression(UserError, RuntimeError):
    """A retrain was worse than the bundle `latest` points at: published as a candidate, `latest` unchanged."""


@dataclass
class Row:
    metric: str             # e.g. "smoke accuracy Q4_K_M"
    champion: float | None
    challenger: float | None
    allowed: str            # the tolerance, in words
    worse: bool
    note: str = ""


@dataclass
class Verdict:
    champion: str | None    # the version latest pointed at; None: nothing published yet, or nothing usable (`absent`)
    promote: bool
    rows: list[Row] = field(default_factory=list)
    reason: str = ""
    absent: str = ""        # why the bundle `latest` pointed at was not compared (damaged, missing)

    def markdown(self) -> str:
        if self.absent:
            return f"{self.absent}: it was treated as absent and not compared; this bundle becomes `latest`.\n"
        if self.champion is None:
            return "No bundle was published under this model name before: this one becomes `latest`.\n"
        head = (f"Compared with `{self.champion}` (what `latest` pointed at): "
                + ("no worse within the tolerances, promoted to `latest`." if self.promote else f"**worse** ({self.reason}): published "
                   "as a candidate; `latest` still points at the champion."))
        lines = [head, "", "| figure | champion | this run | allowed | worse |", "|---|---|---|---|---|"]
        fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        lines += [f"| {r.metric} | {fmt(r.champion)} | {fmt(r.challenger)} | {r.allowed} | {'**yes**' if r.worse else 'no'}"
                  f"{' (' + r.note + ')' if r.note else ''} |" for r in self.rows]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return asdict(self)


def held_out_fingerprint(cfg: RunConfig) -> str:
    """sha256 of the held-out samples themselves (eval_file, or the eval_split drawn from the training data)."""
    samples = data.held_out(cfg, 1 << 30)
    return hashlib.sha256(json.dumps([s.messages for s in samples], sort_keys=True, default=str).encode()).hexdigest()


class _Smoke(BaseModel):
    model_config = ConfigDict(extra="allow")
    accuracy: float


class _Fidelity(BaseModel):
    model_config = ConfigDict(extra="allow")
    quant: str
    mean_kl: float


class _Train(BaseModel):
    model_config = ConfigDict(extra="allow")
    best_eval_loss: float | None = None


class _File(BaseModel):
    model_config = ConfigDict(extra="allow")
    file: str
    quant: str


class ChampionManifest(BaseModel):
    """What a champion's manifest.json must hold to judge a challenger: the figures compared, in their types."""

    model_config = ConfigDict(extra="allow")
    held_out_fingerprint: str | None = None
    smoke: dict[str, _Smoke]
    fidelity: list[_Fidelity]
    train: _Train
    files: list[_File]


@dataclass
class Champion:
    version: str
    manifest: dict
    bundle: Path


@dataclass
class Absent:
    """`latest` names a bundle that cannot judge anything: why, for comparison.md."""

    why: str


def latest_problem(root: Path) -> str | None:
    """Why `<root>/latest` cannot be switched with a rename (it is a directory or a file, not a link), or None."""
    latest = Path(root) / LATEST
    if latest.is_symlink() or not latest.exists():
        return None
    kind = "a directory" if latest.is_dir() else "a file"
    return (f"{latest.resolve()} is {kind}, not the symbolic link train-and-export switches to each promoted bundle; rename it "
            f"(e.g. mv {latest} {latest}.old) or point handoff.dir elsewhere")


def champion_of(root: Path) -> Champion | Absent | None:
    """What `latest` points at under <handoff.dir>/<model_name>: a verified champion, a bundle that cannot be one
    (`Absent`, with the reason), or None when nothing was ever published."""
    latest = Path(root) / LATEST
    if not latest.is_symlink():
        if latest.exists():
            raise RunError(latest_problem(root))
        return None
    target = Path(os.readlink(latest))
    bundle = latest.parent / target if not target.is_absolute() else target
    if not bundle.is_dir():
        return Absent(f"`latest` points at `{target}`, which does not exist under {latest.parent.resolve()}")
    problem = verify(bundle)
    if problem:
        return Absent(f"The bundle `latest` points at, `{bundle.name}`, is damaged ({problem})")
    return Champion(bundle.name, json.loads((bundle / "manifest.json").read_text()), bundle.resolve())


def latest_manifest(root: Path) -> dict | None:
    """The manifest `latest` points at, read without verifying the bundle's files (the retrain check runs hourly;
    hashing a 7B's GGUFs each time is the hand-off's job); None when there is none or it is not a JSON object."""
    manifest = Path(root) / LATEST / "manifest.json"
    try:
        value = json.loads(manifest.read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def verify(bundle: Path) -> str | None:
    """Why `bundle` cannot be trusted (a file differs from its SHA256SUMS, the manifest is not one), or None."""
    listed, problem = checksums.read(bundle)
    if problem:
        return problem
    if "manifest.json" not in listed:
        return f"its {checksums.SUMS} does not list manifest.json"
    problem = checksums.mismatch(bundle, listed)
    if problem:
        return problem
    try:
        manifest = ChampionManifest.model_validate_json((bundle / "manifest.json").read_bytes())
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "its top level"
        return f"manifest.json is not a bundle manifest: {where}: {first['msg']}"
    unlisted = [f.file for f in manifest.files if f.file not in listed]
    if unlisted:
        return f"{', '.join(unlisted)}, named in manifest.json, not in {checksums.SUMS}"
    return None


def compare(cfg: RunConfig, challenger: dict, champion: Champion | Absent | None) -> Verdict:
    """The challenger's manifest against the champion's; re-asks the champion's GGUFs the current held-out prompts
    when those changed since the champion was judged."""
    if champion is None:
        return Verdict(None, True)
    if isinstance(champion, Absent):
        return Verdict(None, True, absent=champion.why)
    version, old, bundle = champion.version, champion.manifest, champion.bundle
    tol = cfg.handoff.promotion
    same_data = old.get("held_out_fingerprint") is not None and old.get("held_out_fingerprint") == challenger.get("held_out_fingerprint")
    rows = []
    old_smoke = {q: v.get("accuracy") for q, v in (old.get("smoke") or {}).items()}
    note = ""
    if not same_data and old_smoke:
        old_smoke, note = _ask_again(cfg, old, bundle), "the champion re-asked the current held-out prompts"
    for quant, v in (challenger.get("smoke") or {}).items():
        a, b = old_smoke.get(quant), v.get("accuracy")
        rows.append(Row(f"smoke accuracy {quant}", a, b, f"at most {tol.smoke_accuracy_drop:.0%} lower",
                        a is not None and b is not None and b < a - tol.smoke_accuracy_drop, note))
    a, b = (old.get("train") or {}).get("best_eval_loss"), (challenger.get("train") or {}).get("best_eval_loss")
    if same_data:
        rows.append(Row("eval loss", a, b, f"at most {tol.eval_loss_rise:.0%} + {tol.eval_loss_floor} higher",
                        a is not None and b is not None and b > a * (1 + tol.eval_loss_rise) + tol.eval_loss_floor))
    else:
        rows.append(Row("eval loss", a, b, "-", False, "not compared: the held-out data changed"))
    old_kl = {f["quant"]: f["mean_kl"] for f in old.get("fidelity") or []}
    for f in challenger.get("fidelity") or []:
        a, b = old_kl.get(f["quant"]), f["mean_kl"]
        rows.append(Row(f"mean KL {f['quant']}", a, b, f"at most {tol.kl_rise:.0%} + {tol.kl_floor} higher",
                        a is not None and b > a * (1 + tol.kl_rise) + tol.kl_floor))
    worse = [r.metric for r in rows if r.worse]
    return Verdict(version, not worse, rows, ", ".join(worse))


def _ask_again(cfg: RunConfig, old: dict, bundle: Path) -> dict[str, float]:
    """The champion's GGUFs through the smoke test on today's held-out prompts (llama.cpp, its own process)."""
    from stages import smoke

    prompts = smoke.load_prompts(cfg)
    out = {}
    for f in old.get("files") or []:
        path = bundle / f["file"]
        if path.is_file():
            out[f["quant"]] = smoke.smoke_file(cfg.smoke, f["quant"], path, prompts).accuracy
    return out
