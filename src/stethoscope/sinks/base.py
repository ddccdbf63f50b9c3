"""The sink protocol: where findings go. A sink never decides anything."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stethoscope.findings import Finding
    from stethoscope.summary import EpochSummary

__all__ = ["Sink"]


class Sink:
    """Base class for sinks: every method is a no-op by default.

    The monitor calls ``emit`` for each finding, ``epoch_end`` with the epoch's
    summary, ``flush`` at epoch and train end, and ``close`` once at the end.
    Subclasses override what they need; ``close`` must be idempotent. The monitor
    isolates every call: an exception raised here is warned about once per sink
    and never stops training.

    A sink that cannot always write (a full disk, a server that is down) should keep
    what failed, bounded, retry it at the next ``flush``, and count what it had to
    give up in :attr:`dropped`; the monitor reports that count in the epoch summary.
    The built-in file, TensorBoard and MLflow sinks do.
    """

    @property
    def dropped(self) -> int:
        """Findings this sink received but had to give up on, since it was made.

        The default is 0: a sink that never gives up on a finding need not override it.
        """
        return 0

    def emit(self, finding: Finding) -> None:
        """Record one finding."""

    def epoch_end(self, summary: EpochSummary) -> None:
        """Receive the summary of a finished epoch."""

    def flush(self) -> None:
        """Push buffered findings to their destination."""

    def close(self) -> None:
        """Release resources. Safe to call more than once."""
