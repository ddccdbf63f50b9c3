"""The adaptive sampler: which detectors run at which step.

Every detector has a base interval (1 = every step). On a healthy run a detector
runs on the steps that are multiples of its base interval. When something looks
wrong, :meth:`AdaptiveSampler.escalate` caps every interval at 1 for a hot window
of ``hot_steps`` steps; after it the cap doubles every ``hot_steps`` steps (2, 4,
8, …) until it reaches every base interval, and the sampler reports its return.
Training starts in that hot state (silently: the detectors calibrate their
baselines on the first steps, where most blow-ups happen). The schedule is a pure
function of the step and of the step at which the last escalation began, so it is
deterministic and survives a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["AdaptiveSampler"]


class AdaptiveSampler:
    """Decides, step by step, which detectors are due.

    Args:
        intervals: Base interval in steps for each detector name (>= 1).
        escalate: Whether suspicion raises the sampling rate. ``False`` keeps every
            detector at its base interval.
        hot_steps: Length of the every-step window after an escalation, and of
            each halving step of the decay that follows.

    Raises:
        ValueError: If an interval or ``hot_steps`` is not a positive integer.

    Example:
        >>> s = AdaptiveSampler({"nonfinite_loss": 1, "exploding_gradients": 16})
        >>> [t for t in range(200, 240) if s.is_due("exploding_gradients", t)]
        [208, 224]
        >>> s.escalate(5, "loss spike")
        'loss spike: running all detectors every step for 32 steps, then back off'
        >>> s.interval("exploding_gradients", 6)
        1
    """

    def __init__(
        self,
        intervals: Mapping[str, int],
        *,
        escalate: bool = True,
        hot_steps: int = 32,
    ) -> None:
        check_intervals(intervals)
        check_hot_steps(hot_steps)
        #: The intervals asked for; ``base`` holds them as an overhead budget stretches them.
        self.declared: dict[str, int] = dict(intervals)
        self.base: dict[str, int] = dict(intervals)
        #: How many times longer than declared the sampled detectors' intervals are now.
        self.stretch = 1
        self.escalation = bool(escalate)
        self.hot_steps = hot_steps
        self._max_base = max(self.base.values(), default=1)
        # due_set(): the distinct base intervals, and the answers seen so far, keyed by which
        # of those intervals divide the step (a handful of keys per run)
        self._intervals = tuple(sorted(set(self.base.values())))
        self._due_cache: dict[tuple[bool, ...], frozenset[str]] = {}
        # Training starts hot: baselines need samples, and early steps are where runs blow
        # up. This calibration window is silent; only escalations caused by suspicion report.
        self.hot_since: int | None = 0 if self.escalation else None
        self.calibrating = self.escalation
        self.escalations = 0

    # -- the schedule ---------------------------------------------------------
    def stretch_to(self, factor: int, longest: int) -> None:
        """Run the sampled detectors (those not every step) ``factor`` times less often
        than declared, none less often than every ``longest`` steps (nor more often than
        declared). ``factor`` is a power of two, so a stretched schedule keeps a subset of
        the declared one's steps; the every-step detectors are never stretched."""
        self.stretch = factor
        self.base = {
            name: every if every == 1 else max(every, min(every * factor, longest))
            for name, every in self.declared.items()
        }
        self._max_base = max(self.base.values(), default=1)
        self._intervals = tuple(sorted(set(self.base.values())))
        self._due_cache.clear()

    def cap(self, step: int) -> int | None:
        """The escalation's cap on every interval at ``step``; None when not escalated."""
        if self.hot_since is None:
            return None
        halvings = max(0, step - self.hot_since) // self.hot_steps
        return 2 ** min(halvings, 62)

    def interval(self, name: str, step: int) -> int:
        """The interval of detector ``name`` at ``step``."""
        return _capped(self.base[name], self.cap(step))

    def intervals_at(self, step: int) -> Intervals:
        """``name -> interval of detector name at step``: :meth:`interval` with the cap
        worked out once, for a question asked of every detector (an epoch's summary)."""
        return Intervals(self.base, self.cap(step))

    def capped(self, base: int, step: int) -> int:
        """An interval of ``base`` steps under the escalation's cap at ``step``."""
        return _capped(base, self.cap(step))

    def is_due(self, name: str, step: int) -> bool:
        """Whether detector ``name`` runs at ``step``."""
        return step % self.interval(name, step) == 0

    def due(self, step: int) -> list[str]:
        """The names of the detectors that run at ``step``, in registration order."""
        cap = self.cap(step)
        return [name for name, base in self.base.items() if step % _capped(base, cap) == 0]

    def due_set(self, step: int) -> frozenset[str]:
        """The names of the detectors that run at ``step`` (what :meth:`due` lists), from a
        cache: the answer depends only on which of the capped intervals divide ``step``."""
        cap = self.cap(step)
        key = tuple(step % _capped(i, cap) == 0 for i in self._intervals)
        hit = self._due_cache.get(key)
        if hit is None:
            hit = self._due_cache[key] = frozenset(self.due(step))
        return hit

    @property
    def hot(self) -> bool:
        return self.hot_since is not None

    # -- feedback ---------------------------------------------------------------
    def escalate(self, step: int, reason: str) -> str | None:
        """Run every detector every step from ``step`` on, for a hot window.

        Returns:
            A message for an ``info`` finding when the rate actually rose; None
            when escalation is off or the sampler was already at every step
            (the window is then extended silently).
        """
        if not self.escalation or self._max_base == 1:
            return None
        already_every_step = self.cap(step) == 1 and not self.calibrating
        self.hot_since = step
        self.calibrating = False
        if already_every_step:
            return None
        self.escalations += 1
        return (
            f"{reason}: running all detectors every step for {self.hot_steps} steps, then back off"
        )

    def tick(self, step: int) -> str | None:
        """Advance to ``step``; returns a message when the sampler returns to base."""
        cap = self.cap(step)
        if cap is None or cap < self._max_base:
            return None
        quiet = step - self.hot_since if self.hot_since is not None else 0
        self.hot_since = None
        if self.calibrating:
            self.calibrating = False
            return None  # the end of the initial calibration window is not news
        return f"no new suspicion for {quiet} steps: detectors back to their base intervals"

    # -- state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "hot_since": self.hot_since,
            "calibrating": self.calibrating,
            "escalations": self.escalations,
            "stretch": self.stretch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.hot_since = state.get("hot_since", 0 if self.escalation else None)
        self.calibrating = bool(state.get("calibrating", self.escalation))
        self.escalations = int(state.get("escalations", 0))

    def __repr__(self) -> str:
        return (
            f"AdaptiveSampler(intervals={self.base!r}, escalate={self.escalation}, "
            f"hot_steps={self.hot_steps})"
        )


class Intervals:
    """Each detector's interval under one schedule (a base and an escalation's cap), by
    name. Two are the same schedule when :meth:`same` says so: what was worked out from
    one (an epoch summary's line on the quiet detectors) holds for the other."""

    __slots__ = ("base", "cap")

    def __init__(self, base: Mapping[str, int], cap: int | None) -> None:
        self.base, self.cap = base, cap  # the sampler's base is replaced, never changed

    def __call__(self, name: str) -> int:
        return _capped(self.base[name], self.cap)

    def same(self, other: Intervals | None) -> bool:
        return other is not None and other.base is self.base and other.cap == self.cap


def _capped(base: int, cap: int | None) -> int:
    """A base interval under the escalation's cap (no cap: the base)."""
    return base if cap is None else min(base, cap)


def check_intervals(intervals: Mapping[str, int]) -> None:
    """Raise ValueError naming an interval that is not a whole number of steps >= 1."""
    for name, every in intervals.items():
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"interval for {name!r} is {every!r}; it must be an integer >= 1 (steps)"
            )


def check_hot_steps(hot_steps: int) -> None:
    """Raise ValueError unless ``hot_steps`` is an integer >= 1."""
    if isinstance(hot_steps, bool) or not isinstance(hot_steps, int) or hot_steps < 1:
        raise ValueError(f"hot_steps={hot_steps!r} must be an integer >= 1")
