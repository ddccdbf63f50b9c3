"""The sink protocol: where findings go. A sink never decides anything."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stethoscope.advice import TrainingSetup
from stethoscope.findings import Severity

if TYPE_CHECKING:
    from stethoscope.findings import Finding
    from stethoscope.observation import Observation
    from stethoscope.summary import EpochSummary

__all__ = ["RunContext", "Sink"]


def _unknown() -> None:
    return None


@dataclass(frozen=True)
class RunContext:
    """What a sink may want to know about the run it writes for, handed to
    :meth:`Sink.start` when training starts (on rank zero, the only rank that writes).

    The framework's destinations are looked up only when a sink asks, because asking can
    create them (a Lightning ``MLFlowLogger`` starts its run when its id is first read).

    Args:
        framework: ``"lightning"``, ``"keras"``, or ``""`` outside a callback.
        rank: This process's rank.
        world_size: How many processes train together.
        printer: Prints a line without tearing the framework's progress bar (Lightning's
            ``ProgressBar.print``, or below Keras' progress line); ``None``: print as
            usual.
        tensorboard_log_dir: Returns the directory the framework's own TensorBoard
            logger writes to, or ``None`` when it has none.
        mlflow_run: Returns ``(run_id, tracking_uri)`` of the framework's own MLflow
            logger's run, or ``None`` when it has none.
        first_step: The step training starts at (above 0: resumed from a checkpoint).
        first_epoch: The epoch it starts in.
        describe: Returns the run's configuration as plain data (the model's parameters,
            the optimizer, the detectors' thresholds), for a sink that keeps it.
        record: The directory of the run's record (``record=`` on the callback), or
            ``None``.
        report: Writes the report of the run's record into a folder (``report.html``,
            and each figure as a PNG in ``figures/``), completing the record first, so a
            sink may attach it at its close whatever the sinks' order; ``None`` when the
            run keeps no record. (Sinks never import the record: this is how they reach
            it.)
        setup: The settings of the user's training that advice depends on (clipping,
            precision, a schedule); the monitor hands them to the detectors.
    """

    framework: str = ""
    rank: int = 0
    world_size: int = 1
    printer: Callable[[str], None] | None = None
    tensorboard_log_dir: Callable[[], str | None] = _unknown
    mlflow_run: Callable[[], tuple[str, str | None] | None] = _unknown
    first_step: int = 0
    first_epoch: int = 0
    describe: Callable[[], dict[str, Any]] | None = None
    record: Path | None = None
    report: Callable[[Path], None] | None = None
    setup: TrainingSetup = field(default_factory=TrainingSetup)


class Sink:
    """Base class for sinks: every method is a no-op by default.

    The monitor calls ``start`` with the run's :class:`RunContext` when training starts,
    ``emit`` for each finding, ``observe`` for each step's statistics (on a sink that
    overrides it), ``epoch_end`` with the epoch's summary, ``flush`` at epoch
    and train end, and ``close`` once at the end. Subclasses override what they need;
    ``close`` must be idempotent. The monitor isolates every call: an exception raised
    here is warned about once per sink and never stops training.

    A sink that cannot always write (a full disk, a server that is down) should keep
    what failed, bounded, retry it at the next ``flush``, and count what it had to
    give up in :attr:`dropped`; the monitor reports that count in the epoch summary.
    The built-in file, TensorBoard and MLflow sinks do.

    Args:
        min_severity: Findings below this are dropped (:meth:`accepts` says which):
            ``"info"``, ``"warning"`` or ``"error"``.

    Raises:
        ValueError: ``min_severity`` is not a severity.
    """

    #: What a subclass that does not call ``Sink.__init__`` accepts: everything.
    min_severity: Severity = Severity.INFO
    #: Statistics this sink wants measured every :attr:`wants_every` steps, whether or not
    #: a detector needs them then (a record of the run, histograms for TensorBoard). The
    #: sampler shortens that interval while something looks wrong, as it does the
    #: detectors'. A sink that wants statistics overrides :meth:`observe` to receive them.
    wants: frozenset[str] = frozenset()
    wants_every: int = 0

    def __init__(self, *, min_severity: Severity | str = "info") -> None:
        self.min_severity = Severity.parse(min_severity, argument="min_severity")

    def accepts(self, finding: Finding) -> bool:
        """Whether ``finding`` is at or above :attr:`min_severity`."""
        return finding.severity >= self.min_severity

    @property
    def dropped(self) -> int:
        """Findings this sink received but had to give up on, since it was made.

        The default is 0: a sink that never gives up on a finding need not override it.
        """
        return 0

    def start(self, context: RunContext) -> None:
        """Training starts: take what the sink needs from the run's context."""

    def emit(self, finding: Finding) -> None:
        """Record one finding."""

    def observe(self, obs: Observation, interval: int) -> None:
        """See one step's observation, on every step, after the detectors judged it
        (``interval``: how often the sampled detectors run at that step). Called only on
        sinks that override it; it runs on the training's hot path, so keep it cheap."""

    def epoch_end(self, summary: EpochSummary) -> None:
        """Receive the summary of a finished epoch."""

    def flush(self) -> None:
        """Push buffered findings to their destination."""

    def close(self) -> None:
        """Release resources. Safe to call more than once."""
