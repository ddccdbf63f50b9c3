"""Where findings go: the console, files, MLflow, TensorBoard, logging, or your own ``Sink``.

Importing this package imports neither mlflow nor tensorboard: each sink imports its
optional dependency when it is made, and says which extra to install if it is missing.

Example:
    >>> from stethoscope.sinks import ConsoleSink, JSONLSink
    >>> sinks = [ConsoleSink(), JSONLSink("runs/findings.jsonl")]  # doctest: +SKIP
"""

from __future__ import annotations

from stethoscope.sinks.base import RunContext, Sink
from stethoscope.sinks.console import ConsoleSink
from stethoscope.sinks.csv import CSVSink
from stethoscope.sinks.jsonl import JSONLSink
from stethoscope.sinks.logging_sink import LoggingSink
from stethoscope.sinks.mlflow import MLflowSink
from stethoscope.sinks.tensorboard import TensorBoardSink

__all__ = [
    "CSVSink",
    "ConsoleSink",
    "JSONLSink",
    "LoggingSink",
    "MLflowSink",
    "RunContext",
    "Sink",
    "TensorBoardSink",
]
