"""The quiet steps' losses, judged a few at a time instead of one by one.

On nearly every step the monitor receives only a loss, and the detectors due then (the
loss sentinels) find nothing. Judging it at once costs the most Python of any step: the
schedule, every loss detector and the ledger, each run from a cache that the step's own
work has just emptied. A loss that none of those detectors could act on at once (it is
finite, and below every bar that would stop the run, skip a step or raise a suspicion)
can wait: :class:`WaitingLosses` keeps it, and the monitor judges the waiting steps at
the next step that cannot wait, or after ``BATCH`` steps, together, with the outcome of
judging them one by one (:meth:`stethoscope.engine.judge.Judge.judge`).

Nothing is lost or reordered: every detector sees every observation, in order, and each
finding keeps its step. What waits is the report of a finding no bar asked for at once
(``loss_not_decreasing``'s, say), by at most ``BATCH - 1`` steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from stethoscope.detectors.base import Detector
from stethoscope.engine.planner import Planner

__all__ = ["WaitingLosses"]


class WaitingLosses:
    """Quiet steps' losses, waiting to be judged.

    ``bar`` is the loss below which a step may wait: the lowest of the due detectors'
    :meth:`~stethoscope.detectors.base.Detector.waits_below`, worked out again after
    every step whose loss was judged at once (``-inf``: nothing waits). It holds for the
    ``BATCH`` steps after it was worked out, judged or not in between (a validation or an
    epoch's end judges the waiting steps early): ``room`` counts how many of those are
    left. A waiting step is kept as its numbers alone, ``(step, epoch, loss, lr)``, and
    becomes an :class:`Observation` when judged.
    """

    #: The most steps that wait before they are judged.
    BATCH = 16

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float, float | None]] = []
        self.bar = -math.inf
        self.room = 0

    def keep(
        self, step: int, epoch: int, loss: float | None, lr: float | None, planner: Planner
    ) -> bool:
        """Keep a step's loss for later, if it may wait: a finite loss below the bar
        (anything else, a NaN included, fails the comparison) on a quiet step, and room
        for the bar. False: judge it now, after the waiting ones."""
        if loss is not None and loss < self.bar and self.room > 0 and planner.is_quiet(step):
            self.steps.append((step, epoch, loss, lr))
            self.room -= 1
            return True
        return False

    def take(self) -> list[tuple[int, int, float, float | None]]:
        """The waiting steps' numbers, oldest first; none wait after."""
        steps, self.steps = self.steps, []
        return steps

    def rebar(self, detectors: Iterable[Detector] | None) -> None:
        """Work out the bar from the detectors that judge quiet steps (None: nothing may
        wait, as in a distributed run or under a recovery ladder, which act every step)."""
        self.room = self.BATCH - 1
        if detectors is None:
            self.bar = -math.inf
            return
        bar = math.inf
        for d in detectors:
            below = d.waits_below(self.BATCH)
            if below is None:
                bar = -math.inf
                break
            bar = min(bar, below)
        self.bar = bar
