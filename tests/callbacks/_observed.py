"""What both frameworks' precision tests share: a sink that keeps the observations that
measured a statistic, and the names of the precision detectors."""

from __future__ import annotations

from typing import Any

from stethoscope.testing import CapturingSink

#: The precision detectors that speak by default (fp8_readiness is asked for).
PRECISION = {
    "rounded_updates",
    "gradient_underflow",
    "loss_scale_collapse",
    "overflow_risk",
    "epsilon_underflow",
}


class Observed(CapturingSink):
    """A capturing sink that also keeps every observation that measured ``statistic``."""

    def __init__(self, statistic: str) -> None:
        super().__init__()
        self.statistic, self.observations = statistic, []

    def observe(self, obs: Any, interval: int) -> None:
        if obs.has(self.statistic):
            self.observations.append(obs)


def named(sink: CapturingSink) -> set[str]:
    """The detectors with a warning or an error among what ``sink`` kept."""
    return {f.detector for f in sink.at_least("warning")}
