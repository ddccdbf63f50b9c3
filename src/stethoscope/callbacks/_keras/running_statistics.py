"""How far the batch norms' moving statistics are from their batches': the ``val_norms``
statistic in Keras (its definition: ``stethoscope.running_statistics``).

At the fit's first epoch each trainable ``BatchNormalization`` is copied (its moving
mean and variance, read to the host), with the step count. At a validation the error of
each is worked out on the host from the copy and the variables. Every training step of a
``fit`` moves them once; a frozen one (``trainable=False``) normalises by them in
training too, so it cannot lag, and is left out.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from stethoscope.callbacks._keras.layers import leaf_layers
from stethoscope.running_statistics import StatisticsLag, lag_error

__all__ = ["RunningStatisticsWatch"]


class RunningStatisticsWatch:
    """The batch normalizations of a fit, copied at its start."""

    def __init__(self) -> None:
        self._norms: list[tuple[Any, np.ndarray, np.ndarray]] = []
        self._step0 = 0

    @property
    def watching(self) -> bool:
        """Whether the model has a batch normalization whose statistics move."""
        return bool(self._norms)

    def start(self, model: Any, step: int) -> None:
        """Copy the moving statistics that the steps from ``step`` on will move."""
        self._step0 = step
        self._norms = [
            (la, _read(la.moving_mean), _read(la.moving_variance))
            for la in leaf_layers(model)
            if isinstance(la, keras.layers.BatchNormalization)
            and la.trainable
            and getattr(la, "moving_mean", None) is not None
        ]

    def measure(self, step: int) -> StatisticsLag | None:
        """The norm furthest from its batches at ``step`` (the steps taken), or None:
        none, or no step since the start."""
        updates = step - self._step0
        if not self._norms or updates < 1:
            return None
        rows = []
        for la, mean0, var0 in self._norms:
            share = float(la.momentum) ** updates
            mean, var = _read(la.moving_mean), _read(la.moving_variance)
            rows.append((float(lag_error(mean0, var0, mean, var, share, la.epsilon)), share, la))
        error, share, la = max(rows, key=lambda row: row[0])
        return StatisticsLag(la.name, f"momentum={float(la.momentum):g}", error, share, updates)


def _read(variable: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable), dtype=np.float64)
