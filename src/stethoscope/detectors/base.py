"""The detector contract: observations in, findings out, state a plain dict."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, ClassVar

from stethoscope.advice import TrainingSetup
from stethoscope.findings import Finding, Severity
from stethoscope.observation import Observation
from stethoscope.statistics import STATISTICS

__all__ = ["BARS", "Detector", "Losses", "Rates", "SetupCheck", "Steps"]

#: The numbers a detector can keep a bar of for the recovery ladder (``Detector.bars``):
#: the step's loss, and the global norm of its gradients.
BARS = frozenset({"loss", "grad_norm"})

#: What :meth:`Detector.absorb` is handed of the steps that waited, oldest first: their
#: numbers, their losses and their learning rates (None: unknown).
Steps = Sequence[int]
Losses = Sequence[float]
Rates = Sequence[float | None]


class Detector:
    """Base class for detectors, in the spirit of a torchmetrics ``Metric``.

    A detector receives :class:`Observation` objects (host-side numbers only),
    returns findings, can reset, and keeps its state as a dict of primitives so
    a resumed run continues its baselines.

    Subclasses set ``name`` (stable snake_case), ``needs`` (the statistics it reads,
    names declared in :mod:`stethoscope.statistics`),
    ``base_interval`` (how often it runs on a healthy run, in steps), declare
    their state in ``_initial_state`` and implement ``_update``.

    After each ``update``, ``suspect`` holds a short reason when the detector saw
    something unusual that is not (yet) a finding; the sampler escalates on it.
    ``request`` names deeper statistics (e.g. ``"trace"``) it wants on the next
    steps, until an observation carries them.
    """

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()
    #: Statistics read when present, planned whenever the detector is due (never required).
    wants: ClassVar[frozenset[str]] = frozenset()
    base_interval: ClassVar[int] = 1
    #: A few words for the summary table: the usual fix.
    advice: ClassVar[str] = ""
    #: Whether the rule assumes the training loss should fall: off in a game (see
    #: ``TrainingSetup.adversarial``), where a player's loss is not meant to.
    assumes_falling_loss: ClassVar[bool] = False
    #: Deeper statistics it may ask for (:attr:`request`) when something goes wrong, so
    #: that an adapter prepares their probes (the forward trace, say).
    requests: ClassVar[frozenset[str]] = frozenset()
    #: Statistics measured on the first step of every epoch and of every run (fresh or
    #: resumed), whatever the schedule: what a rule that compares epochs reads there.
    at_epoch_start: ClassVar[frozenset[str]] = frozenset()
    #: Statistics on whose arrival it runs, due or not, and whatever else it needs: what
    #: an epoch's first step or a validation brings it (see :attr:`at_epoch_start`).
    runs_on: ClassVar[frozenset[str]] = frozenset()
    #: What the run lacks when the detector's statistics never arrive although they
    #: were asked for (no integer class labels in the batches, say): then it stays
    #: silent and the summary says so, in these words. Empty: it says nothing.
    blind_to: ClassVar[str] = ""
    #: The number whose bar it keeps for the recovery ladder, which skips a step past it
    #: before its update (:data:`BARS`), or None. See :meth:`threshold`.
    bars: ClassVar[str | None] = None
    #: Whether its warnings and errors escalate the sampler (every detector run on every
    #: step for a while): not for a finding about the training's setup, which no closer
    #: look at the next steps would tell more of.
    escalates: ClassVar[bool] = True
    #: Whether it is left out of :func:`~stethoscope.detectors.default_detectors` unless
    #: named there: a report that costs something and that a run asks for.
    opt_in: ClassVar[bool] = False
    #: What the training already does (clipping, precision, a schedule), so that the
    #: findings' advice does not repeat it; set by the monitor when training starts.
    setup: TrainingSetup = TrainingSetup()

    def __init__(self) -> None:
        unknown = set(self.needs | self.wants | self.requests | self.at_epoch_start)
        unknown |= self.runs_on
        unknown -= set(STATISTICS)
        if self.bars is not None and self.bars not in BARS:
            unknown.add(self.bars)
        if not self.name or unknown:  # a programming error in a subclass, not user input
            raise TypeError(
                f"{type(self).__name__} needs a name, and statistics among {sorted(STATISTICS)} "
                f"(not {sorted(unknown)})"
            )
        self.suspect: str | None = None
        self.request: frozenset[str] = frozenset()
        self.reset()

    # -- contract -------------------------------------------------------------
    def _initial_state(self) -> dict[str, Any]:
        """The state of a fresh detector: primitives, lists and dicts only."""
        return {}

    def _update(self, obs: Observation) -> list[Finding]:
        raise NotImplementedError

    # -- public API -----------------------------------------------------------
    def current_advice(self) -> str:
        """The few words of :attr:`advice` for this run's summary table: a detector whose
        usual fix depends on the training (clipping, say) words it from :attr:`setup`."""
        return self.advice

    def advice_for(self, finding: Finding) -> str:
        """The few words of advice for the summary row whose worst finding is ``finding``:
        :meth:`current_advice`, unless the detector names problems of more than one kind
        (where the finding's ``where`` says which)."""
        return self.current_advice()

    def applies(self) -> bool:
        """Whether the rule applies to this run at all, from :attr:`setup` alone (so every
        rank of a distributed run answers alike): a precision rule in a float32 run does
        not. One that does not is never run, and its statistics never planned."""
        return True

    def not_applying_because(self) -> str:
        """Why the rule does not :meth:`apply <applies>` to this run, in a few words the
        monitor tells the user once, where the run has what the rule is about but the rule
        cannot judge it (a closure optimizer's updates); empty: nothing to tell (a
        precision rule in a float32 run)."""
        return ""

    @classmethod
    def can_finish(cls) -> bool:
        """Whether :meth:`finished` can ever be true for this class (it, or
        :meth:`applies`, is its own): the planning caches what it cannot change."""
        return cls.finished is not Detector.finished or cls.applies is not Detector.applies

    def finished(self, step: int) -> bool:
        """Whether the detector has nothing left to judge from ``step`` on (then it is no
        longer run, and its probes no longer planned); by default, whether it does not
        :meth:`apply <applies>` to the run."""
        return not self.applies()

    def wanting(self, step: int) -> frozenset[str]:
        """The statistics of :attr:`wants` still wanted at ``step`` (planned whenever the
        detector is due): all of them, unless a detector that has read enough of one (the
        labels, counted once at the start) stops asking for it."""
        return self.wants

    def threshold(self) -> float | None:
        """The bar of :attr:`bars` for the next step: a value past it is what the rule
        calls bad (None: no bar yet, or none kept)."""
        return None

    def passed_by(self, value: float) -> float | None:
        """:meth:`threshold` if ``value`` is past it, else None: what the recovery ladder
        asks on every step (a detector may answer a healthy step more cheaply)."""
        bar = self.threshold()
        return bar if bar is not None and value > bar else None

    def waits_below(self, steps: int) -> float | None:
        """The loss below which a quiet step may wait to be judged (see
        :mod:`stethoscope.engine.waiting`): over the next ``steps`` steps, finite losses
        under it can neither stop the run nor skip a step nor raise a suspicion here, so
        this detector may see them a few steps late with the same outcome. ``math.inf``: any
        finite loss may wait. None (the default, since a detector's rule is its own):
        every loss is judged at once."""
        return None

    def absorb(self, steps: Steps, losses: Losses, lrs: Rates, start: int) -> int:
        """The rule's healthy steps, taken in: from index ``start`` on, each finite loss of
        a step that measured nothing else on which the rule can raise nothing (no finding,
        suspicion or request) is taken in, doing to the state what the rule does; the
        first one where it may is not, and its index is returned (``start``: none taken).

        A loss reader whose rule has such a healthy step states it here, once, as a loop:
        the quiet steps that waited (see :mod:`stethoscope.engine.waiting`) go through it
        16 at a time without an :class:`Observation` each, for the waiting steps' Python
        is a quiet step's largest cost, and its ``_update`` begins with :meth:`quiet`,
        the same rule for one step. It is not offered a step the detector has
        :meth:`finished` at. The default takes none.

        Args:
            steps, losses, lrs: The steps' numbers, oldest first (the losses finite).
            start: Where to begin.
        """
        return start

    def quiet(self, step: int, loss: float, lr: float | None) -> bool:
        """Whether :meth:`absorb` takes in this one step (a finite ``loss``): then the rule
        has done with it."""
        return self.absorb((step,), (loss,), (lr,), 0) == 1

    def update(self, obs: Observation) -> list[Finding]:
        """Judge one observation; return the findings it raises (often none)."""
        self.suspect = None
        self.request = frozenset()
        return self._update(obs)

    def reset(self) -> None:
        """Forget everything seen so far."""
        self.state: dict[str, Any] = self._initial_state()
        self.suspect = None
        self.request = frozenset()

    def state_dict(self) -> dict[str, Any]:
        """A deep copy of the state (primitives), for checkpoints."""
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state written by :meth:`state_dict`; unknown keys are ignored."""
        fresh = self._initial_state()
        fresh.update({k: copy.deepcopy(v) for k, v in state.items() if k in fresh})
        self.state = fresh

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # -- helpers for subclasses -------------------------------------------------
    def finding(
        self,
        obs: Observation,
        severity: Severity | str,
        message: str,
        *,
        value: float | None = None,
        threshold: float | None = None,
        where: str | None = None,
        rank: int | None = None,
    ) -> Finding:
        """A finding of this detector at ``obs``'s step, on ``obs``'s rank unless ``rank``
        names the rank it is about (a fact gathered from every rank)."""
        return Finding(
            step=obs.step,
            epoch=obs.epoch,
            detector=self.name,
            severity=Severity.parse(severity),
            message=message,
            value=value,
            threshold=threshold,
            where=where,
            rank=obs.rank if rank is None else rank,
        )


class SetupCheck(Detector):
    """A rule on how the training is set up (:attr:`setup`), not on its course: said once,
    at the first step whose gradients are measured, and then finished.

    It reads the gradients at their own interval, so it plans no measurement of its own,
    and rank zero alone judges it, the other ranks planning alike. It does not escalate:
    the next steps would tell nothing more. A subclass gives :meth:`applies`, from the
    setup alone, and :meth:`_said`, the finding.
    """

    needs: ClassVar[frozenset[str]] = frozenset({"grads"})
    base_interval: ClassVar[int] = 16  # the gradient detectors' own
    escalates: ClassVar[bool] = False

    def _initial_state(self) -> dict[str, Any]:
        return {"judged": False}

    def finished(self, step: int) -> bool:
        return self.state["judged"] or not self.applies()

    def _update(self, obs: Observation) -> list[Finding]:
        if self.finished(obs.step) or obs.grad_norm is None:
            return []
        self.state["judged"] = True
        return [self._said(obs)]

    def _said(self, obs: Observation) -> Finding:
        """The finding, at ``obs``, the first step whose gradients were measured."""
        raise NotImplementedError


def check_positive(owner: str, name: str, value: float, *, integer: bool = False) -> None:
    """Raise ValueError naming ``value`` unless it is a positive (integer) number."""
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not value > 0:
        kind = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{owner}: {name}={value!r} must be {kind}")


def check_fraction(owner: str, name: str, value: float) -> None:
    """Raise ValueError naming ``value`` unless 0 < value < 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{owner}: {name}={value!r} must be a number strictly between 0 and 1")
