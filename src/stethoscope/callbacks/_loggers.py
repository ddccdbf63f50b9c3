"""Findings join the Trainer's own MLflow run and TensorBoard log dir.

A user with ``MLFlowLogger`` and ``MLflowSink()`` expects one run, not two; with
``TensorBoardLogger`` and ``TensorBoardSink()``, one log dir. At train start the
callback lends each such logger's destination to the sinks that name none themselves
(``follows_logger``). Only public logger API is used: ``MLFlowLogger.run_id``,
``MLFlowLogger.experiment`` (an ``MlflowClient``, whose ``tracking_uri`` is public) and
``TensorBoardLogger.log_dir``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from stethoscope.sinks.base import Sink
from stethoscope.sinks.mlflow import MLflowSink
from stethoscope.sinks.tensorboard import TensorBoardSink

__all__ = ["lend_logger_destinations"]


def lend_logger_destinations(sinks: Sequence[Sink], trainer: Any) -> None:
    """Point sinks without a destination at the Trainer's MLflow run / TensorBoard dir.

    Never raises: a logger that cannot say where it writes leaves the sink on its own
    default, with a warning.
    """
    if not trainer.is_global_zero:
        return  # sinks are written from rank zero only, and other ranks' loggers are dummies
    mlflow_sinks = [s for s in sinks if isinstance(s, MLflowSink) and s.follows_logger]
    tb_sinks = [s for s in sinks if isinstance(s, TensorBoardSink) and s.follows_logger]
    if not (mlflow_sinks or tb_sinks):
        return
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger

    for logger in trainer.loggers:
        try:
            if mlflow_sinks and isinstance(logger, MLFlowLogger):
                run_id = logger.run_id  # creates the logger's run if it has none yet
                if run_id:
                    uri = _tracking_uri(logger)
                    for sink in mlflow_sinks:
                        sink.use_run(run_id, tracking_uri=uri)
                mlflow_sinks = []  # the first MLFlowLogger wins, as the first logger does
            elif tb_sinks and isinstance(logger, TensorBoardLogger):
                for sink in tb_sinks:
                    sink.use_log_dir(logger.log_dir)
                tb_sinks = []
        except Exception as exc:  # a sink must never cost the run, nor must lending to one
            warnings.warn(
                f"stethoscope: could not send findings to {type(logger).__name__}'s run "
                f"({exc!r}); the sinks keep their own destination",
                RuntimeWarning,
                stacklevel=2,
            )


def _tracking_uri(logger: Any) -> str | None:
    """The logger's tracking URI through public API: its client's ``tracking_uri``."""
    uri = getattr(logger.experiment, "tracking_uri", None)
    if isinstance(uri, str) and uri:
        return uri
    # MlflowClient before it had the property: the logger sets MLflow's global URI to
    # its own when it makes its client, which ``logger.run_id`` above has done.
    import mlflow

    return mlflow.get_tracking_uri()
