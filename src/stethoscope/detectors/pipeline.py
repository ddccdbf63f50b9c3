"""Silent pipeline bugs: mistakes in how training is wired that leave the loss finite and
quiet while the model learns less than it should."""

from __future__ import annotations

import math

from stethoscope.detectors._stats import is_finite, push
from stethoscope.detectors.base import (
    Detector,
    Losses,
    Rates,
    Steps,
    check_fraction,
    check_positive,
)
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["CollapsedLearningRate", "EvalMode", "UnzeroedGradients"]


class CollapsedLearningRate(Detector):
    """The learning rate has collapsed while the loss is still near where it started: a
    schedule meant per epoch stepped per batch (or a decay far too fast).

    Rule: the peak learning rate is the largest seen (a warm-up climbs to it). When the
    rate falls below ``drop`` times its peak while the mean of the last ``window``
    losses is still above ``still_high`` of the initial level (the mean of the first
    ``window`` losses, when positive), it is a warning. It is judged once, at the
    collapse. A schedule that anneals to
    nothing at the end of a run that learned (cosine, one-cycle) has left that level
    behind by then.

    Sources: a ``StepLR(step_size=30, gamma=0.1)`` written for epochs but stepped every
    batch (``interval="step"`` in Lightning's ``configure_optimizers``, or
    ``scheduler.step()`` in the training step) has cut the rate a thousandfold after 90
    batches; the loss then freezes where it was and nothing blows up.

    Args:
        drop: The fraction of the peak rate below which it has collapsed.
        still_high: The fraction of the initial loss level above which the loss is
            still where it started.
        window: Losses in the initial level and in the recent one.
    """

    name = "collapsed_lr"
    needs = frozenset({"loss"})
    base_interval = 1
    assumes_falling_loss = True
    advice = "step the scheduler at the cadence it was written for"

    def __init__(self, *, drop: float = 1e-3, still_high: float = 0.5, window: int = 20) -> None:
        check_fraction(self.name, "drop", drop)
        check_fraction(self.name, "still_high", still_high)
        check_positive(self.name, "window", window, integer=True)
        self.drop, self.still_high, self.window = float(drop), float(still_high), window
        super().__init__()

    def _initial_state(self) -> dict:
        # first: the first losses (until ``window`` of them); recent: the last ones
        return {"peak": None, "first": [], "recent": [], "judged": False}

    def finished(self, step: int) -> bool:
        return self.state["judged"]

    def waits_below(self, steps: int) -> float | None:
        return math.inf  # a warning, and no suspicion: it can wait

    def absorb(self, steps: Steps, losses: Losses, lrs: Rates, start: int) -> int:
        st = self.state
        first, recent, size = st["first"], st["recent"], self.window
        for i in range(start, len(losses)):
            lr, peak = lrs[i], st["peak"]
            if lr is not None and peak is not None and lr < self.drop * peak:
                return i  # collapsed: the rule judges the loss
            if lr is not None and (peak is None or lr > peak):
                st["peak"] = float(lr)
            loss = float(losses[i])
            if len(first) < size:
                first.append(loss)
            push(recent, loss, size)
        return len(losses)

    def _update(self, obs: Observation) -> list[Finding]:
        loss, lr = obs.loss, obs.lr
        if self.state["judged"] or not is_finite(loss) or self.quiet(obs.step, loss, lr):
            return []
        st = self.state
        push(st["recent"], float(loss), self.window)
        first = st["first"]
        if len(first) < self.window:
            return []
        initial = sum(first) / len(first)
        level = sum(st["recent"]) / len(st["recent"])
        st["judged"] = True  # once: a rate that collapsed after the loss fell is the plan
        if initial <= 0 or level <= self.still_high * initial:
            return []
        return [
            self.finding(
                obs,
                "warning",
                f"The learning rate collapsed to {lr:.3g} by step {obs.step}, under "
                f"{self.drop:g} of its peak {st['peak']:.3g}, while the loss is still "
                f"{level:.4g}, {level / initial:.0%} of where it started: a schedule "
                "written for epochs is being stepped every batch, or decays far too fast; "
                "step it at the cadence it was written for: interval='epoch' in "
                "configure_optimizers, or scheduler.step() once per epoch (a Keras "
                "schedule's decay_steps counts batches).",
                value=lr,
                threshold=self.drop * st["peak"],
                where="lr",
            )
        ]


class _Persistent(Detector):
    """A mistake seen on sampled steps: it is named once it has held on ``patience`` of
    them in a row, and then the detector has done."""

    patience: int

    def _initial_state(self) -> dict:
        return {"streak": 0, "fired": False}

    def finished(self, step: int) -> bool:
        return self.state["fired"]

    def _held(self, seen: bool) -> bool:
        """Count a step that ``seen`` the mistake or not; True the step it has held on
        ``patience`` in a row (once)."""
        st = self.state
        st["streak"] = st["streak"] + 1 if seen else 0
        if not seen or st["fired"] or st["streak"] < self.patience:
            return False
        st["fired"] = True
        return True


class EvalMode(_Persistent):
    """The model trains in eval mode: dropout is off and batch norm normalises by its
    running statistics, so the model trains as another model than the one it is.

    Rule: on ``patience`` sampled steps in a row, the model itself, a dropout module or
    a batch norm whose scale and shift still train was in eval mode at the start of the
    training step: a warning, once. A batch norm frozen on purpose (its parameters not
    trained, the usual way to keep its statistics while fine-tuning) is not counted.

    Sources: a side evaluation inside the training step, or a hook that calls
    ``.eval()`` and never ``.train()``; the framework puts the model back in train mode
    only after its next validation. Keras passes ``training=True`` to every layer in
    ``fit``, so there the mistake cannot be made (a ``BatchNormalization`` with
    ``trainable=False`` runs in inference mode by design).

    Args:
        patience: Sampled steps in a row in eval mode.
    """

    name = "eval_mode"
    needs = frozenset({"train_mode"})
    base_interval = 16
    advice = "call model.train() after an evaluation inside training"

    def __init__(self, *, patience: int = 2) -> None:
        check_positive(self.name, "patience", patience, integer=True)
        self.patience = patience
        super().__init__()

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        off = obs.eval_modules
        if not self._held(bool(off)):
            if off and st["streak"] == 1 and not st["fired"]:
                self.suspect = f"{off[0]} in eval mode during training"
            return []
        whole = off[0] == "<model>"
        more = f" and {len(off) - 3} more" if len(off) > 3 else ""
        what = "The whole model" if whole else f"The model with {', '.join(off[:3])}{more}"
        return [
            self.finding(
                obs,
                "warning",
                f"{what} trained in eval mode on {st['streak']} "
                f"sampled steps in a row (to step {obs.step}): dropout is off and batch "
                "norm uses its running statistics, so the model that trains is not the one "
                "you built; something called .eval() during training (a side evaluation in "
                "the training step, or a hook) and never .train(); call self.train() after "
                "it.",
                value=float(len(off)),
                threshold=0.0,
                where="<model>" if whole else off[0],
            )
        ]


class UnzeroedGradients(_Persistent):
    """Gradients that are never zeroed: each step's gradient is the running sum of every
    gradient before it, so the updates grow and point where the run has been.

    Rule: on ``patience`` sampled steps in a row, at least ``fraction`` of the parameters
    the optimizers stepped still held a non-zero gradient from before the step when its
    first backward pass began: a warning, once. Zeroing (``zero_grad()``, to None or to
    zeros) leaves none; accumulating gradients over micro-batches on purpose zeroes at
    the start of each step, and so does a game whose players each zero their own before
    their backward pass (the first one finds the first player's zeroed).

    Sources: manual optimization (or a custom loop) without ``zero_grad``; Keras' ``fit``
    takes each step's gradients afresh from the tape, so there the mistake cannot be made.

    Args:
        fraction: The share of the stepped parameters with a gradient left over.
        patience: Sampled steps in a row.
    """

    name = "unzeroed_gradients"
    needs = frozenset({"stale_grads", "grads"})
    base_interval = 16
    advice = "call optimizer.zero_grad() every step"

    def __init__(self, *, fraction: float = 0.9, patience: int = 2) -> None:
        check_fraction(self.name, "fraction", fraction)
        check_positive(self.name, "patience", patience, integer=True)
        self.fraction, self.patience = float(fraction), patience
        super().__init__()

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        if st["fired"]:
            return []
        stepped = len(obs.grad_norm)
        stale = obs.stale_grads
        if not self._held(stepped > 0 and stale >= self.fraction * stepped):
            return []
        return [
            self.finding(
                obs,
                "warning",
                f"Gradients are never zeroed: {stale:.0f} of the {stepped} parameters "
                "stepped still held a gradient from before the step when its backward pass "
                f"began, on {st['streak']} sampled steps in a row (to step {obs.step}), so "
                "each step applies the running sum of every gradient so far; call "
                "optimizer.zero_grad() every step (in manual optimization, before "
                "self.manual_backward).",
                value=float(stale),
                threshold=self.fraction * stepped,
                where="gradients",
            )
        ]
