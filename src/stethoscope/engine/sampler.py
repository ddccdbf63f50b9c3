"""The adaptive sampler: which detectors run at which step.

Every detector has a base interval (1 = every step). On a healthy run a detector
runs on the steps that are multiples of its base interval. When something looks
wrong, :meth:`AdaptiveSampler.escalate` caps intervals at 1 for a hot window of
``hot_steps`` steps; after it the cap doubles every ``hot_steps`` steps (2, 4, 8, …)
until it reaches the base intervals, and the sampler reports its return.

There are two windows. The *whole* one caps every detector's interval: training
starts in it (silently: the detectors calibrate their baselines on the first steps,
where most blow-ups happen), and a warning opens it again. A *focused* one caps only
some detectors' intervals: a suspicion opens it for the detectors that can confirm or
clear it (the caller names them), so that a gradient norm that jumped has the next
steps' gradient norms looked at, not every statistic of the model. A detector in both
windows runs at the shorter of their intervals.

The schedule is a pure function of the step, of the steps at which the windows began
and of the focused window's detectors, so it is deterministic and survives a
checkpoint.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
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

        A suspicion raises only the detectors it names:

        >>> s = AdaptiveSampler({"exploding_gradients": 16, "dead_relu": 16})
        >>> s.tick(300) is None  # the calibration's end is silent
        True
        >>> s.escalate(300, "gradient norm 40x", ["exploding_gradients"])
        'gradient norm 40x: running exploding_gradients every step for 32 steps, then back off'
        >>> s.interval("exploding_gradients", 301), s.interval("dead_relu", 301)
        (1, 16)
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
        self._due_cache: dict[tuple, frozenset[str]] = {}
        # Training starts hot: baselines need samples, and early steps are where runs blow
        # up. This calibration window is silent; only escalations caused by suspicion report.
        self.hot_since: int | None = 0 if self.escalation else None
        self.calibrating = self.escalation
        #: The focused window: the step it began (None: none open), and its detectors.
        self.focus_since: int | None = None
        self.focus: frozenset[str] = frozenset()
        self._focus_intervals: tuple[int, ...] = ()
        self._focus_longest = 1
        self.escalations = 0
        #: Where an escalation was reported since the sampler was last at base, the step
        #: of the last escalation since (its return is then reported too); else None.
        self.told: int | None = None
        #: Counts the changes of either window: a schedule worked out at one count holds
        #: until the next.
        self.revision = 0

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
        self._set_focus(self.focus)
        self.revision += 1

    def cap(self, step: int) -> int | None:
        """The whole window's cap on every interval at ``step``; None when not open."""
        return _window_cap(self.hot_since, step, self.hot_steps)

    def focus_cap(self, step: int) -> int | None:
        """The focused window's cap on its detectors' intervals at ``step``; None when not
        open."""
        return _window_cap(self.focus_since, step, self.hot_steps)

    def interval(self, name: str, step: int) -> int:
        """The interval of detector ``name`` at ``step``."""
        cap = self.cap(step)
        if name in self.focus:
            cap = _least(cap, self.focus_cap(step))
        return _capped(self.base[name], cap)

    def intervals_at(self, step: int) -> Intervals:
        """``name -> interval of detector name at step``: :meth:`interval` with the caps
        worked out once, for a question asked of every detector (an epoch's summary)."""
        return Intervals(self.base, self.cap(step), self.focus, self.focus_cap(step))

    def capped(self, base: int, step: int, *, focused: bool = False) -> int:
        """An interval of ``base`` steps under the whole window's cap at ``step`` (and
        ``focused``: the focused window's too, where one is open)."""
        cap = self.cap(step)
        if focused and self.focus:
            cap = _least(cap, self.focus_cap(step))
        return _capped(base, cap)

    def is_due(self, name: str, step: int) -> bool:
        """Whether detector ``name`` runs at ``step``."""
        return step % self.interval(name, step) == 0

    def due(self, step: int) -> list[str]:
        """The names of the detectors that run at ``step``, in registration order."""
        cap = self.cap(step)
        if not self.focus:
            return [name for name, base in self.base.items() if step % _capped(base, cap) == 0]
        focus, near = self.focus, _least(cap, self.focus_cap(step))
        return [
            name
            for name, base in self.base.items()
            if step % _capped(base, near if name in focus else cap) == 0
        ]

    def due_set(self, step: int) -> frozenset[str]:
        """The names of the detectors that run at ``step`` (what :meth:`due` lists), from a
        cache: the answer depends only on which of the capped intervals divide ``step``
        (the cache is emptied when the focused window's detectors change)."""
        cap = self.cap(step)
        key: tuple = tuple(step % _capped(i, cap) == 0 for i in self._intervals)
        if self.focus:
            near = _least(cap, self.focus_cap(step))
            key += tuple(step % _capped(i, near) == 0 for i in self._focus_intervals)
        hit = self._due_cache.get(key)
        if hit is None:
            hit = self._due_cache[key] = frozenset(self.due(step))
        return hit

    @property
    def hot(self) -> bool:
        """Whether a window is open (the whole one or a focused one)."""
        return self.hot_since is not None or self.focus_since is not None

    # -- feedback ---------------------------------------------------------------
    def escalate(
        self, step: int, reason: str, detectors: Collection[str] | None = None
    ) -> str | None:
        """Run detectors every step from ``step`` on, for a hot window: every detector
        (``detectors`` None), or the ``detectors`` named, in the focused window (one
        already open takes them in and begins again).

        Returns:
            A message for an ``info`` finding when the rate actually rose; None
            when escalation is off or the detectors were already at every step
            (the window is then extended silently).
        """
        if not self.escalation or self._max_base == 1:
            return None
        if detectors is None:
            already_every_step = self.cap(step) == 1 and not self.calibrating
            self.hot_since = step
            self.calibrating = False
            self._set_focus(frozenset())  # the whole window holds them all, from later on
            if not self._opened(step, news=not already_every_step):
                return None
            return (
                f"{reason}: running all detectors every step for {self.hot_steps} steps, "
                "then back off"
            )
        raised = frozenset(n for n in detectors if self.base.get(n, 1) > 1)
        if not raised:  # they run every step anyway
            return None
        # news unless a suspicion's window (not the calibration's) already runs them all
        # every step
        cap = None if self.calibrating else self.cap(step)
        if self.focus:
            cap = _least(cap, self.focus_cap(step)) if raised <= self.focus else cap
        news = cap != 1
        self.focus_since = step
        self._set_focus(self.focus | raised)
        if not self._opened(step, news=news):
            return None
        named = [n for n in self.base if n in raised]  # in registration order
        return (
            f"{reason}: running {_listed(named)} every step for {self.hot_steps} steps, "
            "then back off"
        )

    def tick(self, step: int) -> str | None:
        """Advance to ``step``; returns a message when the sampler returns to base after
        an escalation it reported (the end of the calibration window alone is not news)."""
        closed = False
        cap = self.cap(step)
        if cap is not None and cap >= self._max_base:
            self.hot_since, self.calibrating, closed = None, False, True
        cap = self.focus_cap(step)
        if cap is not None and cap >= self._focus_longest:
            self.focus_since, closed = None, True
            self._set_focus(frozenset())
        if not closed:
            return None
        self.revision += 1
        if self.hot or self.told is None:
            return None
        quiet, self.told = step - self.told, None
        return f"no new suspicion for {quiet} steps: detectors back to their base intervals"

    def _opened(self, step: int, *, news: bool) -> bool:
        """A window was opened or extended at ``step``: count it if it is ``news`` (the
        rate rose), and keep the step its return counts from where an escalation was
        reported. Returns ``news``."""
        self.revision += 1
        if news:
            self.escalations += 1
        if news or self.told is not None:
            self.told = step
        return news

    def _set_focus(self, names: frozenset[str]) -> None:
        self.focus = names
        bases = {self.base[n] for n in names if n in self.base}
        self._focus_intervals = tuple(sorted(bases))
        self._focus_longest = max(bases, default=1)
        self._due_cache.clear()

    # -- state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "hot_since": self.hot_since,
            "calibrating": self.calibrating,
            "focus_since": self.focus_since,
            "focus": sorted(self.focus),
            "escalations": self.escalations,
            "told": self.told,
            "stretch": self.stretch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.hot_since = state.get("hot_since", 0 if self.escalation else None)
        self.calibrating = bool(state.get("calibrating", self.escalation))
        self.focus_since = state.get("focus_since")
        focus = frozenset(state.get("focus", ())) if self.focus_since is not None else frozenset()
        self._set_focus(focus)
        self.escalations = int(state.get("escalations", 0))
        # a checkpoint from before the focused window: an escalation out of calibration
        # was reported, at the window's start
        if "told" in state:
            self.told = state["told"]
        else:
            self.told = self.hot_since if not self.calibrating else None
        self.revision += 1

    def __repr__(self) -> str:
        return (
            f"AdaptiveSampler(intervals={self.base!r}, escalate={self.escalation}, "
            f"hot_steps={self.hot_steps})"
        )


class Intervals:
    """Each detector's interval under one schedule (a base and the windows' caps), by
    name. Two are the same schedule when :meth:`same` says so: what was worked out from
    one (an epoch summary's line on the quiet detectors) holds for the other."""

    __slots__ = ("base", "cap", "focus", "focus_cap")

    def __init__(
        self,
        base: Mapping[str, int],
        cap: int | None,
        focus: frozenset[str] = frozenset(),
        focus_cap: int | None = None,
    ) -> None:
        self.base, self.cap = base, cap  # the sampler's base is replaced, never changed
        self.focus, self.focus_cap = focus, focus_cap

    def __call__(self, name: str) -> int:
        cap = _least(self.cap, self.focus_cap) if name in self.focus else self.cap
        return _capped(self.base[name], cap)

    def same(self, other: Intervals | None) -> bool:
        return (
            other is not None
            and other.base is self.base
            and other.cap == self.cap
            and other.focus == self.focus
            and other.focus_cap == self.focus_cap
        )


def _window_cap(since: int | None, step: int, hot_steps: int) -> int | None:
    """The cap at ``step`` of a window that began at ``since`` (None: not open): 1 for
    ``hot_steps`` steps, then doubling every ``hot_steps`` steps."""
    if since is None:
        return None
    halvings = max(0, step - since) // hot_steps
    return 2 ** min(halvings, 62)


def _least(a: int | None, b: int | None) -> int | None:
    """The tighter of two caps (None: no cap)."""
    if a is None:
        return b
    return a if b is None else min(a, b)


def _capped(base: int, cap: int | None) -> int:
    """A base interval under a cap (no cap: the base)."""
    return base if cap is None else min(base, cap)


def _listed(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``; past four, the first three and a count."""
    if len(names) > 4:
        return f"{', '.join(names[:3])} and {len(names) - 3} more detectors"
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


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
