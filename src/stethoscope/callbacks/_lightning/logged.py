"""What ``log_stats=True`` sends to the Trainer's own loggers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stethoscope.observation import Observation, global_norm

__all__ = ["headline", "log_metrics"]


def headline(obs: Observation, interval: Callable[[], float]) -> dict[str, float]:
    """The headline statistics of a sampled step: the global gradient norm, the sampling
    interval (``interval()``), and the global update ratio when the updates were measured."""
    metrics = {
        "stethoscope/grad_norm": global_norm(obs.grad_norm),
        "stethoscope/interval": interval(),
    }
    if obs.update_norm is not None and obs.weight_norm is not None:
        w = global_norm(obs.weight_norm)
        metrics["stethoscope/update_ratio"] = global_norm(obs.update_norm) / w if w else 0.0
    return metrics


def log_metrics(trainer: Any, metrics: dict[str, float], step: int | None = None) -> None:
    """Send ``metrics`` to every logger of the Trainer, from rank zero."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step if step is None else step)
