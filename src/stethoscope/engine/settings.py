"""The arguments every way of running stethoscope shares (both callbacks and the
:class:`~stethoscope.engine.monitor.Monitor`), checked in one place when they are given:
a bad value is named with the valid choices before training starts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stethoscope.detectors import DETECTORS, Detector, default_detectors
from stethoscope.engine.budget import parse_budget
from stethoscope.engine.policy import Policy, StopOn, parse_policy
from stethoscope.engine.sampler import check_hot_steps, check_intervals
from stethoscope.sinks.base import Sink
from stethoscope.statistics import PLANNED

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    """What to watch and how, parsed (make one with :meth:`of`).

    Args:
        detectors: The detectors, in order, each name once.
        sinks: Where findings go.
        stop_on, raise_on: The policy.
        intervals: Base sampling interval per detector name (every detector's).
        escalate: Whether suspicion raises the sampling rate.
        hot_steps: Length of the every-step window after an escalation.
        overhead_budget: The share of step time the sampled steps may cost, or None.
        repeat_after: Steps before an identical finding is sent to the sinks again.
    """

    detectors: tuple[Detector, ...]
    sinks: tuple[Sink, ...]
    stop_on: Policy
    raise_on: Policy
    intervals: Mapping[str, int]
    escalate: bool
    hot_steps: int
    overhead_budget: float | None
    repeat_after: int

    @classmethod
    def of(
        cls,
        *,
        detectors: Sequence[Detector] | None = None,
        sinks: Sequence[Sink] = (),
        stop_on: StopOn = "error",
        raise_on: StopOn = None,
        intervals: Mapping[str, int] | None = None,
        escalate: bool = True,
        hot_steps: int = 32,
        overhead_budget: float | None = None,
        repeat_after: int = 100,
    ) -> Settings:
        """Check the arguments as a user gave them (see ``Monitor``'s).

        Raises:
            TypeError: A detector or a sink that is not one.
            ValueError: A bad value, named with the valid choices.
        """
        chosen = tuple(detectors) if detectors is not None else tuple(default_detectors())
        for d in chosen:
            if not isinstance(d, Detector):
                raise TypeError(f"detectors must be Detector instances, got {d!r}")
        names = [d.name for d in chosen]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"detectors lists {dupes!r} more than once")
        known = set(DETECTORS) | set(names)
        given = dict(intervals or {})
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValueError(
                f"intervals names {unknown!r}, which are not among the detectors: {names!r}"
            )
        every = {d.name: given.get(d.name, d.base_interval) for d in chosen}
        check_intervals(every)
        check_hot_steps(hot_steps)
        if isinstance(repeat_after, bool) or not isinstance(repeat_after, int) or repeat_after < 0:
            raise ValueError(f"repeat_after={repeat_after!r} must be an integer >= 0 (steps)")
        for s in sinks:
            if not isinstance(s, Sink):
                raise TypeError(f"sinks must be Sink instances, got {s!r}")
            _check_wants(s)
        return cls(
            detectors=chosen,
            sinks=tuple(sinks),
            stop_on=parse_policy(stop_on, argument="stop_on", known=known),
            raise_on=parse_policy(raise_on, argument="raise_on", known=known),
            intervals=every,
            escalate=bool(escalate),
            hot_steps=hot_steps,
            overhead_budget=parse_budget(overhead_budget),
            repeat_after=repeat_after,
        )


def _check_wants(sink: Sink) -> None:
    """A sink may want statistics measured (``Sink.wants``), every so many steps."""
    if not sink.wants:
        return
    unknown = sorted(set(sink.wants) - PLANNED)
    if unknown:
        raise ValueError(
            f"{type(sink).__name__}.wants names {unknown!r}; a sink may want any of "
            f"{sorted(PLANNED)!r}"
        )
    every = sink.wants_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"{type(sink).__name__}.wants_every={every!r} must be an integer >= 1 (steps)"
        )
