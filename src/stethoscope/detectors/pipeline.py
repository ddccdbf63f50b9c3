"""Silent pipeline bugs: mistakes in how training is wired that leave the loss finite and
quiet while the model learns less than it should."""

from __future__ import annotations

import math

from stethoscope.detectors._stats import is_finite, push
from stethoscope.detectors.base import Detector, check_fraction, check_positive
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["CollapsedLearningRate"]


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

    def quiet(self, step: int, loss: float, lr: float | None) -> bool:
        st = self.state
        peak = st["peak"]
        if lr is not None and peak is not None and lr < self.drop * peak:
            return False  # collapsed: the rule judges the loss
        if lr is not None and (peak is None or lr > peak):
            st["peak"] = float(lr)
        first = st["first"]
        if len(first) < self.window:
            first.append(float(loss))
        push(st["recent"], float(loss), self.window)
        return True

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
