"""Helpers for testing your own code against stethoscope's findings, without mocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stethoscope.detectors.base import Detector
from stethoscope.findings import Severity
from stethoscope.sinks.base import RunContext, Sink

if TYPE_CHECKING:
    from stethoscope.findings import Finding
    from stethoscope.observation import Observation
    from stethoscope.summary import EpochSummary

__all__ = ["CapturingSink", "RecordingDetector"]


class RecordingDetector(Detector):
    """A detector that keeps every observation it is shown and finds nothing: what an
    adapter hands the detectors, for assertions.

    Args:
        needs: The statistics it asks for (it runs only on steps that carry all of them).
        name: Its name among the detectors (two recorders need two names).

    Example:
        >>> spy = RecordingDetector({"loss"})
        >>> # Trainer(callbacks=[LightningStethoscope(detectors=[spy])]); then spy.seen
    """

    name = "recorder"

    def __init__(self, needs: set[str], *, name: str = "recorder") -> None:
        self.needs = frozenset(needs)  # type: ignore[misc]
        self.name = name  # type: ignore[misc]
        super().__init__()
        self.seen: list[Observation] = []

    def _update(self, obs: Observation) -> list[Finding]:
        self.seen.append(obs)
        return []


class CapturingSink(Sink):
    """A sink that keeps every finding and summary it receives, for assertions.

    Pass it as a sink and assert on what it captured, the way structlog's
    ``testing.capture_logs`` captures log entries: no mocks, no parsing of output.

    Args:
        min_severity: Drop findings below this, as the other sinks do; the default
            keeps everything.

    Attributes:
        findings: Every finding kept, in emission order.
        summaries: Every epoch summary received, in order.
        flush_count: How many times ``flush`` was called.
        closed: Whether ``close`` was called.
        context: The run's context from the last ``start``, if any.

    Raises:
        ValueError: ``min_severity`` is not a severity.

    Example:
        >>> from stethoscope.findings import Finding
        >>> sink = CapturingSink()
        >>> sink.emit(Finding(step=7, epoch=0, detector="loss_spike",
        ...                   severity="warning", message="The loss jumped 40x."))
        >>> sink.detectors()
        {'loss_spike'}
        >>> [f.step for f in sink.at_least("warning")]
        [7]

        In a test of your own training code::

            def test_training_is_healthy():
                sink = CapturingSink()
                trainer = L.Trainer(max_steps=50, callbacks=[LightningStethoscope(sinks=[sink])])
                trainer.fit(MyModel(lr=1e-3))
                assert sink.at_least("warning") == [], sink.findings

            def test_too_high_learning_rate_is_caught():
                sink = CapturingSink()
                trainer = L.Trainer(max_steps=50, callbacks=[LightningStethoscope(sinks=[sink])])
                trainer.fit(MyModel(lr=1e3))
                assert "exploding_gradients" in sink.detectors()

        Findings made in another process (``ddp_spawn``) stay in that process's copy.
    """

    def __init__(self, *, min_severity: Severity | str = "info") -> None:
        super().__init__(min_severity=min_severity)
        self.findings: list[Finding] = []
        self.summaries: list[EpochSummary] = []
        self.flush_count = 0
        self.closed = False
        self.context: RunContext | None = None

    def start(self, context: RunContext) -> None:
        """Keep the run's context."""
        self.context = context

    def emit(self, finding: Finding) -> None:
        """Keep ``finding`` if it is at or above ``min_severity``."""
        if self.accepts(finding):
            self.findings.append(finding)

    def epoch_end(self, summary: EpochSummary) -> None:
        """Keep ``summary``."""
        self.summaries.append(summary)

    def flush(self) -> None:
        """Count the call."""
        self.flush_count += 1

    def close(self) -> None:
        """Mark the sink closed. Findings emitted later are still kept."""
        self.closed = True

    def by_detector(self, name: str) -> list[Finding]:
        """The findings from detector ``name``, in order."""
        return [f for f in self.findings if f.detector == name]

    def detectors(self) -> set[str]:
        """The names of the detectors that reported anything."""
        return {f.detector for f in self.findings}

    def at_least(self, severity: Severity | str) -> list[Finding]:
        """The findings at or above ``severity``, in order.

        Raises:
            ValueError: ``severity`` is not a severity.
        """
        floor = Severity.parse(severity, argument="severity")
        return [f for f in self.findings if f.severity >= floor]

    def clear(self) -> None:
        """Forget the findings, summaries and flush count (``closed`` stays)."""
        self.findings.clear()
        self.summaries.clear()
        self.flush_count = 0

    def __repr__(self) -> str:
        return (
            f"CapturingSink(findings={len(self.findings)}, summaries={len(self.summaries)}, "
            f"flush_count={self.flush_count}, closed={self.closed})"
        )
