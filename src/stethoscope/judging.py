"""How the monitor judges steps: the due detectors run on an observation, what they
raise is recorded and told to the sampler, and a decision is made.

:func:`judge` takes one observation. :func:`judge_waiting` takes the quiet steps that
waited (see :mod:`stethoscope.waiting`) and judges them together, with the outcome of
judging them one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from stethoscope.detectors.base import Detector
from stethoscope.findings import Finding, Severity
from stethoscope.observation import Observation
from stethoscope.policy import NOTHING, Decision, decide, first_to_act

if TYPE_CHECKING:
    from stethoscope.monitor import Monitor

__all__ = ["judge", "judge_waiting"]

#: A quiet step that waited: ``(step, epoch, loss, learning rate)``.
Waiting = tuple[int, int, float, float | None]


def judge(monitor: Monitor, obs: Observation, *, hold: bool, forced: bool = False) -> Decision:
    """Run the detectors due at ``obs``'s step on it; record what they find; decide (held
    until the ranks meet when ``hold``)."""
    findings: list[Finding] = []
    notes: list[Finding] = []  # the sampler's: the same on every rank, never forwarded
    monitor.planner.changed()  # the detectors and the sampler may change as they judge
    back = monitor.sampler.tick(obs.step)
    if back:
        notes.append(monitor._sampler_finding(obs.step, obs.epoch, back))
    suspects: list[str] = []
    step, has = obs.step, obs.has
    for d in monitor.planner.runnable(step, every=forced):
        if d.finished(step):
            continue
        for p in d.needs:
            if not has(p):
                break
        else:
            found = d.update(obs)
            if found:
                findings.extend(found)
            if d.suspect:
                suspects.append(f"{d.name}: {d.suspect}")
            if d.request:
                monitor.planner.requested |= d.request
    monitor.planner.fulfilled(has)
    monitor.losses.saw(obs)
    monitor.ledger.saw_step(step, grads=obs.grad_norm is not None, loss=obs.loss is not None)
    if monitor.ledger.observers:
        monitor.ledger.observe(obs, monitor.planner.sampled_interval(step))
    if step > monitor.last_step:
        monitor.last_step = step
    return _conclude(monitor, obs, findings, suspects, notes, hold=hold)


def judge_waiting(monitor: Monitor, steps: Sequence[Waiting]) -> Decision:
    """Judge the quiet steps that waited, ``(step, epoch, loss, lr)`` oldest first, with
    the outcome of :func:`judge` on each in turn: the same findings, at the same steps, in
    the same order, and the same state after.

    One by one, each step pays for the schedule, the ledger and every detector's
    bookkeeping, from caches its training step has just emptied. Together, each detector
    that reads the loss alone goes over all of the steps in turn, and the bookkeeping is
    done once; what a detector raised (a finding, a suspicion, a request) is then acted
    on step by step, where it would have been. That is the same outcome when the sampler
    is not hot, so its schedule does not move within the steps, and those detectors all
    run every step, so that an escalation on one of the steps changes none of them;
    otherwise the steps are judged one by one.
    """
    rank = monitor.rank
    observations = _Observations(steps, rank)
    readers = monitor.planner.loss_readers()
    base = monitor.sampler.base
    if monitor.sampler.hot or any(base[d.name] != 1 for d in readers):
        decision = NOTHING
        for obs in observations.all():
            decision = first_to_act(decision, judge(monitor, obs, hold=False))
        return decision
    monitor.planner.changed()
    numbers = [step for step, _, _, _ in steps]
    losses = [loss for _, _, loss, _ in steps]
    lrs = [lr for _, _, _, lr in steps]
    # what each step raised, by its place in ``steps``, in the detectors' order
    raised: dict[int, list[_Raised]] = {}
    n = len(steps)
    for d in readers:
        finishes = type(d).finished is not Detector.finished
        i = 0
        while i < n:
            if finishes and d.finished(numbers[i]):
                i += 1
                continue
            taken = d.absorb(numbers, losses, lrs, i)  # the steps that raise nothing, at once
            if taken > i:
                i = taken
                continue
            found = d.update(observations[i])
            if found or d.suspect or d.request:
                raised.setdefault(i, []).append(_Raised(d, found))
            i += 1
    monitor.losses.saw_losses(losses)
    monitor.ledger.saw_steps(numbers)
    observers = monitor.ledger.observers
    decision = NOTHING
    if observers or raised:  # step by step, each where judging them one by one would be
        for i in range(n):
            obs = observations[i]
            if observers:
                monitor.ledger.observe(obs, monitor.planner.sampled_interval(obs.step))
            monitor.last_step = max(monitor.last_step, obs.step)
            if i in raised:
                decision = first_to_act(decision, _act_on(monitor, obs, raised[i]))
    monitor.last_step = max(monitor.last_step, numbers[-1])
    return decision


def _act_on(monitor: Monitor, obs: Observation, raised: list[_Raised]) -> Decision:
    """Conclude a step that waited on what its detectors raised there."""
    findings: list[Finding] = []
    suspects: list[str] = []
    for r in raised:
        findings.extend(r.findings)
        if r.suspect:
            suspects.append(f"{r.detector.name}: {r.suspect}")
        monitor.planner.requested |= r.request
    monitor.planner.fulfilled(obs.has)
    return _conclude(monitor, obs, findings, suspects, [], hold=False)


class _Observations:
    """The waiting steps' :class:`Observation`, each made when first asked for: a step
    every loss reader took in (:meth:`Detector.absorb`) and no sink observes needs none."""

    def __init__(self, steps: Sequence[Waiting], rank: int) -> None:
        self._steps, self._rank = steps, rank
        self._made: dict[int, Observation] = {}

    def __getitem__(self, i: int) -> Observation:
        obs = self._made.get(i)
        if obs is None:
            step, epoch, loss, lr = self._steps[i]
            obs = self._made[i] = Observation.of_loss(step, epoch, self._rank, lr, loss)
        return obs

    def all(self) -> list[Observation]:
        return [self[i] for i in range(len(self._steps))]


class _Raised:
    """What a detector raised at one step while judging steps together: its findings, and
    its suspicion and request as they stood after that step."""

    __slots__ = ("detector", "findings", "request", "suspect")

    def __init__(self, detector: Detector, findings: list[Finding]) -> None:
        self.detector, self.findings = detector, findings
        self.suspect, self.request = detector.suspect, detector.request


def _conclude(
    monitor: Monitor,
    obs: Observation,
    findings: list[Finding],
    suspects: list[str],
    notes: list[Finding],
    *,
    hold: bool,
) -> Decision:
    """Act on what the detectors raised at ``obs``'s step: escalate on an alarm or a
    suspicion, record the findings and the sampler's notes, decide."""
    if not findings and not suspects and not notes:  # the healthy step: nothing to do
        return NOTHING
    alarming = [f for f in findings if f.severity >= Severity.WARNING]
    if alarming or suspects:
        reason = f"{alarming[0].detector} {alarming[0].severity}" if alarming else suspects[0]
        if hold:
            monitor.held.why = monitor.held.why or reason
        else:
            msg = monitor.sampler.escalate(obs.step, reason)
            if msg:
                notes.append(monitor._sampler_finding(obs.step, obs.epoch, msg))
    for f in findings:
        monitor.ledger.record(f, hold=monitor.held.findings if hold else None)
    for f in notes:
        monitor.ledger.record(f)
    decision = decide(findings, monitor.stop_on, monitor.raise_on, monitor.spared)
    if hold:
        held = monitor.held.decision
        if decision.stop and (held is None or (decision.raise_ and not held.raise_)):
            monitor.held.decision = decision
        monitor.held.spared.extend(decision.spared)  # for the ranks to agree on
        return Decision()
    if decision.stop:
        monitor.note_stop(decision.reason)
    return decision
