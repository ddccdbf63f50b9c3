"""The framework-free core: detectors + sampler + policy + sinks."""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stethoscope.budget import LONGEST, OverheadBudget, parse_budget
from stethoscope.detectors import DETECTORS, Detector, default_detectors
from stethoscope.distributed import Held
from stethoscope.findings import Finding, Severity
from stethoscope.judging import judge, judge_waiting
from stethoscope.ledger import SAMPLER, Ledger
from stethoscope.observation import Observation
from stethoscope.planning import Planner
from stethoscope.policy import NOTHING, Decision, Policy, StopOn, decide, first_to_act, parse_policy
from stethoscope.sampling import AdaptiveSampler
from stethoscope.sinks.base import RunContext, Sink
from stethoscope.statistics import GATHERED, PLANNED, REPLICATED
from stethoscope.summary import EpochSummary
from stethoscope.validation_window import LossesSinceValidation
from stethoscope.waiting import WaitingLosses

__all__ = ["SAMPLER", "Monitor"]


def _policy_text(policy: Policy) -> str | list[str] | None:
    """A parsed ``stop_on``/``raise_on`` as it was given."""
    if policy.detectors:
        return sorted(policy.detectors)
    return policy.min_severity.value if policy.min_severity is not None else None


def _sink_wants(sinks: Sequence[Sink]) -> tuple[frozenset[str], int]:
    """What the sinks want measured (see ``Sink.wants``), and how often: as often as the
    most eager of them asks."""
    wanting = [s for s in sinks if s.wants]
    for s in wanting:
        unknown = sorted(set(s.wants) - PLANNED)
        if unknown:
            raise ValueError(
                f"{type(s).__name__}.wants names {unknown!r}; a sink may want any of "
                f"{sorted(PLANNED)!r}"
            )
        every = s.wants_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"{type(s).__name__}.wants_every={every!r} must be an integer >= 1 (steps)"
            )
    if not wanting:
        return frozenset(), 0
    return frozenset().union(*(s.wants for s in wanting)), min(s.wants_every for s in wanting)


class Monitor:
    """Runs the detectors the sampler selects on each observation and acts on findings.

    Adapters call :meth:`plan` at the start of a step to learn which statistics to
    compute, :meth:`observe` with the resulting host-side observation, and
    :meth:`end_epoch` at each training epoch end.

    In a distributed run (:meth:`distribute`) each rank judges its own observations,
    but holds what it decides (stop, raise, sample faster) and, off rank zero, the
    findings it raises, in :attr:`held`, until the ranks meet
    (:class:`~stethoscope.distributed.RankMeeting`): there every rank sends them, and
    every rank acts on what all of them sent in the same way on the same step. Facts
    gathered from every rank are judged with :meth:`observe_shared`, identically
    everywhere, and acted on at once.

    Args:
        detectors: Detector instances (default: every detector with defaults).
            Names must be unique.
        sinks: Where findings go.
        stop_on: ``None``, ``"error"``, ``"warning"`` or a set of detector names.
        raise_on: Same choices; a match raises instead of stopping gracefully.
        intervals: Base sampling interval per detector name, overriding defaults.
        escalate: Whether suspicion raises the sampling rate.
        hot_steps: Length of the every-step window after an escalation.
        overhead_budget: The share of step time the sampled steps may cost (0.01: 1%);
            their detectors' intervals stretch to stay within it (see
            :mod:`stethoscope.budget`). None: the declared intervals, whatever they cost.
        repeat_after: Steps before an identical finding (same detector, where and
            severity) is sent to the sinks again; repeats are still counted.
        writes: Whether this process writes findings to the sinks (``distribute`` sets it
            to False off rank zero).

    Raises:
        ValueError: On unknown detector names, duplicate detectors, or bad values.
    """

    def __init__(
        self,
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
        writes: bool = True,
    ) -> None:
        self.detectors: list[Detector] = (
            list(detectors) if detectors is not None else default_detectors()
        )
        for d in self.detectors:
            if not isinstance(d, Detector):
                raise TypeError(f"detectors must be Detector instances, got {d!r}")
        names = [d.name for d in self.detectors]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"detectors lists {dupes!r} more than once")
        known = set(DETECTORS) | set(names)
        self.stop_on = parse_policy(stop_on, argument="stop_on", known=known)
        self.raise_on = parse_policy(raise_on, argument="raise_on", known=known)
        intervals = dict(intervals or {})
        unknown = sorted(set(intervals) - set(names))
        if unknown:
            raise ValueError(
                f"intervals names {unknown!r}, which are not among the detectors: {names!r}"
            )
        self.sampler = AdaptiveSampler(
            {d.name: intervals.get(d.name, d.base_interval) for d in self.detectors},
            escalate=escalate,
            hot_steps=hot_steps,
        )
        #: Detectors whose warnings and errors a recovery ladder answers instead of the
        #: policy (see ``Decision.spared``); set by the callbacks' ``recover=``.
        self.spared: frozenset[str] = frozenset()
        #: Every finding counted, sent to the sinks and summed up per epoch.
        self.ledger = Ledger(sinks, repeat_after=repeat_after)
        self.stopped_by: Finding | None = None
        self.last_step = -1
        self._closed = False
        #: Which detectors run at each step, and what they need measured.
        self.planner = Planner(self.detectors, self.sampler)
        self.losses = LossesSinceValidation()
        #: Quiet steps waiting to be judged (see :mod:`stethoscope.waiting`).
        self.waiting = WaitingLosses()
        self._sink_wants = _sink_wants(self.ledger.sinks)
        #: Statistics the sinks want measured (see ``Sink.wants``), beside the detectors'.
        self.sinks_want: frozenset[str] = self._sink_wants[0]
        self._budget_fraction = parse_budget(overhead_budget)
        self.distribute(rank=0, world_size=1)
        self.ledger.writes = writes

    # -- per step ---------------------------------------------------------------
    def plan(self, step: int) -> frozenset[str]:
        """The statistics the adapter should measure at ``step``."""
        return self.planner.plan(step)

    def due(self, step: int) -> frozenset[str]:
        """The names of the detectors the schedule runs at ``step``."""
        return self.planner.due(step)

    def interval(self, name: str, step: int | None = None) -> int:
        """The current sampling interval of detector ``name``."""
        return self.sampler.interval(name, self.last_step if step is None else step)

    def observe(self, obs: Observation, *, forced: bool = False) -> Decision:
        """Judge one step's observation; report findings; say whether to stop.

        In a distributed run the decision is held until the ranks next meet (see
        :class:`~stethoscope.distributed.RankMeeting`), and ``Decision()`` is returned
        meanwhile. An observation whose loss is not finite is judged by every detector
        whose statistics it carries, due or not: the step that went bad is looked at
        with everything measured there, whatever the schedule.

        Args:
            forced: The adapter measured this step off the schedule because something
                was wrong (a non-finite loss or gradient): judge it likewise.
        """
        if (
            not forced
            and self._waits
            and self.waiting.keep(obs.step, obs.epoch, obs.loss, obs.lr, self.planner)
        ):
            return NOTHING  # a quiet step: judged with the next one that cannot wait
        return self._observe_now(obs, forced=forced)

    def observe_loss(
        self, step: int, epoch: int, loss: float, lr: float | None = None
    ) -> Decision | None:
        """Judge a quiet step, one that measured the loss alone: :meth:`observe` of its
        observation, which is made only if the step cannot wait to be judged.

        Returns:
            None while the step waits, else what :meth:`observe` returns.
        """
        if self._waits and self.waiting.keep(step, epoch, loss, lr, self.planner):
            return None
        obs = Observation.of_loss(step, epoch, self.rank, lr, loss)
        return self._observe_now(obs, forced=False)

    @property
    def _waits(self) -> bool:
        """Whether quiet steps may wait to be judged. A distributed run meets on every
        rank's verdicts and a recovery ladder acts on each step's: there every step is
        judged at once."""
        return self.world_size == 1 and not self.spared

    def _observe_now(self, obs: Observation, *, forced: bool) -> Decision:
        """Judge the waiting steps, then ``obs``; work out the bar for the next ones."""
        earlier = self.catch_up()
        loss = obs.loss
        forced = forced or (loss is not None and not math.isfinite(loss))
        decision = judge(self, obs, hold=self.world_size > 1, forced=forced)
        quiet = self.planner.quiet_detectors(obs.step + 1) if self._waits else None
        self.waiting.rebar(quiet)
        return first_to_act(earlier, decision)

    def catch_up(self) -> Decision:
        """Judge the quiet steps still waiting (see :mod:`stethoscope.waiting`), in order:
        before anything else is judged, summed up or saved."""
        steps = self.waiting.take()
        return judge_waiting(self, steps) if steps else NOTHING

    def observe_shared(self, obs: Observation) -> Decision:
        """Judge an observation that every rank holds the same (gathered from all of them).

        Every rank reaches the same verdict from it, so it is acted on at once, on every
        rank; only rank zero reports its findings (the others do not forward them).
        """
        self.catch_up()
        return judge(self, obs, hold=False)

    def clock(self, seconds: float, *, sampled: bool, steps: int = 1) -> None:
        """How long the last step took (the adapter's clock, from one step's start to the
        next; ``steps``: the training steps of an execution clocked as one), and whether it
        was sampled: the overhead budget's measure. Off while the sampler is hot: the
        budget governs the healthy steady state."""
        if self.budget is None or self.sampler.hot:
            return
        stretch = self.budget.clock(seconds, sampled=sampled, steps=steps)
        if stretch is not None:
            _stretch(self, stretch)

    def note_stop(self, reason: Finding | None) -> None:
        """Remember ``reason`` as what stopped the run, unless something already did."""
        if self.stopped_by is None:
            self.stopped_by = reason

    def observe_validation(self, step: int, epoch: int, val_loss: float) -> Decision:
        """Judge a validation loss against the mean training loss since the last one (a
        single process; the ranks of a distributed run pool theirs where they meet)."""
        self.catch_up()  # the training losses that waited belong to this window
        obs = Observation(
            step=step,
            epoch=epoch,
            rank=self.rank,
            val_loss=val_loss,
            train_loss=self.losses.mean(),
            start_loss=self.losses.start,
        )
        return self.observe(obs)

    def escalate(self, step: int, epoch: int, reason: str) -> None:
        """Run every detector from ``step`` on: the adapter saw, outside the detectors,
        something they should judge at once (a non-finite gradient on an unsampled step)."""
        self.catch_up()
        self.planner.changed()
        msg = self.sampler.escalate(step, reason)
        if msg:
            self.ledger.record(self._sampler_finding(step, epoch, msg))

    def report(self, findings: Iterable[Finding]) -> Decision:
        """Record findings produced outside the detectors (e.g. by an adapter)."""
        self.catch_up()
        findings = list(findings)
        for f in findings:
            self.ledger.record(f)
        return decide(findings, self.stop_on, self.raise_on)

    def receive(self, findings: Iterable[Finding]) -> None:
        """Record findings that other ranks raised from their own data (rank zero writes
        them; the other ranks leave them to it)."""
        if self.ledger.writes:
            for f in findings:
                self.ledger.record(f)

    # -- distributed runs -------------------------------------------------------------
    def distribute(self, *, rank: int, world_size: int, replicated: bool = True) -> None:
        """Take part in a run of ``world_size`` processes as ``rank`` (1: a single process).

        Rank zero alone writes to the sinks. In a single process the detectors that
        compare ranks do not run.

        Args:
            rank: This process's rank.
            world_size: How many processes train together.
            replicated: Whether every rank holds the same gradients and weights
                (:data:`~stethoscope.statistics.REPLICATED`), as under DDP: then
                off rank zero the detectors that judge only those do not run, and rank
                zero judges them for everyone. ``False`` (sharded parameters): every
                rank judges its own.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be an integer >= 1")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} must be an integer in [0, {world_size})")
        self.rank, self.world_size = rank, world_size
        self.ledger.writes = rank == 0
        #: Whether this process judges the gradients and weights (not so off rank zero
        #: when every rank holds the same ones).
        self.judges_replicated = world_size == 1 or rank == 0 or not replicated
        if world_size == 1:
            idle = {d.name for d in self.detectors if d.needs & GATHERED}
        elif rank != 0 and replicated:
            idle = {d.name for d in self.detectors if d.needs <= REPLICATED}
        else:
            idle = set()
        self.planner.set_idle(frozenset(idle))
        # the sinks write on rank zero only: there alone is what they want measured
        self.planner.sinks_want(*(self._sink_wants if rank == 0 else (frozenset(), 0)))
        #: Keeps the sampled steps' cost within ``overhead_budget`` (None: no budget). Only
        #: in a single process: the ranks of a distributed run share one schedule, which
        #: their own clocks would pull apart.
        self.budget = _budget(self._budget_fraction if world_size == 1 else None, self.sampler)
        #: What this rank holds until the ranks next meet (a distributed run only).
        self.held = Held()

    @property
    def backlog(self) -> int:
        """Findings this rank holds for rank zero until the ranks next meet."""
        return len(self.held.findings)

    # -- per epoch --------------------------------------------------------------
    def end_epoch(self, epoch: int) -> EpochSummary:
        """Build the epoch's summary, send it to the sinks, flush them, start a new epoch."""
        summary = self.summary(epoch)
        self.ledger.call_sinks("epoch_end", summary)
        self.ledger.call_sinks("flush")
        self.ledger.new_epoch(escalations=self.sampler.escalations)
        return summary

    def summary(self, epoch: int) -> EpochSummary:
        """The summary of the epoch so far, as plain data."""
        self.catch_up()
        every = min((b for b in self.sampler.base.values() if b > 1), default=1)
        return self.ledger.summary(
            epoch,
            budget=self.budget.note(every) if self.budget is not None else "",
            detectors=[d for d in self.detectors if d.name not in self.planner.idle],
            interval=self.interval,
            escalations=self.sampler.escalations,
            hot=self.sampler.hot,
            stopped_by=self.stopped_by,
        )

    @property
    def sinks(self) -> list[Sink]:
        """Where findings go (rank zero writes them)."""
        return self.ledger.sinks

    @property
    def writes(self) -> bool:
        """Whether this process writes to the sinks (rank zero does)."""
        return self.ledger.writes

    # -- findings -----------------------------------------------------------------
    def _sampler_finding(self, step: int, epoch: int, message: str) -> Finding:
        return Finding(
            step=step,
            epoch=epoch,
            detector=SAMPLER,
            severity=Severity.INFO,
            message=message,
            value=self.sampler.cap(step),  # the interval cap now: 1, or None at base
            rank=self.rank,
        )

    # -- lifecycle ------------------------------------------------------------------
    def flush(self) -> None:
        self.catch_up()
        self.ledger.call_sinks("flush")

    def close(self) -> None:
        """Flush and close every sink, once."""
        if self._closed:
            return
        self._closed = True
        self.catch_up()
        self.ledger.call_sinks("flush")
        self.ledger.call_sinks("close")

    def state_dict(self) -> dict[str, Any]:
        """Detector baselines, sampler schedule and repeat bookkeeping: primitives only."""
        self.catch_up()
        return {
            "detectors": {d.name: d.state_dict() for d in self.detectors},
            "sampler": self.sampler.state_dict(),
            "last_sent": dict(self.ledger.last_sent),
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for d in self.detectors:
            if d.name in state.get("detectors", {}):
                d.load_state_dict(state["detectors"][d.name])
        self.sampler.load_state_dict(state.get("sampler", {}))
        _stretch(self, int(state.get("sampler", {}).get("stretch", 1)))
        self.ledger.escalations_from(self.sampler.escalations)  # this epoch's count from here
        self.ledger.last_sent = dict(state.get("last_sent", {}))
        self.last_step = int(state.get("last_step", -1))

    def describe(self) -> dict[str, Any]:
        """The detectors and the sampler as plain data: each detector's base interval and
        the arguments it was made with (its thresholds), for the run's record."""
        return _description(self)

    def start(self, context: RunContext) -> None:
        """Hand every sink the run's context (its printer, the framework's log dir and
        MLflow run), and every detector the training's setup its advice depends on:
        training is starting."""
        for d in self.detectors:
            d.setup = context.setup
        if context.setup.adversarial:
            _sit_out_the_game(self)
        self.ledger.call_sinks("start", context)

    def begin(self, *, fresh: bool) -> None:
        """Start a training run: reopen after a previous run's close, forget its stop.

        Args:
            fresh: The run starts at step 0, so the baselines and the schedule of a
                previous run (keyed to its steps) are forgotten too. A resumed run
                restores them with :meth:`load_state_dict` afterwards.
        """
        if fresh:
            self.reset()
        self.stopped_by = None
        self._closed = False

    def reset(self) -> None:
        """Forget every baseline and the schedule (a fresh run)."""
        for d in self.detectors:
            d.reset()
        self.sampler.load_state_dict({})
        _stretch(self, 1)
        self.planner.forget()
        self.losses = LossesSinceValidation()
        self.waiting = WaitingLosses()
        self.ledger.last_sent.clear()
        self.stopped_by = None
        self.last_step = -1
        self.held = Held()
        self.ledger.new_epoch(escalations=self.sampler.escalations)


def _description(monitor: Monitor) -> dict[str, Any]:
    """What :meth:`Monitor.describe` returns."""
    detectors = {}
    for d in monitor.detectors:
        params = inspect.signature(type(d).__init__).parameters
        detectors[d.name] = {
            "class": type(d).__name__,
            "every": monitor.sampler.base[d.name],
            "idle": d.name in monitor.planner.idle,
            "arguments": {p: getattr(d, p) for p in params if p != "self" and hasattr(d, p)},
        }
    return {
        "detectors": detectors,
        "sampler": {"escalate": monitor.sampler.escalation, "hot_steps": monitor.sampler.hot_steps},
        "stop_on": _policy_text(monitor.stop_on),
        "raise_on": _policy_text(monitor.raise_on),
    }


def _budget(fraction: float | None, sampler: AdaptiveSampler) -> OverheadBudget | None:
    """The overhead budget of ``fraction`` for ``sampler``'s sampled detectors."""
    if fraction is None:
        return None
    sampled = [every for every in sampler.declared.values() if every > 1]
    budget = OverheadBudget(fraction, shortest=min(sampled, default=16))
    budget.stretch = sampler.stretch  # a run that goes on keeps the stretch it had
    return budget


def _stretch(monitor: Monitor, factor: int) -> None:
    """Run the sampled detectors ``factor`` times less often than declared."""
    if factor == monitor.sampler.stretch:
        return
    monitor.sampler.stretch_to(factor, LONGEST)
    if monitor.budget is not None:
        monitor.budget.stretch = factor
    monitor.planner.set_idle(monitor.planner.idle)  # its caches follow the schedule


def _listed(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 2 else names)


def _sit_out_the_game(monitor: Monitor) -> None:
    """A game (several optimizers stepped by hand, as in a GAN): the detectors that assume
    the loss should fall take no part, and the user is told once."""
    off = sorted(d.name for d in monitor.detectors if d.assumes_falling_loss)
    if not off:
        return
    monitor.planner.set_idle(monitor.planner.idle | frozenset(off))
    if monitor.rank == 0:
        warnings.warn(
            "stethoscope: the training step steps several optimizers by hand (a game such "
            "as a GAN, whose players' losses are not meant to fall), so "
            f"{_listed(off)} are off for this run; the other detectors (non-finite "
            "values, spikes, gradients, updates) judge it as usual",
            RuntimeWarning,
            stacklevel=4,
        )
