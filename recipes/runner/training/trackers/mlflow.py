"""``--tracker mlflow``: the run in an MLflow tracking store, through MLflow's own client.

The MLflow run holds the resolved config as params, the tags ``recipe``, ``run_id``,
``git_revision`` (and MLflow's ``mlflow.source.git.commit``), every scalar TensorBoard gets
(on the optimizer-step axis), and at the end the best checkpoint and ``curves.png`` as
artifacts. The experiment is the recipe's name, the MLflow run's name the run folder's.

Where: ``--tracker-uri`` (any MLflow tracking URI: a folder, ``file:``, ``sqlite:``,
``http(s):``), else ``MLFLOW_TRACKING_URI``, else the store an earlier start of this run
folder used, else ``mlruns/`` in the working directory (beside ``runs/``): MLflow's file
store, no server. MLflow keeps the file store in maintenance mode and since 3.13 refuses it
unless ``MLFLOW_ALLOW_FILE_STORE`` is true; this module sets it for its process when the URI
is a folder (a value the user set wins). ``mlflow ui`` needs the full ``mlflow`` package and
the same variable.

A resumed run continues the same MLflow run: ``mlflow.json`` in the run folder keeps its
tracking URI and id. MLflow's params cannot change, so a resume logs only keys the run does
not have yet (a resume's overrides are in ``config.json``). Scalars are sent at the logger's
flushes, which come with every checkpoint: after a kill, the steps since the newest checkpoint
were never sent and come once as the run redoes them.

Built on ``MlflowClient`` rather than Ignite's ``MLflowLogger``: that logger's handlers log
at their own events, one call per metric, and read tensors with ``.item()``; here the
scalars arrive as numbers through the scalar sink and go out in one ``log_batch`` per flush.
"""

import importlib.util
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from handlers.atomic_write import write_json_atomic
from recipes.runner.config.command_line import ConfigError
from recipes.runner.console import warn
from recipes.runner.training.trackers import TrackedRun, saved_state, unwritable

DEFAULT_STORE = "mlruns"  # in the working directory, beside runs/
URI_VARIABLE = "MLFLOW_TRACKING_URI"  # MLflow's own: after --tracker-uri, before the rest
STATE_FILE = "mlflow.json"  # in the run folder: the MLflow run that a resume continues
# A tracking server that does not answer must cost seconds, not MLflow's default of 7
# retries with backoff of up to 120 s each; the user's own settings win.
HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
END_STATUS = {"completed": "FINISHED", "interrupted": "KILLED"}  # else FAILED


def check(config: Any, run_dir: Path) -> None:
    """MLflow installed and, for a local store (a folder, ``file:``, ``sqlite:``), its place
    writable (or creatable); nothing is written."""
    try:
        import mlflow  # noqa: F401 - the run would import it next; a broken install fails here
    except ImportError:
        raise ConfigError("--tracker mlflow: MLflow is not installed; pip install -e "
                          "'.[mlflow]', or leave --tracker at none") from None
    uri = tracking_uri(config.tracker_uri, run_dir)
    path = _local_path(uri)
    named = (f"{URI_VARIABLE}={os.environ[URI_VARIABLE]}"
             if not config.tracker_uri and os.environ.get(URI_VARIABLE) else f"--tracker-uri {uri}")
    if uri.startswith("sqlite:") and importlib.util.find_spec("sqlalchemy") is None:
        raise ConfigError(f"{named}: MLflow's database store needs SQLAlchemy "
                          "(pip install mlflow); or give a folder for its file store")
    problem = None if path is None else unwritable(path.parent if uri.startswith("sqlite:")
                                                     else path)
    if problem:
        raise ConfigError(f"{named}: {problem}")


def tracking_uri(given: str, run_dir: Path) -> str:
    """``given``, else ``MLFLOW_TRACKING_URI`` (MLflow's own way of naming the store), else
    the URI in the run folder's ``mlflow.json``, else ``mlruns/`` here; a folder becomes an
    absolute ``file:`` URI (a resume from elsewhere finds the same store)."""
    uri = (given or os.environ.get(URI_VARIABLE)
           or saved_state(run_dir / STATE_FILE).get("tracking_uri") or DEFAULT_STORE)
    if urlparse(uri).scheme in ("", "file"):
        return _local_path(uri).as_uri()
    return uri


def _local_path(uri: str) -> Path | None:
    """The folder of a file store or the file of an SQLite store; None for a server."""
    parsed = urlparse(uri)
    if parsed.scheme == "":
        return Path(uri).expanduser().resolve()
    if parsed.scheme == "file":
        return Path(url2pathname(parsed.path)).expanduser().resolve()
    if parsed.scheme == "sqlite" and uri.startswith("sqlite:///"):  # not sqlite:// (memory)
        return Path(uri.removeprefix("sqlite:///")).resolve()
    return None


def start(run: TrackedRun) -> "MlflowTracker | None":
    """Open the MLflow run (or continue the one in ``mlflow.json``), log the params and tags,
    and record it in ``mlflow.json``; None after one warning line when MLflow refuses."""
    uri = tracking_uri(run.config.get("tracker_uri", ""), run.run_dir)
    scheme = urlparse(uri).scheme
    for name, value in ({"MLFLOW_ALLOW_FILE_STORE": "true"} if scheme == "file"
                        else HTTP_SETTINGS if scheme in ("http", "https") else {}).items():
        os.environ.setdefault(name, value)
    from mlflow import MlflowClient

    try:
        client = MlflowClient(tracking_uri=uri)
        saved = saved_state(run.run_dir / STATE_FILE)
        run_id = _continued(client, uri, saved) or _new_run(client, run)
        _log_params_and_tags(client, run_id, run)
    except Exception as error:  # noqa: BLE001 - any failure of the tracker: the run goes on
        _warn(f"cannot log to {uri} ({_one_line(error)}); the run goes on without MLflow")
        return None
    write_json_atomic(run.run_dir / STATE_FILE, {"tracking_uri": uri, "run_id": run_id})
    return MlflowTracker(client, run_id)


def _continued(client: Any, uri: str, saved: Mapping[str, Any]) -> str | None:
    """The saved MLflow run, set running again; None when there is none in this store."""
    if saved.get("tracking_uri") != uri or not saved.get("run_id"):
        return None
    from mlflow.exceptions import MlflowException

    try:
        found = client.get_run(saved["run_id"])
    except MlflowException:  # deleted, or the store was replaced
        return None
    if found.info.lifecycle_stage != "active":
        return None
    client.update_run(saved["run_id"], status="RUNNING")
    return saved["run_id"]


def _new_run(client: Any, run: TrackedRun) -> str:
    experiment = client.get_experiment_by_name(run.recipe)
    experiment_id = (experiment.experiment_id if experiment is not None
                     else client.create_experiment(run.recipe))
    return client.create_run(experiment_id, run_name=run.run_dir.name).info.run_id


def _log_params_and_tags(client: Any, run_id: str, run: TrackedRun) -> None:
    from mlflow.entities import Param, RunTag

    logged = client.get_run(run_id).data.params
    params = [Param(key, str(value)) for key, value in run.config.items() if key not in logged]
    tags = {"recipe": run.recipe, "run_id": run.run_id, "run_dir": str(run.run_dir.resolve())}
    if run.git:
        tags["mlflow.source.git.commit"] = run.git["commit"]
        tags["git_revision"] = run.git["commit"] + ("+dirty" if run.git.get("dirty") else "")
    client.log_batch(run_id, params=params,
                     tags=[RunTag(key, value) for key, value in tags.items()])


def metric_key(tag: str) -> str:
    """The MLflow key of a TensorBoard tag: every ``/`` after the first becomes ``.``
    (``train/lr/decayed`` -> ``train/lr.decayed``). The file store keeps a key's values in a
    file at the key's path, so ``train/lr`` and ``train/lr/decayed`` would need ``train/lr`` to
    be a file and a folder; one level keeps MLflow's grouping by section (``train/``,
    ``val/``, ``perf/``, ``health/``, ``best/``)."""
    section, slash, rest = tag.partition("/")
    return section + slash + rest.replace("/", ".")


class MlflowSink:
    """A scalar sink (``handlers.scalar_sink``) into one MLflow run: ``write`` keeps the
    record as it came (no conversion among the step's work), ``flush`` sends everything
    kept in one ``log_batch`` (MLflow's client splits it into requests of 1000 metrics).
    The first failure costs one warning line; the sink then drops what it gets."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id
        self.failed = False
        self._records: list[tuple[int, float, Mapping[str, float]]] = []

    def write(self, step: int, epoch: int, wall_time: float,
              scalars: Mapping[str, float]) -> None:
        if not self.failed:
            self._records.append((step, wall_time, scalars))

    def flush(self) -> None:
        records, self._records = self._records, []
        if not records or self.failed:
            return
        from mlflow.entities import Metric

        metrics = [Metric(metric_key(tag), float(value), int(wall_time * 1000), step)
                   for step, wall_time, scalars in records for tag, value in scalars.items()]
        try:
            self.client.log_batch(self.run_id, metrics=metrics)
        except Exception as error:  # noqa: BLE001 - the run goes on without the tracker
            self.fail(error)

    def close(self) -> None:
        self.flush()

    def fail(self, error: Exception) -> None:
        self.failed = True
        self._records = []
        _warn(f"logging to {self.client.tracking_uri} failed ({_one_line(error)}); the run "
              "goes on without MLflow")


class MlflowTracker:
    """An open MLflow run: its scalar sink, and ``finish`` for the artifacts and status."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id
        self.sink = MlflowSink(client, run_id)

    def finish(self, status: str, artifacts: Mapping[str, Path]) -> None:
        """Log ``artifacts`` (path in the MLflow run -> file; missing files are left out)
        and end the MLflow run: FINISHED, KILLED (a signal: to be continued) or FAILED."""
        self.sink.close()
        if self.sink.failed:
            return
        try:
            for name, path in artifacts.items():
                if path.is_file():
                    folder = str(Path(name).parent)
                    self.client.log_artifact(self.run_id, str(path),
                                             None if folder == "." else folder)
            end = next((value for key, value in END_STATUS.items() if status.startswith(key)),
                       "FAILED")
            self.client.set_terminated(self.run_id, status=end)
        except Exception as error:  # noqa: BLE001 - the run's own files are written already
            self.sink.fail(error)

    def closing_line(self) -> str | None:
        """Where the MLflow run went and how to browse it; None when logging failed (a
        warning said so)."""
        if self.sink.failed:
            return None
        uri = self.client.tracking_uri
        scheme = urlparse(uri).scheme
        line = f"  mlflow   run {self.run_id} in {uri}"
        if scheme == "file":  # mlflow ui refuses the file store without the variable
            store = shlex.quote(str(_local_path(uri)))
            return (f"{line} (browse: MLFLOW_ALLOW_FILE_STORE=true mlflow ui "
                    f"--backend-store-uri {store})")
        if scheme == "sqlite":
            return f"{line} (browse: mlflow ui --backend-store-uri {shlex.quote(uri)})"
        if scheme in ("http", "https"):
            return f"{line} (browse: {uri})"
        return line


def _one_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _warn(message: str) -> None:
    warn(f"warning: MLflow: {message}", flush=True)
