"""The `train-and-export` Prefect flow: preflight -> train -> merge -> export -> smoke -> handoff.

    python -m flows.train_and_export --config configs/default.yaml [--set training.max_steps=50]

Each stage is a plain function in stages/, wrapped here as a task; each task publishes
its memory as a table artifact (`memory-<stage>`), and the run ends with a markdown
summary (`run-summary`). Without PREFECT_API_URL, Prefect starts a temporary local API
for the run.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import faulthandler
import json
import os
import sys
import time
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flows.train_and_export",
                                 description="Run the train-and-export pipeline once, locally: preflight, train, merge, export, smoke, "
                                             "hand-off. Without PREFECT_API_URL a temporary local Prefect API runs beside it.")
    ap.add_argument("--config", default="configs/default.yaml", help="the run config (YAML, one schema: docs/config.md; default: %(default)s)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one config key, parsed as YAML, e.g. --set training.max_steps=50 (repeatable)")
    ap.add_argument("--run-id", help="name of the run directory under artifacts_dir/runs; an existing one resumes (default: a new one, "
                    "printed at the start)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a user error too (or TAE_DEBUG=1)")
    return ap


if __name__ == "__main__":
    parser().parse_args()  # --help and bad options answer here, before Prefect and torch load (7.6 s)

from prefect import flow, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact, create_table_artifact  # noqa: E402
from prefect.cache_policies import INPUTS, TASK_SOURCE  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402

from flows import reaper  # noqa: E402
from flows.gpu_slot import gpu_slot  # noqa: E402
from stages import champion, data, errors, export, handoff, memory, merge, preflight, result_files, smoke, train  # noqa: E402
from stages.config import load_config  # noqa: E402
from stages.export import llamacpp  # noqa: E402
from stages.memory import MemoryReport  # noqa: E402
from stages.paths import RunPaths, check_run_id, new_run_id  # noqa: E402
from stages.train import tracking  # noqa: E402

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


def publish_memory_timeline(steps_file, png) -> None:
    """Per-step memory of training as a table (at most 100 rows) pointing at the PNG timeline."""
    if not steps_file.is_file():
        return
    rows = [json.loads(line) for line in steps_file.read_text().splitlines()]
    every = max(1, len(rows) // 100)
    create_table_artifact(rows[::every], key="memory-steps-train", description=f"Memory per optimizer step (every {every}); plot: {png}")


def publish_eval_curve(tr) -> None:
    """The eval loss per eval as a table, with what it decided (no artifact without eval data)."""
    if not getattr(tr, "eval_curve", None):  # also a result cached before eval existed
        return
    stop = f", stopped early at step {tr.steps}" if tr.stopped_early else ""
    create_table_artifact(tr.eval_curve, key="eval-loss-train",
                          description=f"Eval loss per loss-carrying token on the held-out data; lowest {tr.best_eval_loss:.4f} at step "
                                      f"{tr.best_step}{stop}; adapter from step {tr.adapter_step}; plot: {tr.loss_png}")


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


def stage(name: str, fn, *, gpu: bool):
    """A task that runs one stage function (holding the host's GPU, flows.gpu_slot, if it uses it)
    and publishes its memory artifact.

    Results are persisted and cached by the task's inputs and source: inputs include the
    run's stage directory, so re-running a failed flow run (Prefect's Retry, or the CLI's
    --run-id) skips every stage that completed and training resumes from its checkpoint.
    """

    def body(*args, **kwargs):
        errors.check_interrupted()  # a Ctrl-C whose exception a finalizer dropped stops the run here at the latest (a
        # check after the stage would throw away a stage that completed, and its cached result with it)
        if os.environ.get("TAE_FAIL_STAGE") == name:  # test hook: a crash at the start of this stage
            raise RuntimeError(f"injected failure at the start of {name} (TAE_FAIL_STAGE)")
        with gpu_slot(f"stage {name} of flow run {flow_run.id or 'local'}") if gpu else contextlib.nullcontext() as how:
            start = time.time()
            try:
                result = fn(*args, **kwargs)
            except OSError as e:  # a full disk whose write named no file: the stage's own directory is what was written
                if e.errno == errno.ENOSPC and not e.filename and not isinstance(e, errors.DiskFull):
                    raise errors.no_space(e, Path(args[-1])) from e
                raise
            if gpu:  # when the slot was held, for the record (and the one-GPU-job-at-a-time test)
                slot = {"stage": name, "acquired": start, "released": time.time(), "flow_run_id": str(flow_run.id), "by": how}
                (Path(args[-1]) / "gpu_slot.json").write_text(json.dumps(slot))
        publish_memory(name, result.memory)
        return result

    return task(name=name, cache_policy=INPUTS + TASK_SOURCE, persist_result=True,
                retries=2, retry_delay_seconds=30, retry_condition_fn=retry_transient)(body)


def fresh(stage_task, stage_dir: Path):
    """`stage_task`, with its cached result refreshed unless the stage's files are all still there (stages.result_files):
    after `rm -rf artifacts/` the same run id runs the stage again instead of handing the next one paths that no
    longer exist."""
    return stage_task.with_options(refresh_cache=not result_files.done(stage_dir, stage_dir.name))


preflight_task = stage("preflight", preflight.run, gpu=True)
train_task = stage("train", train.run, gpu=True)
merge_task = stage("merge", merge.run, gpu=True)
export_task = stage("export", export.run, gpu=True)
smoke_task = stage("smoke", smoke.run, gpu=True)
handoff_task = stage("handoff", handoff.run, gpu=False)


@flow(name="train-and-export", log_prints=True)
def train_and_export(config: str = "configs/default.yaml", overrides: list[str] | None = None, run_id: str | None = None) -> dict:
    """Fine-tune, merge, export GGUF, smoke-test and hand off, as configured in `config`."""
    cfg = load_config(config, overrides)
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
        sm = run_stage(smoke_task, paths, "smoke", cfg, quants(ex))  # every GGUF under llama.cpp, on the serving card's budget
        tracking.log_export(cfg, paths.stage("train"), drift(ex), smoke_accuracy(sm))
        ho = handoff_task(cfg, paths.run_id, quants(ex), paths.stage("handoff"), **handoff_inputs(fingerprint, pre, tr, mg, ex, sm))
        return finish(paths, ho, pre, tr, mg, ex, sm)


def run_stage(stage_task, paths: RunPaths, name: str, cfg, *inputs):
    """One stage in its directory of the run (its cached result reused while its files are there), and what it shows
    in the Prefect UI beyond its memory table."""
    out = paths.stage(name)
    result = fresh(stage_task, out)(cfg, *inputs, out)
    if name == "preflight":
        create_markdown_artifact(result.report_md.read_text(), key="preflight-report", description="Preflight memory estimate")
    elif name == "train":
        publish_memory_timeline(out / "memory_steps.jsonl", result.memory_png)
        publish_eval_curve(result)
    elif name == "export":
        create_table_artifact(drift(result), key="fidelity", description="Each GGUF vs the merged model on held-out texts (mean KL, top-1)")
    elif name == "smoke":
        create_table_artifact([{"quant": f.quant, "accuracy": f.accuracy, "passed": f.passed, "prompts": f.n_prompts,
                                "gen_tok_s": f.gen_tokens_per_s, "n_gpu_layers": f.plan.n_gpu_layers} for f in result.files],
                              key="smoke-results", description="llama.cpp smoke test per GGUF")
    return result


def quants(ex) -> list[tuple[str, Path]]:
    """The export's GGUFs as (type, path), what smoke and the hand-off take."""
    return [(f.quant, f.path) for f in ex.files]


def drift(ex) -> list[dict]:
    """Each GGUF's fidelity to the merged model, the unquantized one first."""
    return [memory.jsonable(f) for f in ex.fidelity]


def smoke_accuracy(sm) -> dict:
    return {f.quant: {"accuracy": f.accuracy} for f in sm.files}


def stage_memory(pre, tr, mg, ex, sm) -> dict:
    return {"preflight": pre.memory, "train": tr.memory, "merge": mg.memory, "export": ex.memory, "smoke": sm.memory}


def handoff_inputs(fingerprint: str, pre, tr, mg, ex, sm) -> dict:
    """What the hand-off records from the stages before it: the adapter, each GGUF's smoke and fidelity figures, every
    stage's memory, the merge, the importance matrix (shipped only where a kept file used it) and the training figures."""
    served = {f.quant: {"accuracy": f.accuracy, "passed": f.passed, "n_prompts": f.n_prompts, "gen_tokens_per_s": f.gen_tokens_per_s,
                        "n_gpu_layers": f.plan.n_gpu_layers,
                        "served": {k: v for k, v in (f.served or {}).items() if k != "examples"} or None} for f in sm.files}
    imat = ex.imatrix
    return dict(
        adapter_dir=tr.adapter_dir, data_fingerprint=fingerprint, smoke=served, memory=stage_memory(pre, tr, mg, ex, sm),
        fidelity=drift(ex), merge={"base": mg.base, "save_dtype": mg.save_dtype, "kl": mg.kl},
        extra_files=[Path(imat["file"])] if imat and imat.get("used_by") else [],
        extra={"prefect_flow_run_id": str(flow_run.id) if flow_run.id else None, "imatrix": imat and {**imat, "file": Path(imat["file"]).name},
               "train": {"steps": tr.steps, "first_loss": tr.first_loss, "final_loss": tr.final_loss, "fit": tr.fit,
                         "best_eval_loss": tr.best_eval_loss}})


def finish(paths: RunPaths, ho, pre, tr, mg, ex, sm) -> dict:
    """The run's comparison with the bundle `latest` pointed at and its summary, as artifacts and beside the run; a
    failed flow run when the retrain was worse (what the deployment's automation alerts on); else what the run made."""
    reports = stage_memory(pre, tr, mg, ex, sm) | {"handoff": ho.memory}
    create_markdown_artifact(ho.comparison, key="champion-challenger", description=f"{paths.run_id} against the bundle `latest` pointed at")
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


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.debug:
        os.environ[errors.DEBUG_ENV] = "1"
    run_id = new_run_id() if a.run_id is None else a.run_id  # chosen here, so that an interrupted run can be named for its resumption
    resume = " ".join(["python -m flows.train_and_export", "--config", a.config, *(f"--set {s}" for s in a.set), "--run-id", run_id])

    def go():
        check_run_id(run_id)  # an empty, reserved or path-like id, before anything starts
        load_config(a.config, a.set)  # a bad config fails here, before Prefect starts a server
        reaper.watch()  # nothing this process starts outlives it, even after kill -9
        reaper.isolate_temporary_api()
        train_and_export(config=a.config, overrides=a.set, run_id=run_id)

    return errors.run_cli(go, "train-and-export", resume=resume)


if __name__ == "__main__":
    sys.exit(main())
