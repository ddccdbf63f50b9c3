"""An overhead budget: the sampled detectors run as often as a fraction of training time
allows.

A sampled step (one that measures gradients, weights or activations) costs more than a
quiet one, and how much more depends on the model: a few percent of a 30 ms GPT step, a
third of a 4 ms MLP step. :class:`OverheadBudget` clocks every step as training runs,
estimates what the sampled steps add (each one's time over the median quiet step, with
the step after it, which runs slower from a cache the sampled one filled; the mean of
those, less the highest and lowest eighth, times how many there were), and when that
passes the budget, stretches
the sampled detectors' intervals by a power of two (16 -> 32 -> 64 ...), up to a longest
interval; when the cost falls well under the budget, it gives the steps back. The
every-step sentinels (the loss, its NaNs and spikes) are never stretched, and an
escalation still runs the detectors it raised every step: the budget governs the
healthy steady state only.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["OverheadBudget", "parse_budget"]

#: The longest interval a budget may stretch a sampled detector to, in steps.
LONGEST = 256


def parse_budget(value: float | None) -> float | None:
    """Validate ``overhead_budget``: a fraction of step time in (0, 1), or None (off).

    Raises:
        ValueError: naming the bad value and what is valid.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(
            f"overhead_budget={value!r} is not valid; use a fraction of step time between 0 "
            "and 1 (0.01 is 1%), or None to run the detectors at their declared intervals"
        )
    return float(value)


class OverheadBudget:
    """Measures what sampled steps cost, and says how far to stretch their intervals.

    Args:
        fraction: The budget, a fraction of the time a step takes without sampling.
        shortest: The shortest declared interval of a sampled detector (16 by default):
            a stretch past ``LONGEST / shortest`` buys nothing more.
    """

    #: Training steps between two judgements of the cost (an interval clocked as one may
    #: hold several: Keras' ``steps_per_execution``).
    WINDOW = 256
    #: Quiet intervals whose median is an interval's time without sampling.
    QUIET = 63

    def __init__(self, fraction: float, shortest: int) -> None:
        self.fraction = fraction
        self.stretch = 1
        self.aim(shortest)
        #: The least stretch that leaves quiet intervals between the sampled ones, where
        #: an interval clocks several steps (see :meth:`clock`).
        self.least = 1
        #: The cost measured last, a fraction of a quiet step's time (None: not yet).
        self.measured: float | None = None
        self._quiet: deque[float] = deque(maxlen=self.QUIET)
        self._extra: list[float] = []
        self._steps = 0
        self._intervals = 0
        self._after_sampled = False

    def aim(self, shortest: int) -> None:
        """The shortest declared interval of the sampled detectors that take part is now
        ``shortest`` (a rule that does not apply to the training sits out): the stretch
        may not take it past :data:`LONGEST`."""
        self.shortest = max(shortest, 1)
        self.most = max(1, LONGEST // self.shortest)
        self.stretch = min(self.stretch, self.most)

    def clock(self, seconds: float, *, sampled: bool, steps: int = 1) -> int | None:
        """One steady-state interval's time, ``steps`` training steps clocked together (one
        call of a train function that runs several); returns a new stretch when the cost
        calls for one (the caller applies it), else None. The cost is judged every
        :data:`WINDOW` training steps, however they are clocked, so a run of several steps
        per execution settles as soon as one of a step each.

        An interval that holds a sampled step and the one after it are its cost; the
        others are the baseline. Where an interval holds several steps, the declared
        intervals may leave no other (every 16 steps, in executions of 8: sampled, after,
        sampled, after...), and the cost could never be measured: the stretch is at least
        what puts four intervals between two sampled steps."""
        if steps > 1 and self.least * self.shortest < 4 * steps:
            while self.least * self.shortest < 4 * steps and self.least < self.most:
                self.least *= 2
            if self.stretch < self.least:
                self.stretch = self.least
                return self.stretch
        if sampled:
            if len(self._quiet) >= 8:
                self._extra.append(seconds - statistics.median(self._quiet))
                self._after_sampled = True
        elif self._after_sampled:  # the sampled step's aftermath: part of its cost
            self._extra[-1] += seconds - statistics.median(self._quiet)
            self._after_sampled = False
        else:
            self._quiet.append(seconds)
        self._steps += steps
        self._intervals += 1
        if self._steps < self.WINDOW or len(self._extra) < 4:
            return None
        cost = _trimmed_mean(self._extra) * len(self._extra)
        cost /= self._intervals * statistics.median(self._quiet)
        self.measured = max(cost, 0.0)
        self._extra, self._steps, self._intervals, self._after_sampled = [], 0, 0, False
        wanted = self.stretch
        if cost > self.fraction:  # too dear: stretch by what the excess asks for
            wanted = self.stretch * 2 ** math.ceil(math.log2(cost / self.fraction))
        elif self.stretch > 1 and cost * 2 < self.fraction * 0.8:  # room to spare: halve
            wanted = self.stretch // 2
        wanted = min(max(wanted, self.least), self.most)
        if wanted == self.stretch:
            return None
        # the cost scales with how often steps are sampled: what the new stretch should cost
        self.measured = cost * self.stretch / wanted
        self.stretch = wanted
        return wanted

    def note(self, every: int) -> str:
        """What the budget bought, a clause for the epoch summary: ``every`` is how often
        the gradients are read now."""
        budget = f"{self.fraction:.1%}".replace(".0%", "%")
        if self.measured is None:
            return f"; overhead budget {budget}, not measured yet"
        stretched = f", {self.stretch}x the declared interval" if self.stretch > 1 else ""
        return (
            f"; gradients every {every} steps at {self.measured:.1%} cost "
            f"(overhead budget {budget}{stretched})"
        )


def _trimmed_mean(values: list[float]) -> float:
    """The mean of ``values`` less the highest and lowest eighth: what the sampled steps
    cost on average (they are of several kinds, some measuring more than others, and a
    median falls on the commonest: one step in four twice as dear as the rest is half
    the cost that median says), without a garbage collection or a scheduler's hiccup
    weighing as much as all the rest."""
    ordered = sorted(values)
    cut = len(ordered) // 8
    return statistics.fmean(ordered[cut : len(ordered) - cut])
