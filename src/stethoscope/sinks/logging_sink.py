"""LoggingSink: findings as records of Python's ``logging``, for teams that ship logs elsewhere.

The module is not called ``logging.py`` so that it can never be mistaken for the
standard library's module.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from stethoscope.findings import Severity
from stethoscope.sinks.base import Sink

if TYPE_CHECKING:
    from stethoscope.findings import Finding
    from stethoscope.summary import EpochSummary

__all__ = ["LoggingSink"]

_LEVEL = {
    Severity.INFO: logging.INFO,
    Severity.WARNING: logging.WARNING,
    Severity.ERROR: logging.ERROR,
}
_STATUS_LEVEL = {"ok": logging.INFO, "info": logging.INFO, "warning": logging.WARNING}


class LoggingSink(Sink):
    """Sends each finding to a :mod:`logging` logger at the matching level.

    ``info`` findings are logged at ``INFO``, ``warning`` at ``WARNING`` and ``error``
    at ``ERROR``, as ``"step 120 exploding_gradients at layer1.weight: <message>"``.
    Handlers, formatters and shipping (JSON to a log service, syslog …) are the
    application's: the sink only creates records. Each record carries the finding in
    ``extra``: the whole finding as a dict under ``finding`` (strict-JSON safe, keyed by
    :data:`~stethoscope.findings.FIELDS`), and each field as its own attribute
    (``record.step``, ``record.detector``, ``record.severity``, ``record.value``,
    ``record.threshold``, ``record.where``, ``record.epoch``, ``record.rank``), so a
    format string may say ``%(detector)s``. The finding's message is the record's
    message text; ``message`` itself is reserved by :mod:`logging`.

    Each epoch summary is logged too, as one line with its verdict, at the level of
    its worst status, with the summary as a dict under ``extra["summary"]``.

    Args:
        logger: A logger name or a :class:`logging.Logger`.
        min_severity: Drop findings (and summaries) below this: ``"info"``,
            ``"warning"`` or ``"error"``.

    Raises:
        TypeError: ``logger`` is neither a str nor a :class:`logging.Logger`.
        ValueError: ``logger`` is an empty string, or ``min_severity`` is not a severity.

    Example:
        >>> import logging
        >>> logging.basicConfig(format="%(levelname)s %(name)s %(detector)s %(message)s")
        >>> sink = LoggingSink(min_severity="warning")  # logger "stethoscope"
        >>> LightningStethoscope(sinks=[ConsoleSink(), sink])  # doctest: +SKIP

        Pickling carries the logger's name: the copy logs through the logger of that
        name in its own process.
    """

    def __init__(
        self,
        *,
        logger: str | logging.Logger = "stethoscope",
        min_severity: Severity | str = "info",
    ) -> None:
        if isinstance(logger, logging.Logger):
            name = logger.name
        elif isinstance(logger, str):
            if not logger:
                raise ValueError(
                    "LoggingSink: logger='' names the root logger by accident; pass "
                    "logging.getLogger() for the root logger, or a name like 'stethoscope'"
                )
            name = logger
        else:
            raise TypeError(
                f"LoggingSink: logger={logger!r} must be a logger name (str) or a logging.Logger"
            )
        super().__init__(min_severity=min_severity)
        self.logger = logger if isinstance(logger, logging.Logger) else logging.getLogger(name)

    def emit(self, finding: Finding) -> None:
        """Log ``finding`` if it is at or above ``min_severity``."""
        if not self.accepts(finding):
            return
        d = finding.to_dict(json_safe=True)
        extra: dict[str, Any] = {k: v for k, v in d.items() if k != "message"}
        extra["finding"] = d
        where = f" at {finding.where}" if finding.where else ""
        # %-style arguments, not an f-string: logging formats only what a handler emits.
        self.logger.log(
            _LEVEL[finding.severity],
            "step %d %s%s: %s",
            finding.step,
            finding.detector,
            where,
            finding.message,
            extra=extra,
        )

    def epoch_end(self, summary: EpochSummary) -> None:
        """Log the epoch's verdict at the level of its worst status."""
        level = _STATUS_LEVEL.get(summary.status, logging.ERROR)
        if level < _LEVEL[self.min_severity]:
            return
        self.logger.log(
            level,
            "epoch %d (%d steps): %s",
            summary.epoch,
            summary.steps,
            summary.verdict,
            extra={"summary": summary.to_dict()},
        )

    def __repr__(self) -> str:
        return f"LoggingSink(logger={self.logger.name!r}, min_severity={self.min_severity.value!r})"

    def __getstate__(self) -> dict[str, Any]:
        # A Logger pickles by name since Python 3.7; saying so keeps the copy obvious.
        return {"logger": self.logger.name, "min_severity": self.min_severity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.logger = logging.getLogger(state["logger"])
        self.min_severity = state["min_severity"]
