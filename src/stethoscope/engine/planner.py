"""Which detectors run at a step, and which statistics the adapter measures for them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stethoscope.detectors.base import Detector
from stethoscope.engine.sampler import AdaptiveSampler
from stethoscope.statistics import EVENT, EVERY_STEP, GATHERED, REPLICATED, with_requirements

__all__ = ["QUIET_HORIZON", "SINK_HOT_SHORTENING", "Planner"]

#: How much shorter a sink's cadence gets at most while the sampler is hot. What sinks
#: ask for (a histogram of every element of every parameter) is the costliest reading:
#: every step through a calibration or an escalation doubled the callback's cost there
#: on MobileNetV2, and a picture of the distributions needs no more than a few per hot
#: stretch.
SINK_HOT_SHORTENING = 16

#: The most steps ahead a run of quiet steps (the loss alone measured) is planned at
#: once. Planning a step costs a few microseconds of Python on every step, run from a
#: cache the step's own work has just emptied; a run of quiet steps planned together
#: costs a comparison each. The waiting steps are judged 16 at a time, and judging plans
#: again: planning further ahead would be thrown away. After each change the horizon
#: starts at one step and doubles while nothing changes: where something is judged on
#: every step (a full-batch run validates each epoch), a longer plan would be thrown
#: away every step.
QUIET_HORIZON = 16


class Planner:
    """The detectors due at each step (the sampler's schedule, less those that take no
    part in this run or have finished), and the statistics they need measured.

    ``plan`` runs on every step, so every answer is worked out once per distinct
    schedule (a handful per run) and cached, and the quiet steps ahead are planned
    together, until something they depend on changes (:meth:`changed`).

    Args:
        detectors: Every detector, in order.
        sampler: The schedule.
    """

    def __init__(self, detectors: Sequence[Detector], sampler: AdaptiveSampler) -> None:
        self.detectors = tuple(detectors)
        self.sampler = sampler
        self._all = frozenset(d.name for d in self.detectors)
        self._due_key: tuple[int, int | None] | None = None
        self._due_set: frozenset[str] = frozenset()
        #: Deeper statistics detectors asked for, until an observation carries them.
        self.requested: set[str] = set()
        #: Statistics measured at the next step planned, once (see :meth:`measure_next`),
        #: and that step, once planned.
        self._next: frozenset[str] = frozenset()
        self._next_step: int | None = None
        #: Under sharded parameters, the detectors idle here whose statistics this rank
        #: measures all the same (see :meth:`measure_shards`); None: not sharded.
        self._shard_readers: frozenset[str] | None = None
        #: Statistics another rank judges (rank zero, off it under DDP): a detector taking
        #: part here does not plan them for what it merely wants.
        self.judged_elsewhere: frozenset[str] = frozenset()
        #: The detectors that can finish (see ``Detector.can_finish``): the others never do.
        self.finishers = frozenset(d for d in self.detectors if type(d).can_finish())
        #: The detectors whose own state the plans depend on: they can finish early or
        #: stop wanting a statistic (``Detector.wanting``).
        self._confirmers: dict[str, frozenset[str]] = {}  # see confirmers
        self.plan_changers = self.finishers | {
            d for d in self.detectors if type(d).wanting is not Detector.wanting
        }
        self.sinks_want(frozenset(), 0)
        self.set_idle(frozenset())

    def sinks_want(self, statistics: frozenset[str], every: int) -> None:
        """Measure ``statistics`` every ``every`` steps for the sinks that want them (0:
        never): capped like the detectors' intervals while the sampler is hot, down to
        ``every // SINK_HOT_SHORTENING`` steps."""
        self._sink_wants = with_requirements(statistics) - EVENT - GATHERED
        self._sink_every = every if self._sink_wants else 0
        self._sink_shortest = max(1, every // SINK_HOT_SHORTENING)
        self.changed()

    def measure_shards(self, idle_here: frozenset[str]) -> None:
        """The parameters are sharded: every rank measures the statistics of the whole
        model (:data:`~stethoscope.statistics.REPLICATED`) at the same steps, since the
        ranks combine them in a collective, though only rank zero judges them.

        Those statistics are then planned from what every rank knows alike: the detectors
        due at the step (the sampler's schedule, agreed where the ranks meet), less those
        that take part nowhere, and what they declare they need or want; never from a
        detector's own state (finished, wanting, requests), which only the rank that
        judges it has. ``idle_here``: the detectors idle on this rank alone (rank zero
        judges them), whose statistics it measures all the same."""
        self._shard_readers = frozenset(idle_here)
        self._agreed = {}
        self.changed()

    def somewhere(self, name: str) -> bool:
        """Whether the detector ``name`` takes part on some rank: here, or on rank zero,
        where this rank measures its statistics for it (see :meth:`measure_shards`)."""
        return name not in self.idle or name in (self._shard_readers or ())

    def sink_interval(self, step: int) -> int:
        """How often the sinks' statistics are measured at ``step`` (0: never)."""
        if not self._sink_every:
            return 0
        return max(self._sink_shortest, self.sampler.capped(self._sink_every, step))

    def set_idle(self, names: frozenset[str]) -> None:
        """Detectors that take no part in this run (they are neither run nor planned)."""
        self.idle = frozenset(names)
        sampled = [
            self.sampler.base[d.name]
            for d in self.detectors
            if d.name not in self.idle and self.sampler.base[d.name] > 1
        ]
        self._shortest_sampled = min(sampled, default=1)
        self._runnable: dict[frozenset[str], tuple[Detector, ...]] = {}
        # of each of those, the detectors whose plan can change as they run: they finish
        # early (see Detector.finished) or stop wanting a statistic (Detector.wanting)
        self._changing: dict[tuple[Detector, ...], tuple[Detector, ...]] = {}
        self._plans: dict[tuple, frozenset[str]] = {}
        self._event_readers: dict[tuple[tuple[Detector, ...], frozenset[str]], tuple] = {}
        self._every_step: tuple[dict[str, int], bool] | None = None
        self._loss_readers: tuple[Detector, ...] | None = None
        self._arriving: tuple[Detector, ...] | None = None
        self._agreed: dict[frozenset[str], frozenset[str]] = {}
        self.changed()

    def due(self, step: int) -> frozenset[str]:
        """The names of the detectors the schedule runs at ``step``."""
        # plan() and the judging ask for the same step: compute the schedule once. The key
        # holds the sampler's state too, since an escalation changes the answer.
        key = (step, self.sampler.revision)
        if self._due_key != key:
            self._due_key, self._due_set = key, self.sampler.due_set(step)
        return self._due_set

    def runnable(self, step: int, *, every: bool = False) -> tuple[Detector, ...]:
        """The detectors due at ``step`` (``every``: all of them) that take part in this
        run, in order."""
        due = self._all if every else self.due(step)
        hit = self._runnable.get(due)
        if hit is None:
            hit = tuple(d for d in self.detectors if d.name in due and d.name not in self.idle)
            self._runnable[due] = hit
            self._changing[hit] = tuple(d for d in hit if d in self.plan_changers)
        return hit

    def plan(self, step: int) -> frozenset[str]:
        """The statistics to measure at ``step``: those the detectors due there need or
        want, with what those require, and any deeper statistic requested."""
        if self._next:
            if self._next_step is None:
                self._next_step = step
            if step == self._next_step:
                return self._plan(step) | self._next
            self._next, self._next_step = frozenset(), None  # that step is over
        if step in self._quiet_steps:
            return self._quiet_plan
        planned = self._plan(step)
        if planned <= EVERY_STEP:
            end = step + 1
            horizon = self._horizon
            while end < step + horizon and self._plan(end) == planned:
                end += 1
            self._quiet_steps, self._quiet_plan = range(step, end), planned
            self._horizon = min(2 * horizon, QUIET_HORIZON)
        return planned

    def _agreed_plan(self, step: int) -> frozenset[str]:
        """What every rank measures of the whole model at ``step`` (see
        :meth:`measure_shards`)."""
        due = self.due(step)
        hit = self._agreed.get(due)
        if hit is None:
            nowhere = self.idle - self._shard_readers
            wanted: set[str] = set()
            for d in self.detectors:
                if d.name in due and d.name not in nowhere:
                    wanted |= d.needs | d.wants
            hit = self._agreed[due] = with_requirements(wanted) & REPLICATED
        return hit

    def first_sampled(self, start: int, steps: int) -> tuple[int, frozenset[str]]:
        """The first of ``steps`` steps from ``start`` that measures more than the
        every-step statistics, and its plan; ``(-1, frozenset())`` if none does (an
        execution of several steps measures at most one of them)."""
        for step in range(start, start + steps):
            planned = self.plan(step)
            if not planned <= EVERY_STEP:
                return step, planned
        return -1, frozenset()

    def is_quiet(self, step: int) -> bool:
        """Whether ``step`` measures no more than the every-step statistics (the loss)."""
        return self.plan(step) <= EVERY_STEP

    def _plan(self, step: int) -> frozenset[str]:
        run = self.runnable(step)
        # the answer depends on the schedule, on which detectors have finished and on
        # what the others still want
        key = (run, tuple((d.finished(step), d.wanting(step)) for d in self._changing[run]))
        planned = self._plans.get(key)
        if planned is None:
            wanted: set[str] = set()
            for d in run:
                if not d.finished(step):
                    wanted |= d.needs | (d.wanting(step) - self.judged_elsewhere)
            planned = self._plans[key] = with_requirements(wanted) - EVENT - GATHERED
        if self.requested:
            planned = planned | (with_requirements(self.requested) - EVENT - GATHERED)
        if self._shard_readers is not None:
            planned = (planned - REPLICATED) | self._agreed_plan(step)
        if self._sink_every and step % self.sink_interval(step) == 0:
            planned = planned | self._sink_wants
        return planned

    def with_arrivals(
        self, detectors: tuple[Detector, ...], has: Callable[[str], bool]
    ) -> tuple[Detector, ...]:
        """``detectors`` with those taking part that run on the arrival of a statistic an
        observation carries (``has``; see ``Detector.runs_on``), in order."""
        arriving = self._arriving
        if arriving is None:
            arriving = self._arriving = tuple(
                d for d in self.detectors if d.runs_on and d.name not in self.idle
            )
        extra = [d for d in arriving if d not in detectors and any(map(has, d.runs_on))]
        if not extra:
            return detectors
        chosen = {*detectors, *extra}
        return tuple(d for d in self.detectors if d in chosen)

    def event_readers(
        self, detectors: tuple[Detector, ...], carried: frozenset[str]
    ) -> tuple[Detector, ...]:
        """Of ``detectors`` and those that run on an arrival (see :meth:`with_arrivals`),
        the ones an event's observation carrying just the statistics ``carried`` (a
        validation's) can run on: it carries all they need, or what they run on. The
        others would find it lacks what they need. Worked out once per schedule."""
        key = (detectors, carried)
        hit = self._event_readers.get(key)
        if hit is None:
            every = self.with_arrivals(detectors, carried.__contains__)
            hit = tuple(d for d in every if d.needs <= carried or not d.runs_on.isdisjoint(carried))
            self._event_readers[key] = hit
        return hit

    def confirmers(self, suspect: Detector) -> frozenset[str] | None:
        """The detectors that can confirm or clear a suspicion of ``suspect``'s, which a
        focused escalation runs every step: those that read nothing but what it reads
        (what it needs or wants, and the every-step statistics), it among them. They cost
        the next steps only what it costs; a gradient norm that jumped is confirmed by the
        gradient norms that follow, not by the activations. None where ``suspect`` reads
        the every-step statistics alone (a loss that jumped): its cause may lie in any
        statistic, so every detector is raised."""
        if suspect.needs <= EVERY_STEP:
            return None
        hit = self._confirmers.get(suspect.name)
        if hit is None:
            reads = suspect.needs | suspect.wants | EVERY_STEP
            hit = frozenset(d.name for d in self.detectors if d.needs <= reads)
            self._confirmers[suspect.name] = hit
        return hit

    def loss_readers(self) -> tuple[Detector, ...]:
        """The detectors that judge a quiet step (one that measures the loss alone): those
        taking part that need nothing but the loss, at whatever interval, in order."""
        readers = self._loss_readers
        if readers is None:
            readers = self._loss_readers = tuple(
                d for d in self.detectors if d.name not in self.idle and d.needs <= EVERY_STEP
            )
        return readers

    def loss_readers_run_every_step(self) -> bool:
        """Whether every one of the :meth:`loss_readers` runs on every step."""
        base = self.sampler.base  # replaced when stretched, never changed: asked once
        if self._every_step is None or self._every_step[0] is not base:
            self._every_step = base, all(base[d.name] == 1 for d in self.loss_readers())
        return self._every_step[1]

    def quiet_detectors(self, step: int) -> list[Detector]:
        """The :meth:`loss_readers` not finished at ``step``."""
        return [d for d in self.loss_readers() if not d.finished(step)]

    def sampled_interval(self, step: int) -> int:
        """How often the sampled detectors (those not run every step) run at ``step``: the
        shortest of their intervals there (1 while a window of the sampler's holds them
        every step)."""
        return self.sampler.capped(self._shortest_sampled, step, focused=True)

    def fulfilled(self, has: Callable[[str], bool]) -> None:
        """Forget the requests that an observation (``has``) carried."""
        if self.requested:
            self.requested -= {s for s in self.requested if has(s)}

    def measure_next(self, statistics: frozenset[str]) -> None:
        """Measure ``statistics`` at the next step planned, whatever the schedule, and
        only there: an epoch's first step, say, which a rule comparing epochs reads. Unlike
        a request, it is not kept until an observation carries it: a run whose batches hold
        no such thing costs nothing on the steps after."""
        self._next = with_requirements(statistics) - EVENT - GATHERED
        self._next_step = None
        self.changed()

    def forget(self) -> None:
        """A fresh run: no cached schedule, no pending request."""
        self._due_key = None
        self.requested.clear()
        self._next, self._next_step = frozenset(), None
        self.changed()

    def changed(self) -> None:
        """What the plans ahead depend on may have changed: a detector judged a step (it
        may have finished, stopped wanting a statistic or asked for one), or the sampler
        escalated. The quiet steps ahead are planned again."""
        self._quiet_steps = range(0)
        self._quiet_plan = EVERY_STEP
        self._horizon = 1
