"""What runs when, at what cost: the sampler (how often each detector runs), the planner
(what a step measures for the detectors due there and for the sinks) and the overhead
budget (how far the sampled detectors' intervals stretch to stay within it)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from stethoscope.detectors.base import Detector
from stethoscope.engine.budget import LONGEST, OverheadBudget
from stethoscope.engine.planner import Planner
from stethoscope.engine.sampler import AdaptiveSampler
from stethoscope.engine.settings import Settings
from stethoscope.sinks.base import Sink
from stethoscope.statistics import GATHERED, judged_elsewhere

__all__ = ["Schedule"]


class Schedule:
    """The schedule of one monitor's detectors.

    Args:
        settings: The detectors, their intervals, the escalation, the sinks (for the
            statistics they want measured, ``Sink.wants``) and the overhead budget.
    """

    def __init__(self, settings: Settings) -> None:
        self.detectors = settings.detectors
        self._game = False  # whether the training was found a game (see play_a_game)
        self.sampler = AdaptiveSampler(
            settings.intervals, escalate=settings.escalate, hot_steps=settings.hot_steps
        )
        #: Which detectors run at each step, and what they need measured.
        self.planner = Planner(self.detectors, self.sampler)
        self._sink_wants = _sink_wants(settings.sinks)
        self._budget_fraction = settings.overhead_budget
        #: Keeps the sampled steps' cost within the budget (None: no budget).
        self.budget: OverheadBudget | None = None
        self._not_applying: frozenset[str] = frozenset()  # see not_applying
        #: Idle on this rank alone, rank zero judging them (see take_part), and whether
        #: this rank measures their statistics all the same (sharded parameters).
        self._rank_idle: frozenset[str] = frozenset()
        self._measures_for_rank_zero = False
        self._sat_out: frozenset[str] = frozenset()  # see sit_out
        #: The step each event's statistics were last measured at (see _event_due).
        self._events: dict[str, int] = {}
        # of those, the readers of each event's statistic (see reads), by statistic
        self._readers: dict[str, tuple[list, list]] = {}
        self._in_run: tuple[frozenset[str], list[Detector]] | None = None  # see in_run
        self._shortest: tuple[dict[str, int], int] | None = None  # see budget_note
        # until a training starts, the setup is the default one's (float32, say)
        self.not_applying(frozenset(d.name for d in self.detectors if not d.applies()))

    @property
    def sinks_want(self) -> frozenset[str]:
        """The statistics the sinks want measured, beside the detectors'."""
        return self._sink_wants[0]

    def take_part(
        self, *, rank: int, world_size: int, replicated: bool, sharded: bool = False
    ) -> None:
        """Plan for ``rank`` of ``world_size`` (see ``Monitor.distribute``): in a single
        process the detectors that compare ranks do not run; off rank zero of a replicated
        run, those that judge only what every rank holds alike do not either (rank zero
        judges them). Only rank zero measures what the sinks want (it alone writes), and
        only a single process keeps a budget: the ranks of a distributed run share one
        schedule, which their own clocks would pull apart.

        ``sharded``: the ranks combine those statistics from their shards, so every rank
        measures them where rank zero does, for the sinks too (see
        ``Planner.measure_shards``)."""
        # what every rank holds alike is rank zero's to judge, even where a detector
        # judging this rank's own data here wants it too (overflow_risk: the gradients)
        elsewhere = judged_elsewhere(rank=rank, world_size=world_size, replicated=replicated)
        if world_size == 1:
            idle = {d.name for d in self.detectors if d.needs & GATHERED}
        elif elsewhere:
            idle = {d.name for d in self.detectors if d.needs <= elsewhere}
        else:
            idle = set()
        self._rank_idle, self._sat_out = frozenset(idle), frozenset()
        self.planner.judged_elsewhere = elsewhere
        self._measures_for_rank_zero = sharded and world_size > 1
        self.planner.set_idle(self._rank_idle | self._not_applying)
        self._measure_for_rank_zero()
        writes = rank == 0 or (sharded and world_size > 1)
        self.planner.sinks_want(*(self._sink_wants if writes else (frozenset(), 0)))
        fraction = self._budget_fraction if world_size == 1 else None
        self.budget = _budget(fraction, self.sampler, self._shortest_sampled())

    def sit_out(self, names: frozenset[str]) -> None:
        """Detectors that take no part in this run from now on."""
        self._sat_out |= names
        self.planner.set_idle(self.planner.idle | names)
        self._measure_for_rank_zero()

    def cannot_measure(self, statistics: frozenset[str], why: str, *, warn: bool) -> list[str]:
        """The adapter cannot measure ``statistics`` in this run (``why``: a few words for
        the user): the detectors taking part that need any of them sit out, and ``warn``
        says so once. Returns their names. Under sharded parameters, every rank must make
        the same call: those detectors then take part nowhere, and no rank measures their
        statistics any more (the ranks plan them alike)."""
        off = sorted(
            d.name
            for d in self.detectors
            if not d.needs.isdisjoint(statistics) and self.planner.somewhere(d.name)
        )
        if off:
            self.sit_out(frozenset(off))
            if warn:
                warnings.warn(
                    f"stethoscope: {', '.join(off)} cannot judge this run ({why}), so "
                    f"{'it is' if len(off) == 1 else 'they are'} off; the other detectors "
                    "judge it as usual",
                    RuntimeWarning,
                    stacklevel=4,
                )
        return off

    def starting(self, *, warn: bool) -> None:
        """Training starts, every detector holding its setup: the rules that do not apply
        to it (precision rules in float32) take no part, never run, planned or listed as
        quiet, and ``warn`` tells the user of those that say why; no game is known yet."""
        off = [d for d in self.detectors if not d.applies()]
        self.not_applying(frozenset(d.name for d in off))
        if warn:
            warn_not_applying(off)
        self._game = False

    def play_a_game(self, *, warn: bool) -> bool:
        """The training is a game (several optimizers stepping in turn, each over its own
        players, as in a GAN): the detectors that assume the loss should fall take no part
        from now on, and ``warn`` says so once. Whether it was news."""
        if self._game:
            return False
        self._game = True
        for d in self.detectors:  # every detector's advice knows it
            d.setup = dataclasses.replace(d.setup, adversarial=True)
        off = sorted(d.name for d in self.detectors if d.assumes_falling_loss)
        if off:
            self.sit_out(frozenset(off))
            if warn:
                warn_sitting_out(off)
        return True

    def learn_setup(self, **found: Any) -> None:
        """A step showed more of the training's setup (``TrainingSetup``'s fields, by
        name) than its start: every detector's setup says so, and the rules that apply
        to it now take part (see :meth:`not_applying`)."""
        for d in self.detectors:
            d.setup = dataclasses.replace(d.setup, **found)
        self.not_applying(frozenset(d.name for d in self.detectors if not d.applies()))

    def not_applying(self, names: frozenset[str]) -> None:
        """The detectors whose rule does not apply to the training starting now (see
        ``Detector.applies``): they sit out, and those that sat out only for the last
        training (a second fit in another precision) take part again."""
        back = self._not_applying - names
        self._not_applying = names
        # those idle on this rank alone stay so: rank zero judges them
        self.planner.set_idle((self.planner.idle - back) | names | self._rank_idle)
        self._measure_for_rank_zero()
        if self.budget is not None:
            self.budget.aim(self._shortest_sampled())

    def _measure_for_rank_zero(self) -> None:
        """Under sharded parameters, measure the statistics of the detectors idle on this
        rank alone that take part on rank zero (see ``Planner.measure_shards``)."""
        if self._measures_for_rank_zero:
            self.planner.measure_shards(self._rank_idle - self._not_applying - self._sat_out)

    def new_stage(self, step: int) -> None:
        """A new stage of training began at ``step``: an optimizer that had not stepped
        took over from those that stepped the batch before (layer-wise training's next
        layer). The loss a step returns from then on is another objective's, so the
        detectors that judge the loss alone start again from it, as at a run's start: its
        first value is the new objective's start, not a spike of the old one's."""
        for d in self.planner.loss_readers():
            d.reset()
        self.planner.changed()

    def _shortest_sampled(self) -> int:
        """The shortest declared interval of a sampled detector that takes part."""
        idle = self.planner.idle
        return min(
            (n for d, n in self.sampler.declared.items() if n > 1 and d not in idle), default=16
        )

    def open_epoch(self, step: int, *, resumed: bool = False) -> None:
        """Measure at ``step``, the next one (an epoch's or a run's first), what the
        detectors taking part read there (see ``Detector.at_epoch_start``), when it is due
        (see :meth:`_event_due`; a resumed run's first step always is)."""
        readers = self._readers_at(step, "epoch start")
        if readers and (self._event_due("epoch start", readers, step) or resumed):
            self.planner.measure_next(frozenset().union(*(d.at_epoch_start for d in readers)))

    def reads(self, statistic: str, step: int) -> bool:
        """Whether to measure ``statistic`` of an event at ``step`` (a validation's): a
        detector taking part needs it or runs on its arrival (``Detector.runs_on``), and
        it is due (see :meth:`_event_due`)."""
        readers = self._readers_at(step, statistic)
        return bool(readers) and self._event_due(statistic, readers, step)

    def _readers_at(self, step: int, event: str) -> list[Detector]:
        """The detectors taking part at ``step`` (neither idle in the run nor finished
        there; one that finishes later in the step still counts) that read what is
        measured at ``event``: an epoch's start (``Detector.at_epoch_start``), or a
        statistic they need or run on the arrival of. Those of the run are worked out once
        (an epoch's end asks four times, every step in a full-batch run); which of them
        have finished, at each step."""
        part = self.in_run()
        cached = self._readers.get(event)
        if cached is None or cached[0] is not part:
            if event == "epoch start":
                readers = [d for d in part if d.at_epoch_start]
            else:
                readers = [d for d in part if event in d.needs or event in d.runs_on]
            cached = self._readers[event] = part, readers
        finishers = self.planner.finishers
        readers = cached[1]
        if not finishers.isdisjoint(readers):
            readers = [d for d in readers if not (d in finishers and d.finished(step))]
        return readers

    def in_run(self) -> list[Detector]:
        """The detectors that take part in this run (not idle), in order: worked out again
        only when that changes."""
        idle = self.planner.idle
        if self._in_run is None or self._in_run[0] is not idle:
            self._in_run = idle, [d for d in self.detectors if d.name not in idle]
        return self._in_run[1]

    def _event_due(self, event: str, readers: Sequence[Detector], step: int) -> bool:
        """Whether what ``readers`` measure at an event (an epoch's start, a validation)
        is due at ``step``: the first time, and then once their interval at ``step`` has
        passed since it was last measured (escalated: every time; stretched by the
        budget: as rarely as their steps). Epochs and validations come as often as a run
        makes them (every step, in full-batch training): measured at each, they would
        escape the sampler and the budget."""
        every = min(self.sampler.interval(d.name, step) for d in readers)
        last = self._events.get(event)
        if last is not None and 0 < step - last < every:  # asked again at a step: the same
            return False
        self._events[event] = step
        return True

    def idle(self, name: str) -> bool:
        """Whether the detector ``name`` takes no part in this run."""
        return name in self.planner.idle

    def clock(self, seconds: float, *, sampled: bool, steps: int = 1) -> None:
        """The budget's measure of the last step (see ``Monitor.clock``); off while the
        sampler is hot: the budget governs the healthy steady state."""
        if self.budget is None or self.sampler.hot:
            return
        stretch = self.budget.clock(seconds, sampled=sampled, steps=steps)
        if stretch is not None:
            self.stretch(stretch)

    def stretch(self, factor: int) -> None:
        """Run the sampled detectors ``factor`` times less often than declared."""
        if factor == self.sampler.stretch:
            return
        self.sampler.stretch_to(factor, LONGEST)
        if self.budget is not None:
            self.budget.stretch = factor
        self.planner.set_idle(self.planner.idle)  # its caches follow the schedule

    def budget_note(self) -> str:
        """What the budget did, for the epoch's summary ("" without a budget)."""
        if self.budget is None:
            return ""
        base = self.sampler.base  # replaced when stretched, never changed: worked out once
        if self._shortest is None or self._shortest[0] is not base:
            self._shortest = base, min((b for b in base.values() if b > 1), default=1)
        return self.budget.note(self._shortest[1])

    def forget(self) -> None:
        """A fresh run: the declared schedule, nothing planned ahead."""
        self.sampler.load_state_dict({})
        self.stretch(1)
        self.planner.forget()
        self._events.clear()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the sampler's schedule (and its stretch) from a checkpoint."""
        self.sampler.load_state_dict(state)
        self.stretch(int(state.get("stretch", 1)))

    def describe(self) -> dict[str, Any]:
        """The escalation's settings, for the run's record."""
        return {"escalate": self.sampler.escalation, "hot_steps": self.sampler.hot_steps}


def _sink_wants(sinks: Sequence[Sink]) -> tuple[frozenset[str], int]:
    """What the sinks want measured (see ``Sink.wants``), and how often: as often as the
    most eager of them asks."""
    wanting = [s for s in sinks if s.wants]
    if not wanting:
        return frozenset(), 0
    return frozenset().union(*(s.wants for s in wanting)), min(s.wants_every for s in wanting)


def _budget(
    fraction: float | None, sampler: AdaptiveSampler, shortest: int
) -> OverheadBudget | None:
    """The overhead budget of ``fraction`` for ``sampler``'s sampled detectors, the
    shortest declared interval of those taking part being ``shortest``."""
    if fraction is None:
        return None
    budget = OverheadBudget(fraction, shortest=shortest)
    budget.stretch = sampler.stretch  # a run that goes on keeps the stretch it had
    return budget


def warn_sitting_out(off: list[str]) -> None:
    """Tell the user once which detectors a game (several optimizers stepped by hand, as
    in a GAN) turns off."""
    listed = " and ".join([", ".join(off[:-1]), off[-1]] if len(off) > 2 else off)
    warnings.warn(
        "stethoscope: the training step steps several optimizers by hand (a game such "
        "as a GAN, whose players' losses are not meant to fall), so "
        f"{listed} are off for this run; the other detectors (non-finite "
        "values, spikes, gradients, updates) judge it as usual",
        RuntimeWarning,
        stacklevel=4,
    )


def warn_not_applying(off: list[Detector]) -> None:
    """Tell the user once which detectors this run's training leaves out, and why, for
    those that say (see ``Detector.not_applying_because``)."""
    why: dict[str, list[str]] = {}
    for d in off:
        reason = d.not_applying_because()
        if reason:
            why.setdefault(reason, []).append(d.name)
    for reason, names in why.items():
        warnings.warn(
            f"stethoscope: {' and '.join(names)} cannot judge this run ({reason}), so "
            f"{'it is' if len(names) == 1 else 'they are'} off; the other detectors judge "
            "it as usual",
            RuntimeWarning,
            stacklevel=4,
        )
