"""TensorBoardSink: findings as scalars and text in a TensorBoard log directory."""

from __future__ import annotations

import io
import itertools
import os
import re
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stethoscope.findings import Severity
from stethoscope.sinks._buffer import MAX_BUFFER, _Buffered, _write_all
from stethoscope.statistics import DISTRIBUTION_EDGES

if TYPE_CHECKING:
    from stethoscope.findings import Finding
    from stethoscope.observation import Observation
    from stethoscope.sinks.base import RunContext

__all__ = ["TensorBoardSink"]

#: Where findings go when no log dir is given and no Lightning TensorBoardLogger lends one.
DEFAULT_LOG_DIR = os.path.join("runs", "stethoscope")

_INSTALL = "TensorBoardSink needs tensorboard: pip install 'stethoscope[tensorboard]'"
_files = itertools.count()  # two sinks of one process never share an events file


class TensorBoardSink(_Buffered):
    """Writes findings to TensorBoard event files: a scalar series and a text per detector;
    and each layer's weight and gradient distributions to TensorBoard's histogram tab.

    Each finding becomes one event at its step holding a scalar under the tag
    ``stethoscope/<detector>`` (its ``value``; ``1.0`` when the finding has none, so
    the series still marks when the detector fired; NaN and Inf are written as they
    are) and a text under ``stethoscope/<detector>/message`` (severity, where, and the
    message). The sink writes the event file itself with TensorBoard's record format
    (``tensorboard`` only: neither torch nor TensorFlow is imported), one unbuffered
    append per finding, so a killed run keeps every finding it emitted. A write that
    fails (a full disk, a log dir that cannot be created) waits in memory, up to
    ``max_buffer`` findings, and is retried at the next flush.

    Lightning users with a ``TensorBoardLogger`` and no ``log_dir`` here get the
    logger's ``log_dir``, so findings appear next to the run's own metrics.

    With ``histograms`` on, every ``histogram_every`` steps (down to a sixteenth of that
    while the sampler is hot) the callback measures each parameter's ``distributions``
    statistic on the device, and the sink writes it under ``stethoscope/weights/<name>`` and
    ``stethoscope/gradients/<name>`` as a histogram of ``log10 |x|``: half-decade bins
    from -12 to 4, exact zeros counted at -12.5 (TensorBoard draws values on a linear
    axis, where magnitudes from 1e-12 to 1e4 would all sit at zero). Non-finite values
    are left out: the non-finite detectors report them.

    Args:
        log_dir: The directory for the event file; created on the first write if
            missing. ``None``: the Lightning ``TensorBoardLogger``'s ``log_dir`` when the
            callback finds one at train start, else ``runs/stethoscope``.
        min_severity: Drop findings below this: ``"info"``, ``"warning"`` or ``"error"``.
        max_buffer: How many findings to keep in memory while writes fail; past this
            bound new ones are dropped and counted in :attr:`dropped` and the epoch
            summary.
        histograms: Whether to write the weight and gradient histograms.
        histogram_every: Steps between two histograms of a parameter, when healthy.

    Raises:
        ModuleNotFoundError: ``tensorboard`` is not installed.
        TypeError: ``log_dir`` is not a str, a path or ``None``.
        ValueError: ``min_severity`` is not a severity, ``max_buffer`` is not an
            integer >= 0, or ``histogram_every`` is not an integer >= 1.
        NotADirectoryError: ``log_dir`` exists and is a file.

    Example:
        >>> sink = TensorBoardSink("runs/exp1")  # doctest: +SKIP
        >>> LightningStethoscope(sinks=[ConsoleSink(), sink])  # doctest: +SKIP
        >>> # tensorboard --logdir runs

        Pickling carries the log dir and options; the copy writes its own event file
        in the same directory, which TensorBoard reads as the same run.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        min_severity: Severity | str = "info",
        max_buffer: int = MAX_BUFFER,
        histograms: bool = True,
        histogram_every: int = 64,
    ) -> None:
        _protos()  # fail now, with the extra to install, not at the first finding
        super().__init__(min_severity=min_severity)
        if (
            isinstance(histogram_every, bool)
            or not isinstance(histogram_every, int)
            or histogram_every < 1
        ):
            raise ValueError(
                f"TensorBoardSink: histogram_every={histogram_every!r} must be an integer >= 1 "
                "(steps)"
            )
        self.histograms = bool(histograms)
        #: What the sink wants measured for its histograms (see ``Sink.wants``).
        self.wants = frozenset({"distributions"}) if self.histograms else frozenset()
        self.wants_every = histogram_every
        self._init_buffer(max_buffer=max_buffer)
        self._log_dir = None if log_dir is None else _as_dir(log_dir)
        self.follows_logger = log_dir is None
        self._file: Any = None
        self._file_path: Path | None = None
        self._owed = b""

    @property
    def log_dir(self) -> Path:
        """The directory written to (``runs/stethoscope`` until one is given or lent)."""
        return self._log_dir if self._log_dir is not None else _as_dir(DEFAULT_LOG_DIR)

    @property
    def file(self) -> Path | None:
        """The event file written now, or ``None`` before the first write."""
        return self._file_path

    def start(self, context: RunContext) -> None:
        """Write into the framework's TensorBoard log dir when the run has one and the
        sink was made without a directory of its own (:attr:`follows_logger`): findings
        then sit beside the run's own curves."""
        if self.follows_logger and (log_dir := context.tensorboard_log_dir()) is not None:
            self.use_log_dir(log_dir)

    def use_log_dir(self, log_dir: str | os.PathLike[str]) -> None:
        """Write to ``log_dir`` from now on, in a new event file there.

        :meth:`start` calls this with the run's log dir (a Lightning
        ``TensorBoardLogger``'s ``log_dir``) when the sink was made without one.

        Raises:
            TypeError: ``log_dir`` is not a str or a path.
            NotADirectoryError: ``log_dir`` exists and is a file.
        """
        new = _as_dir(log_dir)
        if new != self._log_dir:
            self._close_file()
            self._log_dir = new

    def emit(self, finding: Finding) -> None:
        """Write ``finding`` as a scalar and a text event if it is at or above ``min_severity``."""
        if not self.accepts(finding):
            return
        self._deliver(_record(_event(finding)))

    def observe(self, obs: Observation, interval: int) -> None:
        """Write the step's weight and gradient histograms, when it measured them."""
        if obs.weight_hist is None or not self.histograms:
            return
        self._deliver(_record(_histograms(obs)), finding=False)

    def flush(self) -> None:
        """Write the events that failed before, in order; the rest is on disk already."""
        self._retry()

    def close(self) -> None:
        """Retry what waits once more, then close the event file. Safe to call again.

        A later emit opens a new event file in the same directory.
        """
        if self._pending:
            self._retry()
            self._give_up()
        self._close_file()

    def __repr__(self) -> str:
        shown = "None" if self._log_dir is None else repr(str(self._log_dir))
        return f"TensorBoardSink({shown}, min_severity={self.min_severity.value!r})"

    def __getstate__(self) -> dict[str, Any]:
        # An open file cannot cross processes; the copy writes an event file of its own.
        return {
            "log_dir": self._log_dir,
            "follows_logger": self.follows_logger,
            "min_severity": self.min_severity,
            "max_buffer": self.max_buffer,
            "histograms": self.histograms,
            "histogram_every": self.wants_every,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.min_severity = state["min_severity"]
        self._init_buffer(max_buffer=state["max_buffer"])
        self._log_dir = state["log_dir"]
        self.follows_logger = state["follows_logger"]
        self.histograms = state.get("histograms", True)
        self.wants = frozenset({"distributions"}) if self.histograms else frozenset()
        self.wants_every = state.get("histogram_every", 64)
        self._file = None
        self._file_path = None
        self._owed = b""

    def _destination(self) -> str:
        return repr(str(self._file_path or self.log_dir))

    def _open(self) -> None:
        log_dir = self.log_dir
        os.makedirs(log_dir, exist_ok=True)
        # TensorBoard finds event files by "tfevents" in the name and reads every file
        # of a directory as one run; the suffix tells whose file it is.
        name = (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_files):04d}.stethoscope"
        )
        path = log_dir / name
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 (open until close)
        self._file_path = path
        event_pb2 = _protos()[0]
        # Every event file starts by saying its format version.
        self._owed = _record(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _send(self, items: list[bytes]) -> None:
        (data,) = items
        if self._file is None:
            self._open()
        owed, self._owed = self._owed, b""
        try:
            _write_all(self._file, owed + data)
        except OSError:
            self._owed = owed
            raise

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None


def _protos() -> tuple[Any, Any, Any, Any, Any]:
    """TensorBoard's protos and helpers, imported on first use (no torch, no TensorFlow)."""
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.text import metadata as text_metadata
        from tensorboard.summary.writer.record_writer import RecordWriter
        from tensorboard.util import tensor_util
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(_INSTALL) from exc
    return event_pb2, summary_pb2, text_metadata, RecordWriter, tensor_util


def _event(finding: Finding) -> Any:
    """One event at the finding's step: its scalar and its message as text."""
    event_pb2, summary_pb2, text_metadata, _, tensor_util = _protos()
    tag = f"stethoscope/{_tag(finding.detector)}"
    value = 1.0 if finding.value is None else finding.value
    where = f" at `{finding.where}`" if finding.where else ""
    text = f"**{finding.severity.value.upper()}**{where}: {finding.message}"
    summary = summary_pb2.Summary()
    summary.value.add(tag=tag, simple_value=value)
    summary.value.add(
        tag=f"{tag}/message",
        metadata=text_metadata.create_summary_metadata(display_name=None, description=None),
        # backslashreplace: one odd character in a layer name must not cost the event.
        tensor=tensor_util.make_tensor_proto(text.encode("utf-8", errors="backslashreplace")),
    )
    return event_pb2.Event(wall_time=time.time(), step=finding.step, summary=summary)


#: The upper bin limits of the histograms, in log10 of the magnitude: exact zeros (at
#: -12.5), then each half-decade bin of ``DISTRIBUTION_EDGES``, then the one past them.
_LOG_LIMITS = np.array(
    [-12.5, *(np.log10(DISTRIBUTION_EDGES)), np.log10(DISTRIBUTION_EDGES[-1]) + 0.5]
)
_LOG_CENTRES = _LOG_LIMITS - 0.25


def _histograms(obs: Observation) -> Any:
    """One event at the step holding each parameter's weight and gradient histograms."""
    event_pb2, summary_pb2 = _protos()[:2]
    summary = summary_pb2.Summary()
    for kind, hists in (("weights", obs.weight_hist), ("gradients", obs.grad_hist)):
        if hists is None:
            continue
        for name, counts in zip(obs.names, hists, strict=True):
            finite = np.asarray(counts[:-1], np.float64)  # the last bin: non-finite values
            total = float(finite.sum())
            if total <= 0:
                continue
            used = np.flatnonzero(finite)
            histo = summary_pb2.HistogramProto(
                min=float(_LOG_LIMITS[used[0]] - 0.5),
                max=float(_LOG_LIMITS[used[-1]]),
                num=total,
                sum=float(finite @ _LOG_CENTRES),
                sum_squares=float(finite @ np.square(_LOG_CENTRES)),
                bucket_limit=_LOG_LIMITS.tolist(),
                bucket=finite.tolist(),
            )
            summary.value.add(tag=f"stethoscope/{kind}/{_tag(name)}", histo=histo)
    return event_pb2.Event(wall_time=time.time(), step=obs.step, summary=summary)


def _record(event: Any) -> bytes:
    """``event`` framed as one TFRecord (length, CRCs), ready to append to the file."""
    record_writer = _protos()[3]
    buffer = io.BytesIO()
    record_writer(buffer).write(event.SerializeToString())
    return buffer.getvalue()


def _tag(name: str) -> str:
    """A detector name as a tag part: TensorBoard tags take ``[A-Za-z0-9_./-]``."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name)


def _as_dir(log_dir: Any) -> Path:
    """``log_dir`` as an absolute Path, checked for what can be known before writing."""
    try:
        path = Path(log_dir).expanduser().absolute()
    except TypeError:
        raise TypeError(
            f"TensorBoardSink: log_dir={log_dir!r} must be a str, an os.PathLike or None"
        ) from None
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"TensorBoardSink: log_dir {str(path)!r} is a file; give a directory, e.g. "
            f"{str(path.parent / 'runs')!r}"
        )
    return path
