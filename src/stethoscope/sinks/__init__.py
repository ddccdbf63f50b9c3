"""Where findings go: the console, CSV and JSON Lines files, or your own ``Sink``.

Example:
    >>> from stethoscope.sinks import ConsoleSink, JSONLSink
    >>> sinks = [ConsoleSink(), JSONLSink("runs/findings.jsonl")]  # doctest: +SKIP
"""

from __future__ import annotations

from stethoscope.sinks.base import Sink
from stethoscope.sinks.console import ConsoleSink
from stethoscope.sinks.csv import CSVSink
from stethoscope.sinks.jsonl import JSONLSink

# MLflowSink and TensorBoardSink come in a later issue (they import their optional
# dependency inside the class, so importing this package stays light).

__all__ = ["CSVSink", "ConsoleSink", "JSONLSink", "Sink"]
