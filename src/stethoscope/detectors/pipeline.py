"""Silent pipeline bugs: mistakes in how training is wired that leave the loss finite and
quiet while the model learns less than it should."""

from __future__ import annotations

import math

from stethoscope.detectors._persistent import Persistent
from stethoscope.detectors._stats import is_finite, push
from stethoscope.detectors.base import (
    Detector,
    Losses,
    Rates,
    SetupCheck,
    Steps,
    check_fraction,
    check_positive,
)
from stethoscope.findings import Finding
from stethoscope.observation import Observation, global_norm

__all__ = [
    "BroadcastLoss",
    "CollapsedLearningRate",
    "EvalMode",
    "LossDividedTwice",
    "UnzeroedGradients",
]


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


class EvalMode(Persistent):
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


class UnzeroedGradients(Persistent):
    """Gradients that are never zeroed: each step's gradient is the running sum of every
    gradient before it, so the updates grow and point where the run has been.

    Rule: on ``patience`` sampled steps in a row, at least ``fraction`` of the parameters
    the optimizers stepped still held a non-zero gradient from before the step at every
    backward pass of the step before their optimizer stepped them: a warning, once.
    Zeroing (``zero_grad()``, to None or to zeros) leaves none; accumulating gradients
    over micro-batches on purpose zeroes before the step's first backward pass; LBFGS
    zeroes before each call of its closure; each player of a game zeroes its own before
    its own backward pass, however many backward passes of the others come first.
    Parameters no optimizer stepped in the step are not counted, whatever gradient they
    still hold: a layer trained earlier in layer-wise training, or one in no optimizer
    (``frozen_weights``' finding).

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
        self.fraction = float(fraction)
        super().__init__(patience=patience)

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
                "stepped still held a gradient from before the step at each of its backward "
                f"passes, on {st['streak']} sampled steps in a row (to step {obs.step}), so "
                "each step applies the running sum of every gradient so far; call "
                "optimizer.zero_grad() every step (in manual optimization, before "
                "self.manual_backward).",
                value=float(stale),
                threshold=self.fraction * stepped,
                where="gradients",
            )
        ]


class BroadcastLoss(Persistent):
    """The loss compares a prediction and a target of different shapes that broadcast:
    ``mse_loss`` of ``(N, 1)`` against ``(N,)`` averages all ``N x N`` pairs, every
    prediction against every target, so the model learns to predict their mean.

    Rule: on ``patience`` sampled steps in a row, one of the loss's last operations (an
    elementwise difference, sum, product or quotient, or a loss torch broadcasts first:
    ``mse_loss``, ``l1_loss``, ``smooth_l1_loss``, ``huber_loss``) made an ``(M, M)``
    square of an ``(M, 1)`` prediction and a target that takes no gradient (or a 1-D one
    of ``M``): a warning, once. A pairwise operand of shape ``(1, M)`` (a ranking loss)
    is meant as one and is not counted. It is read from the loss's autograd graph, on
    the host.

    Sources: torch warns of it in ``mse_loss`` alone (a warning often filtered), and not
    at all in a loss written by hand; Keras' losses bring both to the same rank first, so
    ``fit`` cannot make it.

    Args:
        patience: Sampled steps in a row.
    """

    name = "broadcast_loss"
    needs = frozenset({"loss_graph"})
    base_interval = 16
    advice = "give the prediction and the target the same shape"

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        if st["fired"] or not self._held(bool(obs.loss_broadcast)):
            return []
        return [
            self.finding(
                obs,
                "warning",
                f"The loss broadcasts the prediction against the target on {st['streak']} "
                f"sampled steps in a row (to step {obs.step}): {obs.loss_broadcast}, so it "
                "averages every prediction against every target and the model learns to "
                "predict their mean; give both the same shape (pred.squeeze(-1), or "
                "target.unsqueeze(-1)).",
                value=1.0,
                threshold=None,
                where="loss",
            )
        ]


class LossDividedTwice(SetupCheck):
    """A loss divided twice by the batches a step accumulates: the gradients applied are
    a fraction of those the loss asks for, and nothing else says so.

    Rule: where the training divides each batch's loss by the number of batches a step
    accumulates and then by a number again (``TrainingSetup.divided_again``), a finding
    at the first step whose gradients are measured, giving their norm: a warning where
    the gradients' scale matters (an optimizer that is not adaptive, such as SGD, whose
    steps shrink by that number; gradient clipping, whose threshold acts on the true
    gradients at a norm that many times larger), an info under Adam and its kin without
    clipping, whose steps barely change. It applies to no other run, and costs nothing
    there.

    Sources: Lightning's automatic optimization divides each batch's loss by
    ``accumulate_grad_batches``; under ``DeepSpeedStrategy`` it hands that loss to the
    engine's backward, which divides it by its ``gradient_accumulation_steps``, the same
    number (lightning 2.6, deepspeed 0.19). Keras' ``gradient_accumulation_steps``
    averages once.
    """

    name = "loss_divided_twice"
    advice = "fold the accumulation into the batch size"

    def applies(self) -> bool:
        return self.setup.divided_again > 1

    def _said(self, obs: Observation) -> Finding:
        setup, k = self.setup, self.setup.divided_again
        total = global_norm(obs.grad_norm)
        matters = not setup.adaptive or setup.clipping is not None
        if setup.adaptive:
            effect = (
                f"an adaptive optimizer's steps barely change (its epsilon weighs {k} times more)"
            )
        else:
            effect = f"the optimizer's steps are {k} times smaller than asked"
        if setup.clipping is not None:
            effect += f", and {setup.clipping} clips at a true norm {k} times larger"
        return self.finding(
            obs,
            "warning" if matters else "info",
            f"The loss is divided twice by the {k} batches each step accumulates: "
            f"Lightning divides each batch's loss by accumulate_grad_batches={k} and "
            f"DeepSpeed's engine divides it by its gradient_accumulation_steps={k} "
            f"again, so the gradients applied (norm {total:.3g} at step {obs.step}) "
            f"are 1/{k} of the mean over the step's batches and {effect}; fold the "
            "accumulation into the batch size, or return the loss times "
            "self.trainer.accumulate_grad_batches from training_step and leave this "
            "detector out (default_detectors(loss_divided_twice=None)), which cannot "
            "see that.",
            value=float(k),
            threshold=1.0,
            where="loss",
        )
