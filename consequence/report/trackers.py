"""Experiment trackers (``--report-to``, docs/tracking.md): each metrics.jsonl line, the
resolved config and the run's report, sent on to TensorBoard, MLflow, Weights & Biases or Trackio.

metrics.jsonl stays the run's record; a tracker gets a copy for its dashboard, under the same
names (a nested value such as ``reward_components_mean`` flattened with ``/``), with the
iteration as the step. Offline by default: TensorBoard's event files in ``RUN/tensorboard/``, an
MLflow file store in ``RUN/mlruns/`` (unless ``MLFLOW_TRACKING_URI`` is set), W&B in offline
mode (unless ``WANDB_MODE`` is set) with its files in ``RUN/wandb/``, Trackio's local store. A
tracker goes online only through its own environment variables. What a resumed run continues
(the MLflow run id, the W&B run id, the Trackio run name) is kept in ``RUN/trackers.json``.

Each tracker is one class with ``log(step, metrics)``, ``log_params(params)``,
``log_artifact(path)``, ``close(status)`` and ``state()`` (what trackers.json keeps); the
packages are optional extras (``pip install 'consequence[tensorboard]'``) imported only here,
when the tracker starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from consequence.fileio import write_text_atomic

TRACKERS: tuple[str, ...] = ("tensorboard", "mlflow", "wandb", "trackio")
# The module a tracker needs (torch.utils.tensorboard's writer imports the tensorboard package);
# the extra of the same name in pyproject.toml installs it.
_MODULE = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb", "trackio": "trackio"}
STATE_FILE = "trackers.json"
PROJECT = "consequence"  # the W&B project, the MLflow experiment, the Trackio project (each env variable overrides)
# What the end of a run hands to the trackers that keep files (report.md, report.json, curves.png;
# viewer.html when `consequence view` wrote one).
ARTIFACTS: tuple[str, ...] = ("report.md", "report.json", "curves.png", "viewer.html")


# ---- what is sent --------------------------------------------------------------------------
def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``values`` with nested mappings flattened: ``{"a": {"b": 1}}`` → ``{"a/b": 1}`` (an empty
    one stays a value: ``{"env_options": {}}`` is kept as it is)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            out |= flatten(value, f"{prefix}{key}/")
        else:
            out[f"{prefix}{key}"] = value
    return out


def scalars(metrics: Mapping[str, Any]) -> dict[str, int | float]:
    """The numbers of a metrics line, flattened (:func:`flatten`): ints and floats (a bool as
    0 / 1); None, NaN and ±inf are left out (a metric undefined in that iteration, e.g.
    ``reward_mean`` when every episode was an env_error), and so are strings and lists."""
    out: dict[str, int | float] = {}
    for key, value in flatten(metrics).items():
        if isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = value
    return out


def texts(metrics: Mapping[str, Any]) -> dict[str, str]:
    """The text of a metrics line, flattened: strings, and non-empty lists of strings (the
    iteration's ``warnings``) joined one per line; for the trackers that show text (TensorBoard)."""
    out: dict[str, str] = {}
    for key, value in flatten(metrics).items():
        if isinstance(value, str) and value:
            out[key] = value
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            out[key] = "\n".join(value)
    return out


def param_text(value: Any) -> str:
    """A config value as a run parameter's text: a string as it is, anything else as JSON
    (``0.0002``, ``true``, ``null``, ``["test", "train"]``)."""
    return value if isinstance(value, str) else json.dumps(value)


# ---- which trackers ------------------------------------------------------------------------
def requested(names: Sequence[str]) -> list[str]:
    """The trackers of ``--report-to`` (``none`` is no tracker)."""
    return [n for n in names if n != "none"]


def _installed(module: str) -> bool:
    if module in sys.modules:  # a stand-in set by a test, or None: "not installed"
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def check_trackers(names: Sequence[str]) -> None:
    """Every tracker of ``--report-to`` can start: its package is installed. Checked before any
    work (``consequence train``'s checks), without importing the package.

    Raises:
        ValueError: one tracker is not installed, naming the extra that installs it.
    """
    for name in requested(names):
        if name not in _MODULE:
            raise ValueError(f"--report-to {name}: not a tracker; give none or {', '.join(TRACKERS)}, comma-separated")
        if not _installed(_MODULE[name]):
            raise ValueError(
                f"--report-to {name}: the {_MODULE[name]} package is not installed; "
                f"pip install 'consequence[{name}]' (or drop {name} from --report-to)"
            )


# ---- the trackers --------------------------------------------------------------------------
class Tracker(Protocol):
    """One tracker's run. ``new``: it started a run of its own (not one a resumed run continues),
    which then gets the config (:meth:`log_params`)."""

    name: str
    new: bool

    def log(self, step: int, metrics: Mapping[str, Any]) -> None: ...
    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_artifact(self, path: Path) -> None: ...
    def close(self, status: str) -> None: ...
    def state(self) -> dict[str, Any]: ...
    def where(self) -> str: ...


class TensorBoardTracker:
    """Event files in ``RUN/tensorboard/`` (torch's SummaryWriter): scalars, the iteration's
    warnings as text, the config as one text summary, report.md as text and curves.png as an
    image. A resumed run writes a new event file in the same folder starting at its first
    iteration; ``purge_step`` hides what the interrupted run logged from that step on (an
    iteration it logged but had no resume state for), so each step shows once."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, params: Mapping[str, Any], start: int, stored: Mapping[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = run_dir / "tensorboard"
        self.new = not stored
        self.step = max(start - 1, 0)
        self.writer = SummaryWriter(str(self.dir), purge_step=start if start > 0 else None)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, step)
        for key, text in texts(metrics).items():
            self.writer.add_text(key, _code_block(text), step)
        self.writer.flush()  # each iteration on disk: a killed run keeps what it logged
        self.step = step

    def log_params(self, params: Mapping[str, Any]) -> None:
        lines = "\n".join(f"{k}: {param_text(v)}" for k, v in params.items())
        self.writer.add_text("config", _code_block(lines), 0)
        self.writer.flush()

    def log_artifact(self, path: Path) -> None:
        """report.md as text, a PNG as an image; other files are left to the run folder."""
        if path.suffix == ".md":
            self.writer.add_text(path.stem, path.read_text(encoding="utf-8"), self.step)
        elif path.suffix == ".png":
            from matplotlib.image import imread

            self.writer.add_image(path.stem, imread(path), self.step, dataformats="HWC")
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()

    def state(self) -> dict[str, Any]:
        return {"log_dir": str(self.dir)}

    def where(self) -> str:
        return f"event files in {self.dir} (tensorboard --logdir {self.dir})"


def _code_block(text: str) -> str:
    """TensorBoard renders text as markdown: a code block keeps it as written."""
    return "```\n" + text + "\n```"


# MLflow's run status for how the run ended (loop.recorder.run_ending)
_MLFLOW_STATUS = {"finished": "FINISHED", "interrupted": "KILLED"}
# MLflow refuses metric and parameter names outside these characters (its name check)
_MLFLOW_NAME = re.compile(r"[^\w\-. /:]")
_MLFLOW_PARAM_CHARS = 6000  # the longest parameter value MLflow stores


class MlflowTracker:
    """A run in an MLflow tracking store through ``MlflowClient`` (no global active run): the
    store of ``MLFLOW_TRACKING_URI`` when set, else a file store in ``RUN/mlruns``; the
    experiment ``MLFLOW_EXPERIMENT_NAME``, else ``consequence``. A resumed run reopens the run
    id kept in trackers.json when that store still has it."""

    name = "mlflow"

    def __init__(self, run_dir: Path, params: Mapping[str, Any], start: int, stored: Mapping[str, Any]):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if not self.uri.startswith("file:"):  # a server: MLflow's own retries can take minutes to fail
            print(f"mlflow: connecting to {self.uri} (MLFLOW_HTTP_REQUEST_MAX_RETRIES / _TIMEOUT bound the wait)")
        with _file_store_allowed(self.uri):
            self.client = MlflowClient(tracking_uri=self.uri)
        run_id = stored.get("run_id") if stored.get("tracking_uri") == self.uri else None
        if run_id is not None:
            try:
                self.experiment_id = self.client.get_run(run_id).info.experiment_id
                self.client.update_run(run_id, status="RUNNING")
            except MlflowException:
                run_id = None  # the store lost it: a new run
        self.new = run_id is None
        if run_id is None:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
            found = self.client.get_experiment_by_name(experiment)
            self.experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run = self.client.create_run(self.experiment_id, run_name=run_dir.name, tags={"run_dir": str(run_dir)})
            run_id = run.info.run_id
        self.run_id: str = run_id

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_MLFLOW_NAME.sub("_", k), float(v), now, step) for k, v in scalars(metrics).items()]
        for part in _chunks(batch, 1000):  # MLflow's most metrics per batch
            self.client.log_batch(self.run_id, metrics=part)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        batch = [Param(_MLFLOW_NAME.sub("_", k), param_text(v)[:_MLFLOW_PARAM_CHARS]) for k, v in params.items()]
        for part in _chunks(batch, 100):  # MLflow's most parameters per batch
            self.client.log_batch(self.run_id, params=part)

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=_MLFLOW_STATUS.get(status, "FAILED"))

    def state(self) -> dict[str, Any]:
        return {"tracking_uri": self.uri, "experiment_id": self.experiment_id, "run_id": self.run_id}

    def where(self) -> str:
        return f"run {self.run_id} in {self.uri}"


@contextlib.contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    """MLflow 3 refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE`` is set; the run's own
    ``RUN/mlruns`` is one (mlflow-skinny has no database store), so it is allowed while the
    client opens it (MLflow keeps the store it opened), unless the user set the variable."""
    if not uri.startswith("file:") or "MLFLOW_ALLOW_FILE_STORE" in os.environ:
        yield
        return
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


class WandbTracker:
    """A Weights & Biases run: offline unless ``WANDB_MODE`` is set (then W&B's own settings
    and login decide), its files in ``RUN/wandb/`` unless ``WANDB_DIR`` is set, the project
    ``WANDB_PROJECT`` or ``consequence``. The run id is kept in trackers.json and passed with
    ``resume="allow"``, so a resumed run continues the same W&B run (an offline run is
    uploaded with ``wandb sync RUN/wandb/offline-run-*``)."""

    name = "wandb"

    def __init__(self, run_dir: Path, params: Mapping[str, Any], start: int, stored: Mapping[str, Any]):
        import wandb

        self.wandb = wandb
        self.new = "id" not in stored
        self.id = stored.get("id") or uuid.uuid4().hex[:16]
        kwargs: dict[str, Any] = {
            "project": os.environ.get("WANDB_PROJECT") or PROJECT,
            "name": run_dir.name,
            "id": self.id,
            "resume": "allow",
            "dir": os.environ.get("WANDB_DIR") or str(run_dir),
        }
        if "WANDB_MODE" not in os.environ:
            kwargs["mode"] = "offline"
        self.run = wandb.init(**kwargs)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log_artifact(self, path: Path) -> None:
        artifact = self.wandb.Artifact(f"{self.id}-{path.name}", type="run-output")
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)

    def state(self) -> dict[str, Any]:
        return {"id": self.id}

    def where(self) -> str:
        return f"run {self.id}" + (" (offline)" if "WANDB_MODE" not in os.environ else "")


class TrackioTracker:
    """A Trackio run in its local store (``TRACKIO_DIR``, else Hugging Face's cache; a Space
    only when ``TRACKIO_SPACE_ID`` is set), project ``consequence``. Trackio resumes a run by
    its name, which is kept in trackers.json; it takes the config when the run starts."""

    name = "trackio"

    def __init__(self, run_dir: Path, params: Mapping[str, Any], start: int, stored: Mapping[str, Any]):
        import trackio

        self.new = "name" not in stored
        self.run_name = stored.get("name") or f"{run_dir.name}-{uuid.uuid4().hex[:8]}"
        self.run = trackio.init(
            project=PROJECT,
            name=self.run_name,
            config=dict(params),
            resume="never" if self.new else "allow",
            embed=False,  # no dashboard launched from a training run
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Nothing: Trackio took the config in ``trackio.init``."""

    def log_artifact(self, path: Path) -> None:
        self.run.log_artifact(str(path), type="run-output")

    def close(self, status: str) -> None:
        self.run.finish()

    def state(self) -> dict[str, Any]:
        return {"name": self.run_name}

    def where(self) -> str:
        return f"run {self.run_name} of project {PROJECT}"


_CLASSES: dict[str, Callable[..., Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MlflowTracker,
    "wandb": WandbTracker,
    "trackio": TrackioTracker,
}


def _chunks(items: list, n: int) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


# ---- the run's trackers, together -----------------------------------------------------------
class Trackers:
    """The trackers of one run, each call fanned out to all of them.

    A tracker that raises while the run goes on (a full disk, a lost connection) is dropped
    with a warning, and the run continues: metrics.jsonl holds every iteration whatever a
    tracker did. Starting one is different: :func:`open_trackers` raises.
    """

    def __init__(self, trackers: Sequence[Tracker] = (), warn: Callable[[str], None] = print):
        self.trackers, self.warn = list(trackers), warn

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for t in list(self.trackers):
            try:
                call(t)
            except Exception as e:  # any tracker error: the run goes on without it
                self.trackers.remove(t)
                self.warn(
                    f"--report-to {t.name}: {what} failed ({type(e).__name__}: {e}); it is dropped for the "
                    "rest of the run (metrics.jsonl keeps every iteration)"
                )
                with contextlib.suppress(Exception):
                    t.close("failed")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Iteration ``step``'s metrics.jsonl line."""
        self._each("logging the metrics", lambda t: t.log(step, metrics))

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        """The run's end: each existing file of ``paths``, where the tracker keeps files."""
        for path in (p for p in paths if p.is_file()):

            def send(t: Tracker, path: Path = path) -> None:
                t.log_artifact(path)

            self._each(f"logging {path.name}", send)

    def close(self, status: str) -> None:
        """End every tracker's run with the run's status (``loop.recorder.run_ending``)."""
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            try:
                t.close(status)
            except Exception as e:  # the run's own ending is recorded whatever a tracker does
                self.warn(f"--report-to {t.name}: closing its run failed ({type(e).__name__}: {e})")

    def describe(self) -> str:
        """One line: where each tracker writes."""
        return "; ".join(f"{t.name}: {t.where()}" for t in self.trackers)


def open_trackers(
    names: Sequence[str],
    run_dir: Path,
    config: Mapping[str, Any],
    start: int,
    warn: Callable[[str], None] = print,
) -> Trackers:
    """Start the trackers of ``--report-to`` for the run in ``run_dir`` and keep what a resume
    needs in ``RUN/trackers.json`` (atomically).

    Args:
        config: the resolved settings (``TrainConfig.model_dump()``), sent flattened as the
            run's parameters to a tracker that starts a run of its own.
        start: the first iteration this process runs; > 0 for a resumed run, which continues
            the tracker runs named in trackers.json.

    Raises:
        ValueError: a tracker is not installed (:func:`check_trackers`) or could not start its
            run (the message names it and the tracker's error); the trackers started before
            it are closed.
    """
    names = requested(names)
    if not names:
        return Trackers([], warn)
    check_trackers(names)
    path = Path(run_dir) / STATE_FILE
    stored = _read_state(path) if start > 0 else {}
    params = flatten(config)
    opened: list[Tracker] = []
    for name in names:
        try:
            tracker = _CLASSES[name](Path(run_dir), params, start, stored.get(name, {}))
            if tracker.new:
                tracker.log_params(params)
        except Exception as e:
            Trackers(opened, warn).close("failed")
            raise ValueError(
                f"--report-to {name}: could not start its run ({type(e).__name__}: {e}); "
                f"fix it, or drop {name} from --report-to"
            ) from e
        opened.append(tracker)
    write_text_atomic(path, json.dumps({**stored, **{t.name: t.state() for t in opened}}, indent=1))
    return Trackers(opened, warn)


def _read_state(path: Path) -> dict[str, Any]:
    """trackers.json, or ``{}`` when it is missing or unreadable (the trackers then start new runs)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
