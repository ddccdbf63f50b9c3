"""What a Keras validation measures besides its loss: its first samples' prints
(``val_prints``, which the probe's traced test step takes) and how far the batch norms'
moving statistics are from their batches' (``val_norms``), each when a detector reads
it, in a single worker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from stethoscope.callbacks._keras.probe import GraphProbe
from stethoscope.callbacks._keras.running_statistics import RunningStatisticsWatch

__all__ = ["ValidationMeasures", "validation_loss"]


def validation_loss(logs: dict | None) -> float | None:
    """The epoch's validation loss from ``fit``'s logs (None: none this epoch)."""
    val = (logs or {}).get("val_loss")
    return float(val) if isinstance(val, (int, float, np.floating)) else None


class ValidationMeasures:
    """The validation's statistics of a fit.

    Args:
        reads: ``statistic -> whether a detector still reads it``.
    """

    def __init__(self, reads: Callable[[str], bool]) -> None:
        self.reads = reads
        self._norms = RunningStatisticsWatch()

    def start(self, model: Any, probe: GraphProbe, step: int, *, single: bool) -> None:
        """A fit's first epoch begins at ``step`` (``single``: in a single worker; the
        workers of a multi-worker run pool their losses alone)."""
        probe.print_validation(single and self.reads("val_prints"))
        self._norms.start(model, step)

    def take(self, probe: GraphProbe, steps: int) -> dict[str, Any]:
        """The validation's measured fields by name (None: not measured), after ``steps``
        steps."""
        wanted = self._norms.watching and self.reads("val_norms")
        norms = self._norms.measure(steps) if wanted else None
        return {"val_prints": probe.validation_prints(), "val_running_statistics": norms}
