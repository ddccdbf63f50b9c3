"""Detectors: framework-free judges of host-side training statistics.

Each detector is small, unit-testable on sequences of numbers, and keeps its
state as a dict of primitives (see :class:`Detector`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stethoscope.detectors.activations import DeadRelu, SaturatedActivation
from stethoscope.detectors.base import Detector
from stethoscope.detectors.chance import LossAtChance
from stethoscope.detectors.data import ClassImbalance, UnnormalizedInput, UnshuffledData
from stethoscope.detectors.distributed import ReplicaDivergence, Straggler
from stethoscope.detectors.frozen import FrozenWeights
from stethoscope.detectors.gradients import ExplodingGradients, VanishingGradients
from stethoscope.detectors.initialization import PoorInitialization
from stethoscope.detectors.logits import LogitsMismatch
from stethoscope.detectors.loss import LossNotDecreasing, LossSpike, UnstableLoss
from stethoscope.detectors.numerics import NonfiniteGradients, NonfiniteLoss, NonfiniteWeights
from stethoscope.detectors.overfitting import Overfitting
from stethoscope.detectors.pipeline import (
    BroadcastLoss,
    CollapsedLearningRate,
    EvalMode,
    LossDividedTwice,
    UnzeroedGradients,
)
from stethoscope.detectors.precision import (
    EpsilonUnderflow,
    Fp8Readiness,
    GradientUnderflow,
    LossScaleCollapse,
    OverflowRisk,
    RoundedUpdates,
)
from stethoscope.detectors.repeated import RepeatedData
from stethoscope.detectors.train_override import TrainOverride
from stethoscope.detectors.unlearned_validation import UnlearnedValidation
from stethoscope.detectors.validation_mode import ValidationMode
from stethoscope.detectors.weights import AllZero, LargeUpdates, SmallUpdates

__all__ = [
    "DETECTORS",
    "AllZero",
    "BroadcastLoss",
    "ClassImbalance",
    "CollapsedLearningRate",
    "DeadRelu",
    "Detector",
    "EpsilonUnderflow",
    "EvalMode",
    "ExplodingGradients",
    "Fp8Readiness",
    "FrozenWeights",
    "GradientUnderflow",
    "LargeUpdates",
    "LogitsMismatch",
    "LossAtChance",
    "LossDividedTwice",
    "LossNotDecreasing",
    "LossScaleCollapse",
    "LossSpike",
    "NonfiniteGradients",
    "NonfiniteLoss",
    "NonfiniteWeights",
    "Overfitting",
    "OverflowRisk",
    "PoorInitialization",
    "RepeatedData",
    "ReplicaDivergence",
    "RoundedUpdates",
    "SaturatedActivation",
    "SmallUpdates",
    "Straggler",
    "TrainOverride",
    "UnlearnedValidation",
    "UnnormalizedInput",
    "UnshuffledData",
    "UnstableLoss",
    "UnzeroedGradients",
    "ValidationMode",
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
        LossAtChance,
        UnstableLoss,
        CollapsedLearningRate,
        Overfitting,
        UnlearnedValidation,
        DeadRelu,
        SaturatedActivation,
        SmallUpdates,
        LargeUpdates,
        FrozenWeights,
        PoorInitialization,
        AllZero,
        ClassImbalance,
        UnnormalizedInput,
        UnshuffledData,
        RepeatedData,
        LogitsMismatch,
        BroadcastLoss,
        EvalMode,
        ValidationMode,
        TrainOverride,
        UnzeroedGradients,
        LossDividedTwice,
        RoundedUpdates,
        GradientUnderflow,
        LossScaleCollapse,
        OverflowRisk,
        EpsilonUnderflow,
        Fp8Readiness,
        ReplicaDivergence,
        Straggler,
    )
}


def default_detectors(**overrides: Mapping[str, Any] | Detector | None) -> list[Detector]:
    """A fresh instance of every detector, with default thresholds unless overridden.

    A detector that is a report a run asks for (``Detector.opt_in``: ``fp8_readiness``)
    is among them only when named, with its arguments or an instance.

    The distributed detectors (``replica_divergence``, ``straggler``) are always among
    them: they judge facts gathered from every rank, so in a single process they never
    run, cost nothing, and are left out of its summary.

    Args:
        **overrides: By detector name: keyword arguments for that detector, an
            instance to use instead, or ``None`` to leave it out.

    Raises:
        ValueError: If a name is not a detector's.

    Example:
        >>> ds = default_detectors(poor_initialization={"num_classes": 10}, dead_relu=None)
        >>> "dead_relu" in [d.name for d in ds]
        False
    """
    unknown = sorted(set(overrides) - set(DETECTORS))
    if unknown:
        raise ValueError(f"unknown detector name(s) {unknown!r}; valid: {sorted(DETECTORS)!r}")
    out: list[Detector] = []
    for name, cls in DETECTORS.items():
        spec = overrides.get(name, None if cls.opt_in else {})
        if spec is None:
            continue
        if isinstance(spec, Detector):
            out.append(spec)
        elif isinstance(spec, Mapping):
            out.append(cls(**spec))
        else:
            raise TypeError(
                f"default_detectors: {name}={spec!r} must be a dict of arguments, a "
                f"{cls.__name__} instance, or None"
            )
    return out
