"""MLflowSink: findings as metrics, tags and artifacts of an MLflow run."""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stethoscope.findings import Severity
from stethoscope.sinks._buffer import MAX_BUFFER, _Background
from stethoscope.sinks.jsonl import _json_line

if TYPE_CHECKING:
    from stethoscope.findings import Finding
    from stethoscope.sinks.base import RunContext
    from stethoscope.summary import EpochSummary

__all__ = ["MLflowSink"]

_INSTALL = "MLflowSink needs mlflow: pip install 'stethoscope[mlflow]'"
#: The artifact directory of the run that receives ``findings.jsonl`` and ``summary.txt``.
ARTIFACT_DIR = "stethoscope"
_TAG_LIMIT = 5000  # the tag value length every MLflow store accepts
_BATCH = 100  # findings per log_batch: under MLflow's limits of 1000 metrics and 100 tags


class MLflowSink(_Background):
    """Logs findings to an MLflow run, from a background thread.

    What the run receives:

    - a metric per detector, ``stethoscope/<detector>``, valued by step: the finding's
      ``value``, or ``1.0`` when it has none (so the series still marks each step the
      detector fired). NaN and Inf are logged as they are; MLflow's SQL stores keep
      NaN and clamp Inf to the largest float.
    - tags ``stethoscope/<detector>/first`` and ``stethoscope/<detector>/last``: the
      step, severity, place and message of that detector's first and latest finding;
      ``stethoscope/verdict``, the latest epoch's verdict; and, when a finding stopped
      training, ``stethoscope/stopped_by`` saying which and why.
    - at :meth:`close`, the artifacts ``stethoscope/findings.jsonl`` (every finding the
      sink received, one strict-JSON line each, as :class:`JSONLSink` writes them) and
      ``stethoscope/summary.txt`` (each epoch's summary table as text); and, when the
      callback keeps a record of the run (``record=``), its report:
      ``stethoscope/report/report.html`` and each figure as a PNG in
      ``stethoscope/report/figures/`` (PNGs need Chrome or Chromium on the machine;
      without one the sink warns and attaches the HTML alone).

    Which run: ``run_id`` if given; otherwise the run of a Lightning ``MLFlowLogger``
    when the callback finds one at train start (findings join the logger's run instead
    of a second one); otherwise MLflow's active run (``mlflow.start_run()``) at the
    first finding; otherwise a run the sink starts in ``experiment`` (default:
    ``MLFLOW_EXPERIMENT_NAME``, else MLflow's default experiment), named ``run_name``,
    and ends at :meth:`close`. A run the sink did not start is never ended by it.

    Network calls never happen on the training thread: :meth:`emit` queues the
    finding (and appends it to a local spool file for the artifact) and returns; a
    worker thread sends the queue, up to 100 findings per request. When a request
    fails (the server is down), the findings wait, at most ``max_buffer`` of them, and
    are retried at the next flush (each epoch end); past the bound new ones are dropped
    and counted in :attr:`dropped` and in the epoch summary. :meth:`flush` waits at most
    ``flush_timeout`` for the queue to empty, and not at all while the server is
    failing; :meth:`close` waits at most ``close_timeout``. How long one request may
    hang is MLflow's own setting (``MLFLOW_HTTP_REQUEST_TIMEOUT``,
    ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``); it holds up the worker, never training.

    Args:
        experiment: Name of the experiment for a run the sink starts; created if
            missing.
        run_name: Name of a run the sink starts.
        run_id: Log to this existing run.
        tracking_uri: The tracking server or store; default: MLflow's current one
            (``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``).
        min_severity: Drop findings below this: ``"info"``, ``"warning"`` or ``"error"``.
        max_buffer: How many findings to hold while the server does not answer.
        flush_timeout: Seconds :meth:`flush` waits for the queue to empty.
        close_timeout: Seconds :meth:`close` waits for the queue and the artifacts.

    Raises:
        ModuleNotFoundError: ``mlflow`` is not installed.
        TypeError: A name, id or URI is not a str.
        ValueError: A name, id or URI is empty; ``run_id`` comes with ``experiment`` or
            ``run_name``; ``min_severity`` is not a severity; ``max_buffer`` or a
            timeout is out of range.

    Example:
        >>> sink = MLflowSink(experiment="digits", run_name="lr-3")  # doctest: +SKIP
        >>> LightningStethoscope(sinks=[ConsoleSink(), sink])  # doctest: +SKIP

        With ``MLFlowLogger`` in the Trainer, ``MLflowSink()`` joins the logger's run.
        Pickling carries the options and the run once it is known (after the first
        flush); the copy logs to that run and leaves ending it to the original. A copy
        made before the sink started its run would start one of its own.
    """

    _batch_size = _BATCH

    def __init__(
        self,
        *,
        experiment: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        tracking_uri: str | None = None,
        min_severity: Severity | str = "info",
        max_buffer: int = MAX_BUFFER,
        flush_timeout: float = 5.0,
        close_timeout: float = 30.0,
    ) -> None:
        _mlflow()  # fail now, with the extra to install, not at the first finding
        for name, value in (
            ("experiment", experiment),
            ("run_name", run_name),
            ("run_id", run_id),
            ("tracking_uri", tracking_uri),
        ):
            _check_name(value, name)
        if run_id is not None and (experiment is not None or run_name is not None):
            raise ValueError(
                f"MLflowSink: run_id={run_id!r} names an existing run, so experiment="
                f"{experiment!r} and run_name={run_name!r} would be ignored; pass either "
                "run_id or experiment/run_name"
            )
        self.experiment = experiment
        self.run_name = run_name
        super().__init__(min_severity=min_severity)
        self._options = {"run_id": run_id, "tracking_uri": tracking_uri}
        self._init_background(
            max_buffer=max_buffer, flush_timeout=flush_timeout, close_timeout=close_timeout
        )
        self._init_run(run_id, tracking_uri)

    def _init_run(self, run_id: str | None, tracking_uri: str | None) -> None:
        self._run_id = run_id
        self._uri = tracking_uri
        self._owns_run = False
        self._resolved = run_id is not None and tracking_uri is not None
        self._client: Any = None
        self._first_tagged: set[str] = set()
        self._in_use = False  # anything queued since the last close
        self._spool = _Spool()
        self._record: Path | None = None  # the run's record, whose report goes with the run
        self._report: Callable[[Path], None] | None = None  # writes that report

    # -- public face ---------------------------------------------------------------------
    @property
    def run_id(self) -> str | None:
        """The run findings go to; ``None`` until known (a run the sink starts gets its
        id with the first request)."""
        return self._run_id

    @property
    def tracking_uri(self) -> str | None:
        """The tracking URI written to; ``None`` until the first finding if not given."""
        return self._uri

    @property
    def follows_logger(self) -> bool:
        """Whether a Lightning ``MLFlowLogger`` may lend its run: nothing names a run here."""
        return (
            self.experiment is None
            and self.run_name is None
            and self._options["run_id"] is None
            and self._options["tracking_uri"] is None
        )

    def start(self, context: RunContext) -> None:
        """Join the framework's MLflow run when the run has one and the sink names no
        run itself (:attr:`follows_logger`): one run, not two. Remember the run's record,
        if it keeps one, to attach its report at :meth:`close`."""
        if self.follows_logger and (run := context.mlflow_run()) is not None:
            run_id, tracking_uri = run
            self.use_run(run_id, tracking_uri=tracking_uri)
        # after use_run, which starts the sink afresh
        self._record, self._report = context.record, context.report

    def use_run(self, run_id: str, *, tracking_uri: str | None = None) -> None:
        """Log to the existing run ``run_id`` from now on.

        :meth:`start` calls this with the run of the Trainer's ``MLFlowLogger`` when
        the sink names no run itself.

        Args:
            run_id: The run's id.
            tracking_uri: Where that run lives; default: MLflow's current tracking URI.

        Raises:
            TypeError: ``run_id`` or ``tracking_uri`` is not a str.
            ValueError: ``run_id`` or ``tracking_uri`` is empty.
        """
        _check_name(run_id, "run_id", optional=False)
        _check_name(tracking_uri, "tracking_uri")
        with self._cond:
            if run_id == self._run_id and (tracking_uri is None or tracking_uri == self._uri):
                return
            spool = self._spool
            self._init_run(run_id, tracking_uri)
            self._spool = spool  # one set of artifacts per sink, whichever run they go to

    def emit(self, finding: Finding) -> None:
        """Queue ``finding`` for the run if it is at or above ``min_severity``; never waits."""
        if not self.accepts(finding):
            return
        self._resolve()
        self._spool.append("findings.jsonl", _json_line(finding))
        self._deliver(("finding", (finding, int(time.time() * 1000))))

    def epoch_end(self, summary: EpochSummary) -> None:
        """Keep the summary table for the artifact; tag the verdict, and why training stopped."""
        self._resolve()
        self._spool.append("summary.txt", _render(summary) + "\n")
        tags = {"stethoscope/verdict": _text(summary.verdict)}
        stopped = summary.stopped_by
        if stopped:
            where = f" in {stopped['where']}" if stopped.get("where") else ""
            tags["stethoscope/stopped_by"] = _text(
                f"{stopped['detector']} ({stopped['severity']}) at step {stopped['step']}"
                f"{where}: {stopped['message']}"
            )
        self._deliver(("tags", tags), finding=False)

    def flush(self) -> None:
        """Ask the worker to send (and retry) what waits; wait at most ``flush_timeout``."""
        if self._in_use:
            self._flush_background()

    def close(self) -> None:
        """Upload the artifacts, end a run the sink started, stop the worker. Idempotent.

        Waits at most ``close_timeout``; findings still unsent then are counted in
        :attr:`dropped` (with a warning that says where their local copy is). A later
        emit starts a new worker and logs to the same run.
        """
        if self._report is not None:
            self._resolve()
            self._write_report(self._report)
            self._report = None
        if not self._in_use:
            return
        if self._spool.files() or self._spool.path("report") is not None:
            self._deliver(("artifacts", None), finding=False)
        self._deliver(("end", None), finding=False)
        drained = self._close_background()
        self._in_use = False
        self._spool.keep = not drained  # the local copy outlives the sink if the upload failed

    def _write_report(self, report: Callable[[Path], None]) -> None:
        """The record's report, into the spool for the artifacts."""
        try:
            report(self._spool.folder("report"))
        except Exception as exc:  # the report is a copy of the record: never cost the run
            warnings.warn(
                f"stethoscope: MLflowSink could not attach all of the run's report ({exc}); "
                f"the record stays in {str(self._record)!r}",
                RuntimeWarning,
                stacklevel=3,
            )

    def __repr__(self) -> str:
        args = [
            f"{k}={v!r}"
            for k, v in (
                ("experiment", self.experiment),
                ("run_name", self.run_name),
                *self._options.items(),
            )
            if v is not None
        ]
        args.append(f"min_severity={self.min_severity.value!r}")
        return f"MLflowSink({', '.join(args)})"

    def __getstate__(self) -> dict[str, Any]:
        # A thread, a lock and a client cannot cross processes. The run can: the copy
        # logs to the same one, and the original, which started it, ends it.
        return {
            "experiment": self.experiment,
            "run_name": self.run_name,
            "options": dict(self._options),
            "min_severity": self.min_severity,
            "max_buffer": self.max_buffer,
            "flush_timeout": self.flush_timeout,
            "close_timeout": self.close_timeout,
            "run_id": self._run_id,
            "uri": self._uri,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.experiment = state["experiment"]
        self.run_name = state["run_name"]
        self._options = state["options"]
        self.min_severity = state["min_severity"]
        self._init_background(
            max_buffer=state["max_buffer"],
            flush_timeout=state["flush_timeout"],
            close_timeout=state["close_timeout"],
        )
        self._init_run(state["run_id"], state["uri"])

    # -- caller's thread -----------------------------------------------------------------
    def _resolve(self) -> None:
        """Settle the URI and, if it is MLflow's active run, the run: local, no network.

        Done on the caller's thread at the first finding, because MLflow's active run
        belongs to the thread that started it.
        """
        self._in_use = True
        if self._resolved:
            return
        mlflow = _mlflow()
        current = mlflow.get_tracking_uri()
        if self._uri is None:
            self._uri = current
        if self._run_id is None and self.experiment is None and self.run_name is None:
            active = mlflow.active_run()
            if active is not None and self._uri == current:
                self._run_id = active.info.run_id
        self._resolved = True

    def _destination(self) -> str:
        run = repr(self._run_id) if self._run_id else "(not started)"
        return f"MLflow run {run} at {self._uri!r}"

    def _lost_note(self) -> str:
        path = self._spool.path("findings.jsonl")
        if path is None:
            return ""
        return f"; every finding is still in {str(path)!r}"

    def _batch(self) -> list[Any]:
        head = self._pending[0][1]
        if head[0] != "finding":
            return [head]
        batch = []
        for _, item in self._pending:
            if item[0] != "finding" or len(batch) == self._batch_size:
                break
            batch.append(item)
        return batch

    # -- worker thread -------------------------------------------------------------------
    def _send(self, items: list[tuple[str, Any]]) -> None:
        from mlflow.entities import Metric, RunTag

        client = self._mlflow_client()
        run_id = self._ensure_run(client)
        kind, payload = items[0]
        if kind == "finding":
            metrics, tags, first = [], {}, set()
            for _, (finding, timestamp) in items:
                key = _key(finding.detector)
                value = 1.0 if finding.value is None else finding.value
                metrics.append(Metric(f"stethoscope/{key}", value, timestamp, finding.step))
                text = _describe(finding)
                if key not in self._first_tagged and key not in first:
                    first.add(key)
                    tags[f"stethoscope/{key}/first"] = text
                tags[f"stethoscope/{key}/last"] = text
            client.log_batch(run_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])
            self._first_tagged |= first
        elif kind == "tags":
            client.log_batch(run_id, tags=[RunTag(k, v) for k, v in payload.items()])
        elif kind == "artifacts":
            for path in self._spool.files():
                client.log_artifact(run_id, str(path), artifact_path=ARTIFACT_DIR)
            report = self._spool.path("report")
            if report is not None:
                client.log_artifacts(run_id, str(report), artifact_path=f"{ARTIFACT_DIR}/report")
        elif kind == "end" and self._owns_run:
            client.set_terminated(run_id, "FINISHED")

    def _mlflow_client(self) -> Any:
        if self._client is None:
            self._client = _mlflow().MlflowClient(tracking_uri=self._uri)
        return self._client

    def _ensure_run(self, client: Any) -> str:
        """The run to log to, started now if the sink must start one."""
        if self._run_id is not None:
            return self._run_id
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name:
            found = client.get_experiment_by_name(name)
            if found is None:
                experiment_id = client.create_experiment(name)
            elif found.lifecycle_stage == "deleted":
                raise ValueError(
                    f"MLflowSink: experiment {name!r} is deleted; restore it or pick another name"
                )
            else:
                experiment_id = found.experiment_id
        else:
            experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"  # MLflow's default
        run = client.create_run(experiment_id, run_name=self.run_name)
        self._run_id = run.info.run_id
        self._owns_run = True
        return self._run_id


class _Spool:
    """Local files the artifacts are made of, written on the caller's thread.

    Kept on disk rather than in memory so that a long run does not grow the process;
    removed when the sink is collected, unless an upload failed (then the warning
    names the file, and it stays for the user).
    """

    def __init__(self) -> None:
        self.dir: Path | None = None
        # Shared with the finalizer, which must not hold the spool itself.
        self._flags = {"keep": False, "failed": False}

    @property
    def keep(self) -> bool:
        return self._flags["keep"]

    @keep.setter
    def keep(self, value: bool) -> None:
        self._flags["keep"] = value

    def _made(self) -> Path:
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="stethoscope-mlflow-"))
            weakref.finalize(self, _remove_unless_kept, self.dir, self._flags)
        return self.dir

    def folder(self, name: str) -> Path:
        """A folder of the spool, for artifacts that are whole directories."""
        path = self._made() / name
        path.mkdir(exist_ok=True)
        return path

    def append(self, name: str, text: str) -> None:
        if self._flags["failed"]:
            return
        try:
            with open(self._made() / name, "a", encoding="utf-8") as f:
                f.write(text)
        except OSError:
            # The artifact is a copy: the metrics and tags still go to MLflow.
            self._flags["failed"] = True

    def files(self) -> list[Path]:
        if self.dir is None:
            return []
        return sorted(p for p in self.dir.iterdir() if p.is_file())

    def path(self, name: str) -> Path | None:
        if self.dir is None or not (self.dir / name).exists():
            return None
        return self.dir / name


def _remove_unless_kept(path: Path, flags: dict[str, bool]) -> None:
    if not flags["keep"]:
        shutil.rmtree(path, ignore_errors=True)


def _mlflow() -> Any:
    try:
        import mlflow
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(_INSTALL) from exc
    return mlflow


def _check_name(value: Any, name: str, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise TypeError(f"MLflowSink: {name}={value!r} must be a str" + " or None" * optional)
    if not value.strip():
        raise ValueError(f"MLflowSink: {name}={value!r} is empty")


def _key(name: str) -> str:
    """A detector name as an MLflow key part: keys take ``[A-Za-z0-9_.\\- /:]``."""
    return re.sub(r"[^A-Za-z0-9_.\- /:]", "_", name)


def _describe(finding: Finding) -> str:
    where = f" at {finding.where}" if finding.where else ""
    return _text(f"step {finding.step} ({finding.severity.value}){where}: {finding.message}")


def _text(text: str) -> str:
    """A tag value MLflow accepts: valid UTF-8, within the length every store takes.

    A value MLflow rejects would be rejected at every retry too, and would hold up
    every finding queued behind it.
    """
    return text.encode("utf-8", errors="backslashreplace").decode("utf-8")[:_TAG_LIMIT]


def _render(summary: EpochSummary) -> str:
    """The summary table as plain text, as the console would print it 120 wide."""
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=120, color_system=None, force_terminal=False).print(summary)
    return buffer.getvalue()
