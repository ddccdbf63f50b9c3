"""How steps are judged: the due detectors run on an observation, what they raise is
recorded and told to the sampler, and a decision is made.

:meth:`Judge.step` takes one observation. :meth:`Judge.waited` takes the quiet steps that
waited (see :mod:`stethoscope.engine.waiting`) and judges them together, with the outcome
of judging them one by one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from stethoscope.detectors.base import Detector
from stethoscope.engine.held import Held
from stethoscope.engine.ledger import Ledger
from stethoscope.engine.planner import Planner
from stethoscope.engine.policy import NOTHING, Decision, Policy, decide, first_to_act
from stethoscope.engine.sampler import AdaptiveSampler
from stethoscope.engine.validation_window import LossesSinceValidation
from stethoscope.engine.waiting import WaitingLosses
from stethoscope.findings import SAMPLER, Finding, Severity
from stethoscope.observation import Observation
from stethoscope.statistics import judged_elsewhere

__all__ = ["Batch", "Judge"]

#: A quiet step that waited: ``(step, epoch, loss, learning rate)``.
Waiting = tuple[int, int, float, float | None]

#: Due steps in a row whose observation lacked what a detector needs, although it was
#: asked for, after which the detector is silent for want of it (``Detector.blind_to``).
BLIND_AFTER = 8


class Judge:
    """Runs the detectors on steps and acts on what they raise: the sampler escalates on
    an alarm or a suspicion, the ledger records the findings, the policy decides.

    It keeps what judging leaves behind: the last step judged, the finding that stopped
    the run, the training losses since the last validation, and, in a distributed run,
    what this rank holds until the ranks next meet.

    Args:
        planner: Which detectors run at each step.
        sampler: The schedule the detectors' suspicions escalate.
        ledger: Where findings are counted and sent.
        stop_on, raise_on: The policy.
    """

    def __init__(
        self,
        planner: Planner,
        sampler: AdaptiveSampler,
        ledger: Ledger,
        *,
        stop_on: Policy,
        raise_on: Policy,
    ) -> None:
        self.planner, self.sampler, self.ledger = planner, sampler, ledger
        self.stop_on, self.raise_on = stop_on, raise_on
        #: Detectors whose warnings and errors a recovery ladder answers instead of the
        #: policy (see ``Decision.spared``).
        self.spared: frozenset[str] = frozenset()
        self.rank, self.world_size = 0, 1
        #: Statistics another rank judges: measured here for it (combined from the
        #: shards) or for nobody. Their detectors are idle here, and one that judges this
        #: rank's own data must not say again what that rank says of them.
        self.judged_elsewhere: frozenset[str] = frozenset()
        #: Whether quiet steps may wait to be judged. A distributed run meets on every
        #: rank's verdicts and a recovery ladder acts on each step's: there every step
        #: is judged at once. (Kept, not worked out: it is asked on every step.)
        self.waits = True
        self.forget()

    def forget(self) -> None:
        """A fresh run: nothing judged yet."""
        self.last_step = -1
        self.stopped_by: Finding | None = None
        #: The training losses since the last validation.
        self.losses = LossesSinceValidation()
        #: What this rank holds until the ranks next meet (a distributed run only).
        self.held = Held()
        #: Quiet steps waiting to be judged (see :mod:`stethoscope.engine.waiting`).
        self.waiting = WaitingLosses()
        #: By detector, the due steps in a row whose observation lacked what it needs
        #: although the plan asked for it (only detectors that say so, see ``blind_to``).
        self.unread: dict[str, int] = {}
        #: By detector, the gravest warning or error it raised in this run.
        self.said: dict[str, Severity] = {}

    def blind(self) -> dict[str, str]:
        """The detectors silent for want of what they need, with what the run lacks."""
        if not self.unread:
            return {}
        by_name = {d.name: d for d in self.planner.detectors}
        return {n: by_name[n].blind_to for n, k in self.unread.items() if k >= BLIND_AFTER}

    # -- when a step is judged ------------------------------------------------------------
    def take_part(self, *, rank: int, world_size: int, replicated: bool = True) -> None:
        """Judge as ``rank`` of ``world_size`` processes; ``replicated``: every rank holds
        the same gradients and weights (see ``Monitor.distribute``), which rank zero
        judges."""
        self.rank, self.world_size = rank, world_size
        self.judged_elsewhere = judged_elsewhere(
            rank=rank, world_size=world_size, replicated=replicated
        )
        self.waits = world_size == 1 and not self.spared

    def spare(self, detectors: frozenset[str]) -> None:
        """Leave ``detectors``' warnings and errors to a recovery ladder."""
        self.spared = frozenset(detectors)
        self.waits = self.world_size == 1 and not self.spared

    def keep(self, step: int, epoch: int, loss: float | None, lr: float | None) -> bool:
        """Keep a quiet step's loss to be judged later, if it may wait (see
        :meth:`WaitingLosses.keep`). False: judge it now (:meth:`now`)."""
        return self.waits and self.waiting.keep(step, epoch, loss, lr, self.planner)

    def now(
        self, obs: Observation, *, forced: bool = False, carried: frozenset[str] | None = None
    ) -> Decision:
        """Judge the waiting steps, then ``obs`` (held until the ranks meet in a
        distributed run; ``forced``, or a non-finite loss: by every detector whose
        statistics it carries); work out the bar for the next steps, where ``obs`` carried
        a loss (without one, a validation's, the loss readers' bar still holds)."""
        earlier = self.catch_up()
        obs.drop(self.judged_elsewhere)
        loss = obs.loss
        forced = forced or (loss is not None and not math.isfinite(loss))
        if carried is not None and self.judged_elsewhere:
            carried = carried - self.judged_elsewhere
        decision = self.judge(
            Batch.of(obs), hold=self.world_size > 1, forced=forced, carried=carried
        )
        if loss is not None or not self.waits:  # the loss readers' bar moved, or none holds
            quiet = self.planner.quiet_detectors(obs.step + 1) if self.waits else None
            self.waiting.rebar(quiet)
        return first_to_act(earlier, decision)

    def catch_up(self) -> Decision:
        """Judge the quiet steps still waiting, in order."""
        steps = self.waiting.take()
        return self.judge(Batch.of_waiting(steps, self.rank)) if steps else NOTHING

    def note_stop(self, reason: Finding | None) -> None:
        """Remember ``reason`` as what stopped the run, unless something already did."""
        if self.stopped_by is None:
            self.stopped_by = reason

    def escalate(self, step: int, epoch: int, reason: str) -> None:
        """Run every detector from ``step`` on, and say so."""
        self.planner.changed()
        msg = self.sampler.escalate(step, reason)
        if msg:
            self.ledger.enter(self._sampler_finding(step, epoch, msg))

    def submit(self, findings: list[Finding]) -> Decision:
        """Record findings made outside the detectors and decide on them."""
        for f in findings:
            self.ledger.enter(f)
        return decide(findings, self.stop_on, self.raise_on)

    def judge(
        self,
        batch: Batch,
        *,
        hold: bool = False,
        forced: bool = False,
        carried: frozenset[str] | None = None,
    ) -> Decision:
        """Judge ``batch``, its steps in order, with the outcome of judging them one by
        one: the same findings, at the same steps, in the same order, and the same state
        after. This is the one path by which steps are judged.

        A step that cannot wait is a batch of one: the detectors due there run on its
        observation (``forced``: every detector whose statistics it carries), and what
        they raise is decided on at once (held until the ranks meet when ``hold``). An
        event's observation (a validation's) says which statistics it ``carried``: then
        only the detectors it can feed are gone over.

        Quiet steps that waited (see :mod:`stethoscope.engine.waiting`) come as a batch
        of many. One by one, each would pay for the schedule, the ledger and every
        detector's bookkeeping, from caches its training step has just emptied.
        Together, each detector that reads the loss alone goes over all of the steps in
        turn (taking in at once those its rule finds healthy, see
        :meth:`Detector.absorb`), the bookkeeping is done once, and what a detector
        raised (a finding, a suspicion, a request) is acted on step by step, where it
        would have been. That is the same outcome when the sampler is not hot, so its
        schedule does not move within the steps, and those detectors all run every
        step, so that an escalation on one of the steps changes none of them; otherwise
        the steps are judged as batches of one.
        """
        planner, sampler = self.planner, self.sampler
        waited = batch.waited
        if waited and (sampler.hot or not planner.loss_readers_run_every_step()):
            decision = NOTHING
            for i in range(len(batch)):
                decision = first_to_act(decision, self.judge(batch.alone(i)))
            return decision
        revision, requested = sampler.revision, len(planner.requested)
        notes: list[Finding] = []  # the sampler's: the same on every rank, never forwarded
        numbers = batch.numbers
        if waited:
            detectors = planner.loss_readers()
        else:
            obs = batch[0]
            has = obs.has
            back = sampler.tick(obs.step)
            if back:
                notes.append(self._sampler_finding(obs.step, obs.epoch, back))
            runnable = planner.runnable(obs.step, every=forced)
            if carried is not None:  # an event's: its readers, worked out once
                detectors = planner.event_readers(runnable, carried)
            else:
                detectors = planner.with_arrivals(runnable, has)
        # what each step raised, by its place in the batch, in the detectors' order
        raised: dict[int, list[_Raised]] = {}
        n = len(numbers)
        # the plans ahead follow the state of some detectors (see Planner.changed): what
        # it was before they run here
        changers, finishers, after = planner.plan_changers, planner.finishers, numbers[-1] + 1
        plans_read: list[tuple[Detector, bool, frozenset[str]]] = []
        for d in detectors:
            finishes = d in finishers
            unread = d in changers
            i = 0
            while i < n:
                if finishes and d.finished(numbers[i]):
                    i += 1
                    continue
                if not waited:
                    # a detector runs on what arrived (Detector.runs_on), whatever else it
                    # needs; else only where the one step carries all it needs
                    arrived = d.runs_on and any(map(has, d.runs_on))
                    if not arrived and not all(map(has, d.needs)):
                        if d.blind_to:
                            self._unread(d, numbers[i])
                        break
                    if self.unread:
                        self.unread.pop(d.name, None)
                if unread:
                    plans_read.append((d, d.finished(after), d.wanting(after)))
                    unread = False
                if waited:
                    taken = d.absorb(numbers, batch.losses, batch.lrs, i)
                    if taken > i:  # the steps its rule found healthy, taken in at once
                        i = taken
                        continue
                found = d.update(batch[i] if waited else obs)
                if found or d.suspect or d.request:
                    raised.setdefault(i, []).append(_Raised(d, found))
                i += 1
        if raised or notes or _moved(plans_read, after):
            planner.changed()  # what the detectors raised or became changes the plans ahead
        ledger = self.ledger
        if waited:
            self.losses.saw_losses(batch.losses)
            ledger.saw_steps(numbers)
        else:
            planner.fulfilled(obs.has)
            self.losses.saw(obs)
            ledger.saw_step(obs.step, grads=obs.grad_norm is not None, loss=obs.loss is not None)
        observers = ledger.observers
        decision = NOTHING
        if observers or raised or notes:  # step by step, each where it was
            for i in range(n):
                step_obs = batch[i]
                if observers:
                    ledger.observe(step_obs, planner.sampled_interval(step_obs.step))
                self.last_step = max(self.last_step, step_obs.step)
                if i in raised or notes:  # notes: a batch of one's (the sampler's tick)
                    found = self._conclude(step_obs, raised.get(i, ()), notes, hold=hold)
                    notes = []  # each step's own: an escalation's note is its step's
                    decision = first_to_act(decision, found)
        self.last_step = max(self.last_step, numbers[-1])
        if sampler.revision != revision or len(planner.requested) != requested:
            planner.changed()  # escalated, calmed down or asked for more while acting
        return decision

    def _unread(self, detector: Detector, step: int) -> None:
        """``detector`` was due at ``step`` and the plan asked for what it needs, or
        not: count the first."""
        if detector.needs <= self.planner.plan(step):
            self.unread[detector.name] = self.unread.get(detector.name, 0) + 1

    def _conclude(
        self,
        obs: Observation,
        raised: Sequence[_Raised],
        notes: list[Finding],
        *,
        hold: bool,
    ) -> Decision:
        """Act on what the detectors raised at ``obs``'s step: pass on their requests,
        escalate on an alarm or a suspicion, record the findings and the sampler's notes,
        decide."""
        findings: list[Finding] = []
        alarming: list[Finding] = []  # the warnings and errors the sampler escalates on
        suspects: list[str] = []
        # the detectors a suspicion raises (see Planner.confirmers); None: all of them
        focus: set[str] | None = set()
        said = self.said
        for r in raised:
            findings.extend(r.findings)
            name = r.detector.name
            # A detector that has said its warning has nothing left for an escalation to
            # confirm but a graver one: its suspicions, and findings no graver than what it
            # said, escalate no more (a dead layer suspected again every hundred steps
            # would keep every detector running every step for the rest of the run).
            before = said.get(name)
            graver = [
                f
                for f in r.findings
                if f.severity >= Severity.WARNING and (before is None or f.severity > before)
            ]
            if graver:
                said[name] = max(f.severity for f in graver)
                if r.detector.escalates:
                    alarming.extend(graver)
            if r.suspect and before is None:
                suspects.append(f"{name}: {r.suspect}")
                confirmers = self.planner.confirmers(r.detector)
                focus = None if confirmers is None or focus is None else focus | confirmers
            if r.request:  # for the steps after this one, whatever this one carried
                self.planner.requested |= r.request
        if not findings and not suspects and not notes:  # the healthy step: nothing to do
            return NOTHING
        held = self.held
        if alarming or suspects:
            reason = f"{alarming[0].detector} {alarming[0].severity}" if alarming else suspects[0]
            if hold:
                held.why = held.why or reason
            else:
                # a warning raises every detector: what caused it may lie anywhere
                raised = None if alarming or focus is None else focus
                msg = self.sampler.escalate(obs.step, reason, raised)
                if msg:
                    notes.append(self._sampler_finding(obs.step, obs.epoch, msg))
        for f in findings:
            self.ledger.enter(f, hold=held.findings if hold else None)
        for f in notes:
            self.ledger.enter(f)
        decision = decide(findings, self.stop_on, self.raise_on, self.spared)
        if hold:
            if decision.stop and (
                held.decision is None or (decision.raise_ and not held.decision.raise_)
            ):
                held.decision = decision
            held.spared.extend(decision.spared)  # for the ranks to agree on
            return Decision()
        if decision.stop:
            self.note_stop(decision.reason)
        return decision

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


def _moved(read: list[tuple[Detector, bool, frozenset[str]]], step: int) -> bool:
    """Whether a detector's part in the plans changed since ``read`` was taken, each with
    whether it was finished at ``step`` and what it wanted there. Judging only ever ends
    a detector's part (it finishes, stops wanting), so the plan of one step ahead tells;
    a detector's part that the step alone decides was planned already."""
    return any(d.finished(step) != done or d.wanting(step) != wanted for d, done, wanted in read)


class Batch:
    """Steps judged together, oldest first: one step's observation (a step that cannot
    wait), or the quiet steps that waited, kept as their numbers, ``(step, epoch, loss,
    lr)``, each made an :class:`Observation` only when asked for (a step every loss
    reader took in at once, and no sink observes, needs none).

    Make one with :meth:`of` or :meth:`of_waiting`.
    """

    __slots__ = ("_made", "_rank", "_steps", "losses", "lrs", "numbers", "waited")

    def __init__(self, steps: Sequence[Waiting], rank: int, made: dict[int, Observation]) -> None:
        self._steps, self._rank, self._made = steps, rank, made
        #: Whether these are quiet steps that waited (their losses finite, each under the
        #: detectors' bars: see ``Detector.waits_below``).
        self.waited = not made
        #: The steps' numbers, oldest first.
        self.numbers = [step for step, _, _, _ in steps] if self.waited else [made[0].step]
        self.losses = [loss for _, _, loss, _ in steps] if self.waited else []
        self.lrs = [lr for _, _, _, lr in steps] if self.waited else []

    @classmethod
    def of(cls, obs: Observation) -> Batch:
        """A batch of one: a step that cannot wait."""
        return cls((), obs.rank, {0: obs})

    @classmethod
    def of_waiting(cls, steps: Sequence[Waiting], rank: int) -> Batch:
        """The quiet steps that waited, ``(step, epoch, loss, lr)`` oldest first."""
        return cls(steps, rank, {})

    def __len__(self) -> int:
        return len(self.numbers)

    def __getitem__(self, i: int) -> Observation:
        obs = self._made.get(i)
        if obs is None:
            step, epoch, loss, lr = self._steps[i]
            obs = self._made[i] = Observation.of_loss(step, epoch, self._rank, lr, loss)
        return obs

    def alone(self, i: int) -> Batch:
        """Step ``i`` as a batch of one."""
        return Batch.of(self[i])


class _Raised:
    """What a detector raised at one step while judging steps together: its findings, and
    its suspicion and request as they stood after that step."""

    __slots__ = ("detector", "findings", "request", "suspect")

    def __init__(self, detector: Detector, findings: list[Finding]) -> None:
        self.detector, self.findings = detector, findings
        self.suspect, self.request = detector.suspect, detector.request
