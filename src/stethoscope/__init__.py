"""stethoscope: listens to a model while it trains.

Importing this package imports neither torch nor tensorflow: each callback
imports its framework when it is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stethoscope.engine import Monitor
from stethoscope.findings import Finding, Severity, TrainingProblem
from stethoscope.observation import Observation
from stethoscope.recovery import Recovery

if TYPE_CHECKING:
    from stethoscope.callbacks.keras import KerasStethoscope
    from stethoscope.callbacks.lightning import LightningStethoscope

__all__ = [
    "Finding",
    "KerasStethoscope",
    "LightningStethoscope",
    "Monitor",
    "Observation",
    "Recovery",
    "Severity",
    "TrainingProblem",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy so that `import stethoscope` never imports a framework the user has not asked for.
    if name == "LightningStethoscope":
        from stethoscope.callbacks.lightning import LightningStethoscope

        return LightningStethoscope
    if name == "KerasStethoscope":
        from stethoscope.callbacks.keras import KerasStethoscope

        return KerasStethoscope
    raise AttributeError(f"module 'stethoscope' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the lazy callbacks too, so that dir() and tab completion show them
    return sorted(set(globals()) | set(__all__))
