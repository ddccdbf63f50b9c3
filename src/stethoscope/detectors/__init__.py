"""Detectors: framework-free judges of host-side training statistics.

Each detector is small, unit-testable on sequences of numbers, and keeps its
state as a dict of primitives (see :class:`Detector`).
"""

from __future__ import annotations

from stethoscope.detectors.base import Detector
from stethoscope.detectors.gradients import ExplodingGradients, VanishingGradients
from stethoscope.detectors.loss import LossNotDecreasing, LossSpike, UnstableLoss
from stethoscope.detectors.numerics import NonfiniteGradients, NonfiniteLoss, NonfiniteWeights

__all__ = [
    "DETECTORS",
    "Detector",
    "ExplodingGradients",
    "LossNotDecreasing",
    "LossSpike",
    "NonfiniteGradients",
    "NonfiniteLoss",
    "NonfiniteWeights",
    "UnstableLoss",
    "VanishingGradients",
    "default_detectors",
]

#: Every detector class by its stable name.
DETECTORS: dict[str, type[Detector]] = {
    cls.name: cls
    for cls in (
        NonfiniteLoss,
        NonfiniteGradients,
        NonfiniteWeights,
        ExplodingGradients,
        VanishingGradients,
        LossSpike,
        LossNotDecreasing,
        UnstableLoss,
    )
}


def default_detectors() -> list[Detector]:
    """A fresh instance of every detector, with default thresholds."""
    return [cls() for cls in DETECTORS.values()]
