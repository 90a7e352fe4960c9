"""Where training reports besides its own files: TensorBoard and MLflow (`training.report_to`).

Each gets the Trainer's own integration (transformers' TensorBoardCallback and MLflowCallback: loss,
learning rate, grad norm, eval loss, the Trainer's arguments) plus what only this stage knows: the
resolved config flattened (`training.learning_rate`, ...), memory at every optimizer step (the
figures of memory_steps.jsonl, as `memory/<key>`), and at the end the loss and memory plots, the
eval summary (best step, best eval loss, stopped early) and train_result.json.

TensorBoard writes to <out>/tensorboard. A resumed run (kill -9, OOM recovery) purges what was
logged after its checkpoint (SummaryWriter's purge_step), so no stretch of a curve is drawn twice.

MLflow writes to MLFLOW_TRACKING_URI when it is set; else to a SQLite store <out>/mlflow.db with
artifacts under <out>/mlflow-artifacts (MLflow 3.17 refuses its old file store, ./mlruns, unless
MLFLOW_ALLOW_FILE_STORE=true: "maintenance mode"). The experiment is MLFLOW_EXPERIMENT_NAME, else
handoff.model_name; the run is named after the run id. The run id is kept in <out>/mlflow_run.json,
so a training resumed after a crash continues its run rather than opening a second one (metrics of
the steps replayed after the checkpoint are then logged twice; MLflow keeps both). MLFLOW_RUN_ID and
MLFLOW_NESTED_RUN are not used: the stage opens its own run.

Only the process of rank 0 reports.

A tracker the config asks for must work: the preflight checks that the MLflow server answers (or the
SQLite / file store's directory is writable) and that the TensorBoard directory is writable, and stops
the run before training if not (stages/checks.py). During the run, MLflow's HTTP client retries are
bounded (HTTP_BOUNDS, unless MLFLOW_HTTP_REQUEST_* are set): a server that goes away mid-run costs
seconds, not MLflow's default of 7 retries with backoff (about 4 minutes per call), and the run stops with
one message (TrackerError) saying how to resume; the checkpoints are kept.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from stages.config import RunConfig
from stages.errors import UserError

# MLflow's HTTP client, unless the user set these: 2 retries 1-2 s apart, 10 s per attempt (worst case about 35 s for
# a server that accepts connections and never answers; a refused connection fails in about 3 s).
HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


class TrackerError(UserError, RuntimeError):
    """A tracker training.report_to names cannot be reached or written to."""


def default_uri(out_dir: Path) -> str:
    """Where MLflow logs without MLFLOW_TRACKING_URI: a SQLite store in the train stage's directory."""
    return f"sqlite:///{(Path(out_dir) / 'mlflow.db').resolve()}"


def mlflow_uri(out_dir: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or default_uri(out_dir)


def tensorboard_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "tensorboard"


@contextlib.contextmanager
def bounded_http():
    """HTTP_BOUNDS in the environment while the block runs (MLflow reads them at every request); a user's own
    MLFLOW_HTTP_REQUEST_* settings win."""
    added = {k: v for k, v in HTTP_BOUNDS.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


class Tracker:
    """The trackers of one training stage; a context manager that ends the MLflow run on exit
    (FAILED on an exception) and leaves MLflow's process-wide tracking URI as it found it.

        with Tracker(cfg, out_dir) as tracker:
            trainer = make_trainer(..., callbacks=tracker.callbacks(resume_step), memory_sinks=(tracker.memory,))
            ...
            tracker.finish(step, files, summary)
    """

    def __init__(self, cfg: RunConfig, out_dir: Path) -> None:
        self.cfg, self.out_dir = cfg, Path(out_dir)
        rank0 = int(os.environ.get("RANK", "0")) == 0
        self.tensorboard = rank0 and "tensorboard" in cfg.training.report_to
        self.mlflow = rank0 and "mlflow" in cfg.training.report_to
        self.writer = None         # this attempt's SummaryWriter
        self.trainer_args = None   # the TrainingArguments the MLflow run's params came from
        self.run_id: str | None = None
        self._bounds = contextlib.ExitStack()
        self._uri_before = os.environ.get("MLFLOW_TRACKING_URI")  # put back on exit

    # --- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Tracker:
        if self.mlflow:
            self._bounds.enter_context(bounded_http())
            try:
                self._start_mlflow()
            except Exception as e:
                import mlflow

                self._bounds.close()
                mlflow.set_tracking_uri(self._uri_before)
                if _unreachable(e):
                    raise self._lost(e) from e
                raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if not self.mlflow:
            return
        import mlflow

        try:
            if mlflow.active_run() is not None:
                mlflow.end_run(status="FINISHED" if exc_type is None else "KILLED" if exc_type is KeyboardInterrupt else "FAILED")
        except Exception as e:  # the server went away: the error training stopped with (if any) is the one to tell
            if exc is None:
                raise self._lost(e) from e
        finally:
            mlflow.set_tracking_uri(self._uri_before)  # None also clears the MLFLOW_TRACKING_URI it exported
            self._bounds.close()
        if exc is not None and _unreachable(exc):
            raise self._lost(exc) from exc

    def _lost(self, e: BaseException) -> TrackerError:
        uri = mlflow_uri(self.out_dir)
        return TrackerError(
            f"the MLflow tracking server at {uri} stopped answering during training ({_first_line(e)}); the checkpoints in "
            f"{self.out_dir.resolve()} are kept: start the server again (or point MLFLOW_TRACKING_URI at one that runs, or remove "
            "mlflow from training.report_to) and rerun with the same --run-id to resume")

    def callbacks(self, resume_step: int) -> list:
        """Fresh Trainer callbacks for one attempt (a new Trainer each: resume, OOM recovery)."""
        out = []
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            from transformers.integrations import TensorBoardCallback

            if self.writer is not None:  # the failed attempt's (the callback closes it only when training ends)
                self.writer.close()
            # what was logged past the checkpoint is dropped from the curves: the steps after it run again
            self.writer = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
            self.writer.add_text("config", f"```\n{self.cfg.to_yaml()}\n```", resume_step)
            out.append(TensorBoardCallback(tb_writer=self.writer))
        if self.mlflow:
            out.append(_mlflow_callback(self))
        return out

    # --- what the stage logs ---------------------------------------------------------------

    def memory(self, row: dict) -> None:
        """One memory_steps.jsonl row (MemoryCallback's sink)."""
        figures = {f"memory/{k}": v for k, v in row.items() if k not in ("step", "time")}
        if self.writer is not None:
            for k, v in figures.items():
                self.writer.add_scalar(k, v, row["step"])
        if self.mlflow:
            import mlflow

            mlflow.log_metrics(figures, step=row["step"], synchronous=False)

    def finish(self, step: int, files: list[Path], summary: dict) -> None:
        """At the end: the plots as images, `files` as artifacts, `summary` (numbers, flags) as metrics and tags."""
        numbers = {k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}
        flags = {k: str(v) for k, v in summary.items() if k not in numbers}
        pngs = [f for f in files if f is not None and f.suffix == ".png" and f.is_file()]
        if self.tensorboard:
            from matplotlib.image import imread
            from torch.utils.tensorboard import SummaryWriter

            with SummaryWriter(str(self.out_dir / "tensorboard")) as w:  # the attempt's writer is closed by now
                for png in pngs:
                    w.add_image(f"plots/{png.stem}", imread(png)[..., :3], step, dataformats="HWC")
                for k, v in numbers.items():
                    w.add_scalar(f"summary/{k}", v, step)
                for k, v in flags.items():
                    w.add_text(f"summary/{k}", v, step)
        if self.mlflow:
            import mlflow

            mlflow.log_metrics({f"summary/{k}": v for k, v in numbers.items()}, step=step)
            mlflow.set_tags({f"summary.{k}": v for k, v in flags.items()})
            for f in files:
                if f is not None and f.is_file():
                    mlflow.log_artifact(str(f), artifact_path="plots" if f.suffix == ".png" else None)

    # --- MLflow run ------------------------------------------------------------------------

    def _start_mlflow(self) -> None:
        import mlflow

        uri = mlflow_uri(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(uri)
        params = flatten(json.loads(self.cfg.model_dump_json()))
        client = mlflow.MlflowClient(uri)
        saved = self.out_dir / "mlflow_run.json"
        run_id = None
        if saved.is_file():
            before = json.loads(saved.read_text())
            run = _get_run(client, before["run_id"]) if before.get("tracking_uri") == uri else None
            # a changed config cannot continue the run: MLflow refuses to change a logged param
            if run is not None and all(run.data.params.get(k, v) == v for k, v in params.items()):
                run_id = run.info.run_id
        if run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or self.cfg.handoff.model_name
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                local = None if self._uri_before else (self.out_dir / "mlflow-artifacts").resolve().as_uri()
                experiment_id = client.create_experiment(name, artifact_location=local)
            else:
                experiment_id = experiment.experiment_id
            run = mlflow.start_run(experiment_id=experiment_id, run_name=self.out_dir.resolve().parent.name,
                                   tags={"train_dir": str(self.out_dir.resolve()), "config_fingerprint": self.cfg.fingerprint()})
            mlflow.log_params(params)
        else:
            run = mlflow.start_run(run_id=run_id)
        self.run_id = run.info.run_id
        saved.write_text(json.dumps({"tracking_uri": uri, "run_id": self.run_id}))
        print(f"train: MLflow run {self.run_id} at {uri}")


def log_export(cfg: RunConfig, train_dir: Path, fidelity: list[dict], smoke: dict[str, dict]) -> None:
    """After export and smoke, into the training run's trackers: per GGUF its mean KL and top-1 agreement
    against the merged model and its smoke pass rate, as metrics, and the fidelity table as text.

    The MLflow run is the one training opened (<train_dir>/mlflow_run.json), ended by then; the client
    logs into it without reopening it. Nothing happens for a tracker training did not report to.
    """
    metrics = {f"export/{f['quant']}/{k}": float(f[k]) for f in fidelity for k in ("mean_kl", "top1_agreement")}
    metrics |= {f"smoke/{q}/accuracy": float(s["accuracy"]) for q, s in smoke.items()}
    rows = ["| file | mean KL | top-1 agreement | smoke pass rate |", "|---|---|---|---|"]
    rows += [f"| {f['file']} | {f['mean_kl']} | {f['top1_agreement']} | {smoke.get(f['quant'], {}).get('accuracy', '-')} |" for f in fidelity]
    table = "\n".join(rows)
    if "tensorboard" in cfg.training.report_to and (train_dir / "tensorboard").is_dir():
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(train_dir / "tensorboard")) as w:
            for k, v in metrics.items():
                w.add_scalar(k, v, 0)
            w.add_text("export/fidelity", table, 0)
    saved = train_dir / "mlflow_run.json"
    if "mlflow" in cfg.training.report_to and saved.is_file():
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        run = json.loads(saved.read_text())
        client = MlflowClient(run["tracking_uri"])
        try:
            with bounded_http():
                client.log_batch(run["run_id"], metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
                client.log_text(run["run_id"], table + "\n", "export/fidelity.md")
                client.log_dict(run["run_id"], {"fidelity": fidelity, "smoke": smoke}, "export/fidelity.json")
        except Exception as e:
            if not _unreachable(e):
                raise
            raise TrackerError(f"the MLflow tracking server at {run['tracking_uri']} does not answer ({_first_line(e)}), so the export's "
                               "figures cannot be logged to the training run; nothing was published: start the server again and "
                               "rerun with the same --run-id (the finished stages are not redone)") from e


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """{"training": {"learning_rate": 0.002}} -> {"training.learning_rate": "0.002"} (lists as JSON)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, type(None))) else str(v)
    return out


def _unreachable(e: BaseException) -> bool:
    """Whether `e` (or what it was raised from) is MLflow failing to reach its HTTP server, not a bug or a refusal."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        name = type(e).__module__ + "." + type(e).__name__
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if name.startswith(("requests.exceptions.", "urllib3.exceptions.")) and any(w in name for w in ("Connection", "Timeout", "MaxRetry")):
            return True
        if type(e).__name__ == "MlflowException" and str(e).startswith("API request to ") and " failed with exception " in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _get_run(client, run_id: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException:  # deleted, or another store
        return None


def _mlflow_callback(tracker: Tracker):
    from transformers.integrations import MLflowCallback

    class StageMLflowCallback(MLflowCallback):
        """transformers' MLflow callback, logging into the run the stage opened (so it neither
        starts nor ends one). Every attempt logs the first attempt's TrainingArguments: an OOM
        recovery trains with another micro-batch, and MLflow refuses to change a logged param
        (the change is in train_result.json's oom_recoveries)."""

        def setup(self, args, state, model):
            tracker.trainer_args = tracker.trainer_args or args
            super().setup(tracker.trainer_args, state, model)

    return StageMLflowCallback()
