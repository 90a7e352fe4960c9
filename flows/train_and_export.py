"""The `train-and-export` Prefect flow: preflight -> train -> merge -> export -> smoke -> handoff.

    python -m flows.train_and_export --config configs/default.yaml [--set training.max_steps=50]

Each stage is a plain function in stages/, wrapped here as a task; each task publishes
its memory as a table artifact (`memory-<stage>`), each stage's Result says what else it
shows (its `artifacts()`), and the run ends with a markdown summary (`run-summary`).
Without PREFECT_API_URL, Prefect starts a temporary local API for the run. The command
line is flows/cli.py's.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import importlib
import sys
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import INPUTS, TASK_SOURCE
from prefect.runtime import flow_run

from flows.cli import main
from flows.host.gpu_slot import stage_slot
from stages import champion, data, errors, inputs, memory, result_files
from stages.artifact import Artifact
from stages.export import llamacpp
from stages.memory import MemoryReport
from stages.paths import RunPaths
from stages.train import tracking

# A native crash (llama.cpp, a CUDA library) kills the flow process without a Python traceback:
# this at least prints the Python stack it died in to the run's output.
if not faulthandler.is_enabled():  # pytest, PYTHONFAULTHANDLER or the user may have set it up already
    with contextlib.suppress(AttributeError, ValueError, OSError, RuntimeError):  # no usable stderr: go without
        faulthandler.enable(file=sys.__stderr__)

# Problems in the user's inputs fail a task with one line in the run's log, not a traceback.
errors.quiet_prefect_tracebacks()


def publish_memory(stage: str, report: MemoryReport | None) -> None:
    if report is None:  # the stage was skipped: its output was already there
        return
    row = {k: v for k, v in report.to_json().items() if k not in ("extra", "stage")}
    create_table_artifact([row], key=f"memory-{stage}", description=f"Memory of the {stage} stage (GiB; peak_gib is the headline)")


def publish(artifacts: list[Artifact]) -> None:
    """What a stage's Result shows in the Prefect UI, as Prefect artifacts of this flow run."""
    for a in artifacts:
        if a.table is not None:
            create_table_artifact(a.table, key=a.key, description=a.description)
        else:
            create_markdown_artifact(a.markdown, key=a.key, description=a.description)


TRANSIENT = (ConnectionError, TimeoutError, BrokenPipeError)


def data_fingerprint(cfg) -> str:
    """What the hand-off manifest records and retraining compares: the train and eval files' content."""
    return data.fingerprint(data.input_files(cfg))


def retry_transient(task, task_run, state) -> bool:
    """Retry a stage only for errors that may pass: never a config, data, OOM or fidelity error,
    which would fail the same way again."""
    try:
        state.result()
    except TRANSIENT:
        return True
    except BaseException:
        return False
    return False


def stage(name: str, *, gpu: bool, entry: str = "run"):
    """A task that runs the stage function `stages.<name>.<entry>` in the stage's directory (holding the host's GPU,
    flows.host.gpu_slot, if it uses it) and publishes its memory artifact.

    The function is imported when the stage starts, and looked up then: the command line answers --help, and
    flows.deploy serves, without loading torch; a test can replace it where it lives.
    Results are persisted and cached by the task's inputs and source: inputs include the
    run's stage directory, so re-running a failed flow run (Prefect's Retry, or the CLI's
    --run-id) skips every stage that completed and training resumes from its checkpoint.
    """

    def body(*inputs, out_dir: Path):
        errors.check_interrupted()  # a Ctrl-C whose exception a finalizer dropped stops the run here at the latest (a
        # check after the stage would throw away a stage that completed, and its cached result with it)
        fn = getattr(importlib.import_module(f"stages.{name}"), entry)
        with stage_slot(name, out_dir, flow_run_id()) if gpu else contextlib.nullcontext(), disk_full_in(out_dir):
            result = fn(*inputs, out_dir)
        publish_memory(name, result.memory)
        return result

    return task(name=name, cache_policy=INPUTS + TASK_SOURCE, persist_result=True,
                retries=2, retry_delay_seconds=30, retry_condition_fn=retry_transient)(body)


@contextlib.contextmanager
def disk_full_in(stage_dir: Path):
    """A full disk whose write named no file is said as one: the stage's own directory is what was written."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.ENOSPC and not e.filename and not isinstance(e, errors.DiskFull):
            raise errors.no_space(e, stage_dir) from e
        raise


def flow_run_id() -> str | None:
    """This flow run's Prefect id (None outside one): what the hand-off manifest and the GPU slot's record name."""
    return str(flow_run.id) if flow_run.id else None


def fresh(stage_task, stage_dir: Path):
    """`stage_task`, with its cached result refreshed unless the stage's files are all still there (stages.result_files):
    after `rm -rf artifacts/` the same run id runs the stage again instead of handing the next one paths that no
    longer exist."""
    return stage_task.with_options(refresh_cache=not result_files.done(stage_dir, stage_dir.name))


preflight_task = stage("preflight", gpu=True)
train_task = stage("train", gpu=True)
merge_task = stage("merge", gpu=True)
export_task = stage("export", gpu=True)
smoke_task = stage("smoke", gpu=True)
handoff_task = stage("handoff", gpu=False, entry="from_stages")


@flow(name="train-and-export", log_prints=True)
def train_and_export(config: str = "configs/default.yaml", overrides: list[str] | None = None, run_id: str | None = None) -> dict:
    """Fine-tune, merge, export GGUF, smoke-test and hand off, as configured in `config`."""
    cfg = inputs.load(config, overrides)
    llamacpp.converter_dir()  # the converter must match the llama.cpp runtime: checked before any work
    # A retried flow run keeps its id, hence its directory and its stages' cache keys.
    if run_id is None and flow_run.id:  # a deployment run without a run_id parameter: named for its flow run
        run_id = f"{flow_run.name}-{str(flow_run.id)[:8]}"
    paths = RunPaths.for_run(cfg, run_id)
    fingerprint = data_fingerprint(cfg)
    print(f"run {paths.run_id}: {paths.root}  data {fingerprint[:12]}")
    with paths.lock():  # a second process with this run id is refused, not let into the same directory
        pre = run_stage(preflight_task, paths, "preflight", cfg)  # stops the run before any training if it does not fit
        tr = run_stage(train_task, paths, "train", cfg)  # resumable from its checkpoints
        mg = run_stage(merge_task, paths, "merge", cfg, tr.adapter_dir)  # into the 16-bit base, checked against the adapter
        ex = run_stage(export_task, paths, "export", cfg, mg.merged_dir)  # f16 GGUF -> Q4_K_M, Q5_K_S, each verified
        sm = run_stage(smoke_task, paths, "smoke", cfg, ex.gguf_files())  # every GGUF under llama.cpp, on the serving card's budget
        tracking.log_export(cfg, paths.stage("train"), ex.fidelity_table(), smoke_accuracy(sm))
        ho = handoff_task(cfg, paths.run_id, fingerprint, flow_run_id(), pre, tr, mg, ex, sm, out_dir=paths.stage("handoff"))
        return finish(paths, ho, pre, tr, mg, ex, sm)


def run_stage(stage_task, paths: RunPaths, name: str, cfg, *inputs):
    """One stage in its directory of the run (its cached result reused while its files are there), and what its Result
    shows in the Prefect UI beyond its memory table."""
    out = paths.stage(name)
    result = fresh(stage_task, out)(cfg, *inputs, out_dir=out)
    publish(result.artifacts())
    return result


def smoke_accuracy(sm) -> dict:
    return {f.quant: {"accuracy": f.accuracy} for f in sm.files}


def finish(paths: RunPaths, ho, pre, tr, mg, ex, sm) -> dict:
    """The run's comparison with the bundle `latest` pointed at and its summary, as artifacts and beside the run; a
    failed flow run when the retrain was worse (what the deployment's automation alerts on); else what the run made."""
    from stages.handoff import stage_memory  # here, not at the top: the command line answers --help without torch

    reports = stage_memory(pre, tr, mg, ex, sm) | {"handoff": ho.memory}
    publish(ho.artifacts())  # the champion/challenger table
    summary = summarize(paths, reports, ho, tr, sm)
    (paths.root / "summary.md").write_text(summary + "\n")  # kept with the run: the temporary API's artifact is gone after it
    create_markdown_artifact(summary, key="run-summary", description=f"train-and-export run {paths.run_id}")
    print(summary)
    if not ho.promoted:
        raise champion.Regression(f"this run is worse than the bundle `latest` points at: {ho.comparison.splitlines()[0]} "
                                  f"Candidate: {ho.bundle_dir}; to serve it anyway, point latest at it "
                                  f"(ln -sfn {ho.bundle_dir.name} {ho.bundle_dir.parent}/latest) or set handoff.promotion.compare: false")
    return {"run_id": paths.run_id, "run_dir": str(paths.root), "bundle": str(ho.bundle_dir),
            "final_loss": tr.final_loss, "smoke": {f.quant: f.accuracy for f in sm.files}}


def summarize(paths: RunPaths, reports: dict, ho, tr, sm) -> str:
    accuracy = ", ".join(f"{f.quant} {f.accuracy:.0%}" for f in sm.files)
    return "\n".join([
        f"### train-and-export run {paths.run_id}",
        "",
        *memory.markdown_table(reports),
        "",
        f"Each stage's files (memory.json among them): `{paths.root}/<stage>/`.",
        f"Loss {tr.first_loss:.3f} -> {tr.final_loss:.3f} over {tr.steps} steps. Smoke: {accuracy}.",
        f"Bundle: `{ho.bundle_dir}` (verify: `cd {ho.bundle_dir} && sha256sum -c SHA256SUMS`)"
        + ("" if ho.promoted else " - a candidate: `latest` was not switched (comparison.md)"),
    ])


if __name__ == "__main__":
    sys.exit(main())
