"""The loss fed the wrong kind of output: probabilities where it takes logits, or
logits where it takes probabilities, read from the output and the loss of each
sampled step."""

from __future__ import annotations

import math

from stethoscope.detectors._persistent import Persistent
from stethoscope.detectors._stats import is_finite
from stethoscope.findings import Finding
from stethoscope.observation import Observation

__all__ = ["SMOOTHING", "LogitsMismatch", "probability_floor"]


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


class LogitsMismatch(Persistent):
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
    #: Whether the binary ways (each element a probability) told the mistake this step.
    _binary = False

    def _update(self, obs: Observation) -> list[Finding]:
        st = self.state
        if st["fired"] or obs.output_probs is None:
            return []
        probs, expects = obs.output_probs == 1.0, obs.loss_expects
        loss = obs.loss if is_finite(obs.loss) else None
        why, self._binary = None, False
        if expects == "logits" and probs:
            why = (
                "the model outputs probabilities (a softmax or sigmoid last) to a loss set "
                "with from_logits=True, which applies its own: on the torch and JAX "
                "backends training sees the softmax of a softmax and its gradients "
                "shrink (on TensorFlow Keras takes the logits back from an activation it "
                "can see, and warns, but from no other); drop the last activation, or "
                "set from_logits=False"
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
        unit = not expects and obs.output_in_unit == 1.0 and self._binary
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

    def _rather(self, loss: float, mistaken: tuple, right: tuple) -> bool:
        """Whether the loss has been the ``mistaken`` way of taking the output and not the
        ``right`` one (each its name, its value and its uniform term, see
        :meth:`_consistent`) on every sampled step so far, the two far apart on this one.
        Both ways are kept up to date, whatever the answer."""
        (bad, bad_value, bad_uniform), (good, good_value, good_uniform) = mistaken, right
        twice = self._consistent(bad, loss, bad_value, bad_uniform)
        fine = self._consistent(good, loss, good_value, good_uniform)
        return twice and not fine and _apart(loss, bad_value, good_value)

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
        """:meth:`_fed_in_the_step` for one reading of the loss: a mean over the batch. The
        ways of a class target come first (labels, or one distribution per row, which a
        binary loss could also take element by element), then the binary ways."""
        classes = obs.loss_as_logits is not None
        why = self._classes_in_the_step(obs, loss, probs) if classes else None
        if why is None and obs.bce_as_logits is not None:  # targets of the output's shape
            why = self._binary_in_the_step(obs, loss)
            self._binary = why is not None
        return why

    def _classes_in_the_step(self, obs: Observation, loss: float, probs: bool) -> str | None:
        """The ways of taking the output against class targets (see the class docstring)."""
        floor = probability_floor(obs.output_width)
        if probs:
            as_logits = ("logits", obs.loss_as_logits, obs.uniform_as_logits)
            if self._rather(loss, as_logits, ("probs", obs.loss_as_probs, obs.uniform_as_probs)):
                fix = (
                    "drop the softmax activation (a cross-entropy with from_logits=True "
                    "applies its own), or compute it with from_logits=False"
                    if self._keras
                    else "return logits from the model (cross_entropy applies log-softmax "
                    "itself), or take log() of the probabilities and use nll_loss"
                )
                return (
                    f"the model outputs probabilities of {obs.output_width} classes and the "
                    f"loss {self._loss_is} their cross-entropy as if they were logits, so a "
                    f"softmax is applied twice and the loss cannot fall below {floor:.3f}; "
                    f"{fix}"
                )
            return None
        as_softmax = ("softmax", obs.loss_as_softmax, obs.uniform_as_softmax)
        if self._rather(loss, as_softmax, ("logits", obs.loss_as_logits, obs.uniform_as_logits)):
            where, fix = (
                (
                    "in the loss function (or the train step) before a cross-entropy that "
                    "applies its own (from_logits=True)",
                    "pass the logits to the cross-entropy with from_logits=True, or the "
                    "softmax to one with from_logits=False",
                )
                if self._keras
                else (
                    "between the model's last layer and a loss that applies its own (in "
                    "forward after the last module, or in the training step)",
                    "pass the logits to cross_entropy, or take log() of the probabilities "
                    "and use nll_loss",
                )
            )
            return (
                f"the model outputs logits of {obs.output_width} classes and the loss "
                f"{self._loss_is} the cross-entropy of their softmax taken as logits again: "
                f"a softmax written {where}, so a softmax is applied twice and the loss "
                f"cannot fall below {floor:.3f}; {fix}"
            )
        if _matches(loss, obs.loss_as_log_probs, obs.loss_as_logits):
            what, fix = (
                (
                    "the negative mean of the outputs at the labels",
                    "apply log_softmax first, or use a cross-entropy with from_logits=True",
                )
                if self._keras
                else (
                    "nll_loss of them as they are",
                    "apply log_softmax before nll_loss, or use cross_entropy on the logits",
                )
            )
            return (
                f"the model outputs logits and the loss {self._loss_is} {what}, which "
                f"takes log-probabilities, so it falls without bound; {fix}"
            )
        return None

    @property
    def _keras(self) -> bool:
        """Whether the loss is a Keras user's own function (the advice names Keras')."""
        return self.setup.framework == "keras"

    @property
    def _loss_is(self) -> str:
        return "function returns" if self._keras else "is"

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
        keras = self._keras
        loss_with_logits = (
            "binary_crossentropy(from_logits=True)"
            if keras
            else "binary_cross_entropy_with_logits or BCEWithLogitsLoss"
        )
        if obs.output_in_unit == 1.0:
            mistaken = ("bce_logits", obs.bce_as_logits, None)
            right = ("bce_probs", obs.bce_as_probs, None)
            fix = (
                "drop the sigmoid activation, or compute it with from_logits=False"
                if keras
                else "drop the sigmoid (binary_cross_entropy_with_logits applies its own), "
                "or use binary_cross_entropy on the probabilities"
            )
        else:
            mistaken = ("bce_sigmoid", obs.bce_as_sigmoid, None)
            right = ("bce_logits", obs.bce_as_logits, None)
            fix = (
                "pass the logits to binary_crossentropy with from_logits=True, which applies it"
                if keras
                else "pass the logits to binary_cross_entropy_with_logits, which applies it"
            )
            if keras:
                where = "a sigmoid in the loss function before"
        if not self._rather(loss, mistaken, right):
            return None
        return (
            f"the model has {what} and the loss {self._loss_is} their binary cross-entropy "
            f"with their sigmoid taken as logits again ({where} {loss_with_logits}), so a "
            "sigmoid is applied twice: every prediction lies within [0.5, 0.731] and the "
            f"loss cannot fall below 0.313 for a target of 1, nor 0.693 for one of 0; {fix}"
        )
