"""The engine's façade: what an adapter calls, and all it calls. Behind it, the schedule
says what each step measures, the judge runs the detectors and acts on what they raise,
the ledger counts and sends the findings, the policy decides."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from stethoscope.detectors import Detector
from stethoscope.engine.budget import OverheadBudget
from stethoscope.engine.held import Held
from stethoscope.engine.judge import Batch, Judge
from stethoscope.engine.ledger import Ledger
from stethoscope.engine.policy import NOTHING, Decision, Policy, first_to_act
from stethoscope.engine.schedule import Schedule
from stethoscope.engine.settings import Settings
from stethoscope.findings import Finding
from stethoscope.observation import Observation
from stethoscope.sinks.base import RunContext, Sink
from stethoscope.summary import EpochSummary

__all__ = ["Monitor"]


def _policy_text(policy: Policy) -> str | list[str] | None:
    """A parsed ``stop_on``/``raise_on`` as it was given."""
    if policy.detectors:
        return sorted(policy.detectors)
    return policy.min_severity.value if policy.min_severity is not None else None


class Monitor:
    """Runs the detectors the sampler selects on each observation and acts on findings.

    Adapters call :meth:`plan` at the start of a step to learn which statistics to
    compute, :meth:`observe` with the resulting host-side observation (or
    :meth:`observe_loss` on a quiet step), :meth:`observe_validation` after each
    validation, and :meth:`end_epoch` at each training epoch end; :meth:`state_dict`
    and :meth:`close` at a checkpoint and at the end.

    In a distributed run (:meth:`distribute`) each rank judges its own observations,
    but holds what it decides (stop, raise, sample faster) and, off rank zero, the
    findings it raises, in :attr:`held`, until the ranks meet
    (:class:`~stethoscope.distributed.RankMeeting`): there every rank sends them, and
    every rank acts on what all of them sent in the same way on the same step. Facts
    gathered from every rank are judged with :meth:`observe_shared`, identically
    everywhere, and acted on at once.

    Args:
        settings: What to watch and how, already checked (the callbacks pass theirs).
        writes: Whether this process writes findings to the sinks (``distribute`` sets it
            to False off rank zero).
        **arguments: Without ``settings``, the arguments of :meth:`Settings.of
            <stethoscope.engine.settings.Settings.of>`: ``detectors`` (default: every
            detector with defaults), ``sinks``, ``stop_on``, ``raise_on``,
            ``intervals``, ``escalate``, ``hot_steps``, ``overhead_budget`` (the share
            of step time the sampled steps may cost; see
            :mod:`stethoscope.engine.budget`) and ``repeat_after``.

    Raises:
        ValueError: On unknown detector names, duplicate detectors, or bad values.
    """

    def __init__(
        self, settings: Settings | None = None, *, writes: bool = True, **arguments: Any
    ) -> None:
        if settings is None:
            settings = Settings.of(**arguments)
        elif arguments:
            raise TypeError(f"Monitor takes settings or arguments, not both: {sorted(arguments)}")
        self.detectors: list[Detector] = list(settings.detectors)
        #: Every finding counted, sent to the sinks and summed up per epoch.
        self.ledger = Ledger(settings.sinks, repeat_after=settings.repeat_after)
        self._closed = False
        #: What runs when: the sampler, the planner, the overhead budget.
        self.schedule = Schedule(settings)
        self.sampler, self.planner = self.schedule.sampler, self.schedule.planner
        #: Runs the detectors and acts on what they raise.
        self.judge = Judge(
            self.planner,
            self.sampler,
            self.ledger,
            stop_on=settings.stop_on,
            raise_on=settings.raise_on,
        )
        self.distribute(rank=0, world_size=1)
        self.ledger.writes = writes

    # -- per step ---------------------------------------------------------------
    def plan(self, step: int) -> frozenset[str]:
        """The statistics the adapter should measure at ``step``."""
        return self.planner.plan(step)

    def first_sampled(self, start: int, steps: int) -> tuple[int, frozenset[str]]:
        """See ``Planner.first_sampled``."""
        return self.planner.first_sampled(start, steps)

    def due(self, step: int) -> frozenset[str]:
        """The names of the detectors the schedule runs at ``step``."""
        return self.planner.due(step)

    def keeper_of(self, bar: str) -> Detector | None:
        """The detector that keeps the bar of ``bar`` (see ``Detector.bars``) for the
        recovery ladder, or None."""
        return next((d for d in self.detectors if d.bars == bar), None)

    def every(self, statistic: str) -> int | None:
        """How often ``statistic`` is measured for the detectors now: the shortest
        interval of those that need it (None: none does)."""
        return min(
            (self.interval(d.name) for d in self.detectors if statistic in d.needs), default=None
        )

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
        if not forced and self.judge.keep(obs.step, obs.epoch, obs.loss, obs.lr):
            return NOTHING  # a quiet step: judged with the next one that cannot wait
        return self.judge.now(obs, forced=forced)

    def observe_loss(
        self, step: int, epoch: int, loss: float, lr: float | None = None
    ) -> Decision | None:
        """Judge a quiet step, one that measured the loss alone: :meth:`observe` of its
        observation, which is made only if the step cannot wait to be judged.

        Returns:
            None while the step waits, else what :meth:`observe` returns.
        """
        if self.judge.keep(step, epoch, loss, lr):
            return None
        return self.judge.now(Observation.of_loss(step, epoch, self.rank, lr, loss))

    def catch_up(self) -> Decision:
        """Judge the quiet steps still waiting (see :mod:`stethoscope.engine.waiting`),
        in order: before anything else is judged, summed up or saved."""
        return self.judge.catch_up()

    def observe_shared(self, obs: Observation) -> Decision:
        """Judge an observation that every rank holds the same (gathered from all of them).

        Every rank reaches the same verdict from it, so it is acted on at once, on every
        rank; only rank zero reports its findings (the others do not forward them).
        """
        self.catch_up()
        return self.judge.judge(Batch.of(obs))

    def clock(self, seconds: float, *, sampled: bool, steps: int = 1) -> None:
        """How long the last step took (the adapter's clock, from one step's start to the
        next; ``steps``: the training steps of an execution clocked as one), and whether it
        was sampled: the overhead budget's measure. Off while the sampler is hot: the
        budget governs the healthy steady state."""
        self.schedule.clock(seconds, sampled=sampled, steps=steps)

    @property
    def budget(self) -> OverheadBudget | None:
        """Keeps the sampled steps' cost within ``overhead_budget`` (None: no budget, as
        in a distributed run)."""
        return self.schedule.budget

    @property
    def sinks_want(self) -> frozenset[str]:
        """Statistics the sinks want measured (see ``Sink.wants``), beside the
        detectors'."""
        return self.schedule.sinks_want

    def note_stop(self, reason: Finding | None) -> None:
        """Remember ``reason`` as what stopped the run, unless something already did."""
        self.judge.note_stop(reason)

    @property
    def stopped_by(self) -> Finding | None:
        """The finding that stopped (or raised in) the run, if any."""
        return self.judge.stopped_by

    @property
    def last_step(self) -> int:
        """The latest step judged (-1: none yet)."""
        return self.judge.last_step

    @property
    def held(self) -> Held:
        """What this rank holds until the ranks next meet (a distributed run): the
        meeting (:class:`~stethoscope.distributed.RankMeeting`) empties it."""
        return self.judge.held

    def spare(self, detectors: frozenset[str]) -> None:
        """Leave the warnings and errors of ``detectors`` to a recovery ladder instead of
        the policy (see ``Decision.spared``): then every step is judged at once."""
        self.judge.spare(frozenset(detectors))

    def raises_on(self, finding: Finding) -> bool:
        """Whether ``finding`` matches ``raise_on``."""
        return self.judge.raise_on.matches(finding)

    def pooled_losses(self) -> dict[str, tuple[float, float]]:
        """What this rank pools with the others' at a validation: the training losses
        since the last one, and the first, each as a (sum, count) pair."""
        return self.judge.losses.shared()

    def observe_validation(
        self, step: int, epoch: int, val_loss: float | None, **measured: Any
    ) -> Decision:
        """Judge a validation loss against the mean training loss since the last one (a
        single process; the ranks of a distributed run pool theirs where they meet), and
        what else was ``measured`` of the validation, by field: its samples' prints
        (``val_prints``), the calls that behaved as in training (``val_training_calls``)."""
        if val_loss is None and all(v is None for v in measured.values()):
            return NOTHING
        earlier = self.catch_up()  # the training losses that waited belong to this window
        fields = {k: v for k, v in measured.items() if v is not None}
        if val_loss is not None:
            losses = self.judge.losses
            fields.update(val_loss=val_loss, train_loss=losses.mean(), start_loss=losses.start)
        obs = Observation.of_event(step, epoch, self.rank, **fields)
        return first_to_act(earlier, self.judge.now(obs, carried=Observation.carried_by(fields)))

    def reads(self, statistic: str) -> bool:
        """Whether a detector taking part still reads ``statistic`` (needs it, or runs on
        its arrival): whether an adapter measures one that is never planned (a
        validation's)."""
        return self.schedule.reads(statistic, self.last_step + 1)

    def escalate(self, step: int, epoch: int, reason: str) -> None:
        """Run every detector from ``step`` on: the adapter saw, outside the detectors,
        something they should judge at once (a non-finite gradient on an unsampled step)."""
        self.catch_up()
        self.judge.escalate(step, epoch, reason)

    def submit(self, findings: Iterable[Finding]) -> Decision:
        """Record findings made outside the detectors (by an adapter, say) and decide on
        them as on the detectors' own."""
        self.catch_up()
        return self.judge.submit(list(findings))

    def tell(self, findings: Iterable[Finding]) -> None:
        """Record findings that ask for no decision: the recovery ladder's acts, each
        of which the ladder has decided itself."""
        for f in findings:
            self.ledger.enter(f)

    def receive(self, findings: Iterable[Finding]) -> None:
        """Record findings that other ranks raised from their own data (rank zero writes
        them; the other ranks leave them to it)."""
        if self.ledger.writes:
            for f in findings:
                self.ledger.enter(f)

    # -- distributed runs -------------------------------------------------------------
    def distribute(
        self, *, rank: int, world_size: int, replicated: bool = True, sharded: bool = False
    ) -> None:
        """Take part in a run of ``world_size`` processes as ``rank`` (1: a single process).

        Rank zero alone writes to the sinks. In a single process the detectors that
        compare ranks do not run.

        Args:
            rank: This process's rank.
            world_size: How many processes train together.
            replicated: Whether every rank holds the same gradients and weights
                (:data:`~stethoscope.statistics.REPLICATED`), as under DDP: then
                off rank zero the detectors that judge only those do not run, and rank
                zero judges them for everyone. ``False``: every rank judges its own.
            sharded: The ranks combine those statistics from their shards (FSDP2): every
                rank measures them where rank zero, which judges them, does.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be an integer >= 1")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} must be an integer in [0, {world_size})")
        self.rank, self.world_size = rank, world_size
        self.judge.take_part(rank=rank, world_size=world_size, replicated=replicated)
        self.ledger.writes = rank == 0
        #: Whether this process judges the gradients and weights (not so off rank zero
        #: when every rank holds the same ones).
        self.judges_replicated = not self.judge.judged_elsewhere
        self.sharded = sharded and world_size > 1  # the ranks combine their shards' statistics
        self.schedule.take_part(
            rank=rank, world_size=world_size, replicated=replicated, sharded=sharded
        )
        self.judge.held = Held()

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
        self.schedule.open_epoch(self.last_step + 1)
        return summary

    def summary(self, epoch: int) -> EpochSummary:
        """The summary of the epoch so far, as plain data."""
        self.catch_up()
        return self.ledger.summary(
            epoch,
            budget=self.schedule.budget_note(),
            detectors=self.schedule.in_run(),
            interval=self.sampler.intervals_at(self.last_step),
            escalations=self.sampler.escalations,
            hot=self.sampler.hot,
            stopped_by=self.stopped_by,
            blind=self.judge.blind(),
        )

    @property
    def sinks(self) -> list[Sink]:
        """Where findings go (rank zero writes them)."""
        return self.ledger.sinks

    @property
    def writes(self) -> bool:
        """Whether this process writes to the sinks (rank zero does)."""
        return self.ledger.writes

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
        self.schedule.load_state_dict(state.get("sampler", {}))
        self.ledger.escalations_from(self.sampler.escalations)  # this epoch's count from here
        self.ledger.last_sent = dict(state.get("last_sent", {}))
        self.judge.last_step = int(state.get("last_step", -1))
        self.schedule.open_epoch(self.last_step + 1, resumed=True)  # a resumed run's first

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
        # the rules that do not apply to this training (precision rules in float32) take
        # no part: never run, never planned, never listed as quiet
        self.schedule.starting(warn=self.rank == 0)
        if context.setup.adversarial:
            self.plays_a_game()
        self.ledger.call_sinks("start", context)

    def plays_a_game(self) -> None:
        """The training is a game (see ``Schedule.play_a_game``), known or found."""
        self.schedule.play_a_game(warn=self.rank == 0)

    def computes_in(self, dtype: str) -> bool:
        """Seen computing in 16-bit ``dtype`` over float32 weights (an autocast in the
        training step): the precision rules take part from now on. Whether it was news."""
        if not self.detectors or self.detectors[0].setup.low_precision:
            return False
        self.schedule.learn_setup(low_precision=True, computes_in=dtype)
        return True

    def new_stage(self, step: int) -> None:
        """A new stage of training began at ``step`` (see ``Schedule.new_stage``)."""
        self.schedule.new_stage(step)

    def cannot_measure(self, statistics: frozenset[str], why: str) -> list[str]:
        """The adapter cannot measure ``statistics`` in this run (``why``: a few words):
        see ``Schedule.cannot_measure``; rank zero says so."""
        return self.schedule.cannot_measure(statistics, why, warn=self.rank == 0)

    def begin(self, *, fresh: bool) -> None:
        """Start a training run: reopen after a previous run's close, forget its stop.

        Args:
            fresh: The run starts at step 0, so the baselines and the schedule of a
                previous run (keyed to its steps) are forgotten too. A resumed run
                restores them with :meth:`load_state_dict` afterwards.
        """
        if fresh:
            self.reset()
        self.judge.stopped_by = None
        self._closed = False
        self.schedule.open_epoch(self.last_step + 1, resumed=not fresh)

    def reset(self) -> None:
        """Forget every baseline and the schedule (a fresh run)."""
        for d in self.detectors:
            d.reset()
        self.schedule.forget()
        self.judge.forget()
        self.ledger.last_sent.clear()
        self.ledger.new_epoch(escalations=self.sampler.escalations)


def _description(monitor: Monitor) -> dict[str, Any]:
    """What :meth:`Monitor.describe` returns."""
    detectors = {}
    for d in monitor.detectors:
        params = inspect.signature(type(d).__init__).parameters
        detectors[d.name] = {
            "class": type(d).__name__,
            "every": monitor.sampler.base[d.name],
            "idle": monitor.schedule.idle(d.name),
            "arguments": {p: getattr(d, p) for p in params if p != "self" and hasattr(d, p)},
        }
    return {
        "detectors": detectors,
        "sampler": monitor.schedule.describe(),
        "stop_on": _policy_text(monitor.judge.stop_on),
        "raise_on": _policy_text(monitor.judge.raise_on),
    }
