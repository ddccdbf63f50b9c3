"""Silent pipeline bugs: mistakes in how training is wired that leave the loss finite and
quiet while the model learns less than it should."""

from __future__ import annotations

import math

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
    "LogitsMismatch",
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


class _Persistent(Detector):
    """A mistake seen on sampled steps: it is named once it has held on ``patience`` of
    them in a row, and then the detector has done."""

    def __init__(self, *, patience: int = 2) -> None:
        check_positive(self.name, "patience", patience, integer=True)
        self.patience = patience
        super().__init__()

    def _initial_state(self) -> dict:
        return {"streak": 0, "fired": False, "since": 0}

    def finished(self, step: int) -> bool:
        return self.state["fired"]

    def _held(self, seen: bool, *, step: int = 0, span: int = 0) -> bool:
        """Count a step that ``seen`` the mistake or not; True the step it has held on
        ``patience`` in a row (once), and on every sampled step from ``span`` steps
        before ``step`` at least."""
        st = self.state
        if seen and st["streak"] == 0:
            st["since"] = step
        st["streak"] = st["streak"] + 1 if seen else 0
        if not seen or st["fired"] or st["streak"] < self.patience:
            return False
        if step - st.get("since", step) < span:
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


def probability_floor(classes: int) -> float:
    """The least cross-entropy of ``classes`` classes whose logits are probabilities:
    ``-p_y + log(sum(exp(p)))`` over the simplex is least at a one-hot ``p``, where it is
    ``log(e + classes - 1) - 1`` (1.46 for 10 classes, 0.74 for 4)."""
    return math.log(math.e + classes - 1) - 1


#: The most label smoothing a loss is taken to mix in (``label_smoothing=0.1`` is usual).
SMOOTHING = 0.5


def _matches(loss: float, candidate: float | None, other: float | None) -> bool:
    """Whether ``loss`` is ``candidate`` (within float rounding) and not ``other``."""
    if candidate is None or not math.isfinite(candidate):
        return False
    tolerance = 1e-3 * max(abs(candidate), 1e-3)
    if abs(loss - candidate) > tolerance:
        return False
    return other is None or not math.isfinite(other) or abs(loss - other) > 10 * tolerance


def _apart(loss: float, one: float | None, other: float | None) -> bool:
    """Whether two ways of taking the output give losses far apart (ten times float
    rounding) on this step: where they agree (a fresh model's), no step tells them apart."""
    if one is None or other is None or not (math.isfinite(one) and math.isfinite(other)):
        return False
    return abs(one - other) > 10 * 1e-3 * max(abs(loss), 1e-3)


def _smoothing(
    loss: float, at_labels: float | None, uniform: float | None, held: list | None
) -> list | None:
    """The label smoothings (an interval within [0, :data:`SMOOTHING`]) for which
    ``loss`` is ``(1 - e) * at_labels + e * uniform`` on this step and on every earlier
    step of ``held`` (the interval so far; None at the start): None when there is none,
    which rules that way of taking the output out. ``uniform`` unmeasured: 0 alone."""
    lo, hi = held if held is not None else (0.0, SMOOTHING)
    if at_labels is None or not math.isfinite(at_labels):
        return None
    tolerance = 1e-3 * max(abs(loss), 1e-3)
    gap = (uniform - at_labels) if uniform is not None and math.isfinite(uniform) else 0.0
    if abs(gap) <= tolerance:  # the two agree: the loss must be at_labels, any smoothing
        return [lo, hi] if abs(loss - at_labels) <= 2 * tolerance else None
    e, spread = (loss - at_labels) / gap, tolerance / abs(gap)
    lo, hi = max(lo, e - spread), min(hi, e + spread)
    return [lo, hi] if lo <= hi else None


class LogitsMismatch(_Persistent):
    """The loss is fed the wrong kind of output: probabilities where it expects logits (a
    softmax before ``CrossEntropyLoss``, or a Keras softmax output with
    ``from_logits=True``), or logits where it expects probabilities (a Keras linear output
    with ``from_logits=False``, the default; raw scores fed to ``NLLLoss``).

    Rule: on ``patience`` sampled steps in a row (a warning, once), whether every row the
    model outputs is probabilities (non-negative and summing to 1; one column: within
    [0, 1]) is set against what the loss takes. One column within [0, 1] fed to a loss
    that takes logits must hold on every sampled step for ``one_column_span`` steps as
    well: a fresh model's one logit can lie there on every row, and leaves as it learns,
    where a sigmoid's never does. (Measured on a small GAN: for one initialisation in
    twenty, every output of its discriminator on the generator's samples lay within
    [0, 1] on the first five steps, and on and off until step 62.)

    - where the loss says so (Keras' cross-entropies, by ``from_logits``): probabilities
      fed to a loss that takes logits, or anything else fed to one that takes
      probabilities;
    - where it does not (a loss computed in a Lightning training step), the training
      loss is set against what it would be for each way of taking the output, computed
      from the same output and the batch's class labels, each as it is or label-smoothed
      by one constant up to :data:`SMOOTHING` (between its cross-entropy at the labels
      and against the uniform distribution) on every sampled step, where the other
      way was ruled out on one of them: probabilities whose loss is their cross-entropy
      as logits (and not the log-likelihood of the probabilities) went through a softmax
      twice, whatever module or function made them; logits whose loss is the
      cross-entropy of their softmax taken as logits (and not of themselves) went
      through a softmax written after the model's last module (in ``forward`` or in the
      training step) and then the loss's own; logits whose loss is their negative mean
      at the labels (``nll_loss`` of raw scores, and not their cross-entropy) were never
      log-softmaxed. The classes lie on the last axis, or on the second of a sequence's
      ``(N, C, T)`` scores. A loss that is none of these (regularised, class-weighted) is
      left alone.

    Sources: softmax-then-cross-entropy is among the commonest silent bugs (its loss
    falls a little, then stalls above a floor it cannot pass); Keras warns of a softmax
    output with ``from_logits=True`` only when it can see the op, and never of the
    reverse, whose loss rescales the outputs to sum to one and trains on nonsense.

    Args:
        patience: Sampled steps in a row.
    """

    name = "logits_mismatch"
    needs = frozenset({"predictions"})
    base_interval = 16
    #: Steps over which one column within [0, 1], fed to a loss that takes logits, must
    #: hold on every sampled step before it is taken for a sigmoid's probabilities.
    one_column_span = 128
    advice = "feed the loss what it takes: logits, or set from_logits"
    blind_to = "the model's output was not seen (the training step calls no model)"
    #: How the loss is being read (see _fed_in_the_step): "" as a mean over the batch,
    #: "sum:" as a sum; each reading keeps its own smoothings.
    _reading = ""

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        if st["fired"] or obs.output_probs is None:
            return []
        probs, expects = obs.output_probs == 1.0, obs.loss_expects
        loss = obs.loss if is_finite(obs.loss) else None
        why = None
        if expects == "logits" and probs:
            why = (
                "the model outputs probabilities (a softmax or sigmoid last) to a loss set "
                "with from_logits=True, which applies its own, so training sees the "
                "softmax of a softmax and its gradients shrink; drop the last activation, "
                "or set from_logits=False"
            )
        elif expects == "probabilities" and not probs:
            why = (
                "the model outputs logits (rows that are not probabilities: no softmax or "
                "sigmoid last) to a loss set with from_logits=False, the default, which "
                "rescales them as if they were probabilities and trains on nonsense; set "
                "from_logits=True in the loss, or end the model with a softmax"
            )
        elif not expects and loss is not None:
            why = self._fed_in_the_step(obs, loss, probs)
        # a fresh model's logits can lie within [0, 1] and leave as it learns; a
        # sigmoid's stay there (Keras' one column, and any output a binary loss takes)
        unit = not expects and obs.output_in_unit == 1.0 and obs.bce_as_logits is not None
        one_column = (expects == "logits" and probs and obs.output_width == 1) or unit
        span = self.one_column_span if one_column else 0
        if not self._held(why is not None, step=obs.step, span=span):
            return []
        return [
            self.finding(
                obs,
                "warning",
                f"The loss is fed the wrong kind of output on {st['streak']} sampled steps "
                f"in a row (to step {obs.step}): {why}.",
                value=float(obs.output_probs),
                threshold=None,
                where="loss",
            )
        ]

    def _initial_state(self) -> dict:
        # smoothing: per way of taking the output, the label smoothings its loss has fit
        # on every sampled step so far ([lo, hi]), or None once one step ruled it out
        return {**super()._initial_state(), "smoothing": {}}

    def _consistent(self, way: str, loss: float, at_labels, uniform) -> bool:
        """Whether the loss has been this way of taking the output, label-smoothed by
        one constant, on every sampled step so far (this one too)."""
        way = self._reading + way
        held = self.state.setdefault("smoothing", {})
        if way in held and held[way] is None:
            return False
        held[way] = _smoothing(loss, at_labels, uniform, held.get(way))
        return held[way] is not None

    def _fed_in_the_step(self, obs: Observation, loss: float, probs: bool) -> str | None:
        """What is wrong with a loss the training step computed itself (None: nothing
        seen): which way of taking the output its value is, label-smoothed or not, read as
        the mean over the batch and, where it has been no way as a mean, as its sum
        (``reduction='sum'``: the mean times the terms)."""
        self._reading = ""
        why = self._taken_as(obs, loss, probs)
        terms = obs.loss_terms
        held = self.state["smoothing"]
        as_mean = any(v is not None for k, v in held.items() if not k.startswith("sum:"))
        if why is None and not as_mean and terms is not None and terms > 1:
            self._reading = "sum:"  # each reading keeps its own smoothings
            why = self._taken_as(obs, loss / terms, probs)
            if why is not None:
                why = f"{why} (the loss is summed over the batch's {terms:.0f} terms)"
        return why

    def _taken_as(self, obs: Observation, loss: float, probs: bool) -> str | None:
        """:meth:`_fed_in_the_step` for one reading of the loss: a mean over the batch."""
        if obs.bce_as_logits is not None:  # targets of the output's shape: binary ways
            return self._binary_in_the_step(obs, loss)
        floor = probability_floor(obs.output_width)
        if probs:
            twice = self._consistent("logits", loss, obs.loss_as_logits, obs.uniform_as_logits)
            right = self._consistent("probs", loss, obs.loss_as_probs, obs.uniform_as_probs)
            if twice and not right and _apart(loss, obs.loss_as_logits, obs.loss_as_probs):
                return (
                    f"the model outputs probabilities of {obs.output_width} classes and the "
                    "loss is their cross-entropy as if they were logits, so a softmax is "
                    f"applied twice and the loss cannot fall below {floor:.3f}; return "
                    "logits from the model (cross_entropy applies log-softmax itself), or "
                    "take log() of the probabilities and use nll_loss"
                )
            return None
        twice = self._consistent("softmax", loss, obs.loss_as_softmax, obs.uniform_as_softmax)
        right = self._consistent("logits", loss, obs.loss_as_logits, obs.uniform_as_logits)
        if twice and not right and _apart(loss, obs.loss_as_softmax, obs.loss_as_logits):
            return (
                f"the model outputs logits of {obs.output_width} classes and the loss is the "
                "cross-entropy of their softmax taken as logits again: a softmax written "
                "between the model's last layer and a loss that applies its own (in "
                "forward after the last module, or in the training step), so a softmax is "
                f"applied twice and the loss cannot fall below {floor:.3f}; pass the logits "
                "to cross_entropy, or take log() of the probabilities and use nll_loss"
            )
        if _matches(loss, obs.loss_as_log_probs, obs.loss_as_logits):
            return (
                "the model outputs logits and the loss is nll_loss of them as they are, "
                "which takes log-probabilities, so it falls without bound; apply "
                "log_softmax before nll_loss, or use cross_entropy on the logits"
            )
        return None

    def _binary_in_the_step(self, obs: Observation, loss: float) -> str | None:
        """The same for a binary or multi-label output and its targets: a sigmoid's
        output whose loss is their binary cross-entropy as logits (and not of the
        probabilities), or logits whose loss is that of their sigmoid as logits (and not
        of themselves), went through a sigmoid twice. No label smoothing here: torch's
        binary losses have none."""
        width = obs.output_width
        what = "one output" if width <= 1 else f"{width} outputs (multi-label)"
        where = (
            "a sigmoid output fed to"
            if obs.output_in_unit == 1.0
            else "a sigmoid written between the model's last layer and"
        )
        if obs.output_in_unit == 1.0:
            twice = self._consistent("bce_logits", loss, obs.bce_as_logits, None)
            right = self._consistent("bce_probs", loss, obs.bce_as_probs, None)
            ways = (obs.bce_as_logits, obs.bce_as_probs)
            fix = (
                "drop the sigmoid (binary_cross_entropy_with_logits applies its own), or "
                "use binary_cross_entropy on the probabilities"
            )
        else:
            twice = self._consistent("bce_sigmoid", loss, obs.bce_as_sigmoid, None)
            right = self._consistent("bce_logits", loss, obs.bce_as_logits, None)
            ways = (obs.bce_as_sigmoid, obs.bce_as_logits)
            fix = "pass the logits to binary_cross_entropy_with_logits, which applies it"
        if not (twice and not right and _apart(loss, *ways)):
            return None
        return (
            f"the model has {what} and the loss is their binary cross-entropy with their "
            f"sigmoid taken as logits again ({where} binary_cross_entropy_with_logits or "
            "BCEWithLogitsLoss), so a sigmoid is applied twice: every prediction lies "
            "within [0.5, 0.731] and the loss cannot fall below 0.313 for a target of 1, "
            f"nor 0.693 for one of 0; {fix}"
        )


class BroadcastLoss(_Persistent):
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
