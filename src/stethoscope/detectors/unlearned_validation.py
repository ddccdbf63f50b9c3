"""A validation that does not show what the model learns: a loss that stays where
training began, or batch norms that normalise otherwise at inference than in training."""

from __future__ import annotations

import math

from stethoscope.detectors._stats import is_finite
from stethoscope.detectors.base import Detector, check_fraction, check_positive
from stethoscope.findings import Finding
from stethoscope.observation import Observation
from stethoscope.running_statistics import LAGGING

__all__ = ["UnlearnedValidation"]


class UnlearnedValidation(Detector):
    """What the model learns does not show in its validation, or only in part: the
    validation loss stays at the level the training started from while the training loss
    falls far below it, or the batch norms normalise a validation otherwise than training.

    Two mechanisms give it, and the finding names the one the run's setup points to:

    * **The model that validates is not the one that trains.** Inference normalises by
      a batch norm's running statistics, which each step keep ``momentum`` of themselves
      (Keras; ``1 - momentum`` in torch). Where that is close to 1 and the steps are few,
      they are still mostly their initial values (mean 0, variance 1): measured,
      ``keras.applications.MobileNetV3Small`` (momentum 0.999) on the digits trains to
      98% and validates at chance (loss ln 10) every epoch; a small Conv+BN CNN on
      23 steps an epoch validates at 2.30 -> 2.23 with Keras' default 0.99, at 2.28 -> 1.39
      with 0.9, its training loss 2.27 -> 1.44 either way.
    * **The validation data is not the training data's kind**: labels misaligned with
      their inputs, another preprocessing, another task.

    Rule: either of two, each at ``patience`` validations in a row (never the sanity
    check):

    * **at the start**: the validation loss is at least ``no_better`` of the run's first
      training loss, at that validation and every one before, while the mean training
      loss since the last validation is below ``learned`` of it. A loss that can fall
      below zero (a negative log-likelihood with a density) has no such floor and is left
      alone, as is a run whose first loss is not positive. A model that learns and then
      overfits had a better validation first, and is ``overfitting``'s.
    * **in part**: a batch norm's running statistics put an error of at least 0.1 into
      its normalised outputs (the mean square, in their standard deviations, of how
      inference normalises against how training does; read from the buffers, see
      ``stethoscope.running_statistics``), after 32 updates or more, while the
      validation loss is at least ``worse`` times the training loss. A model that learned
      some of what it knows into its validation, and not the rest, shows here: the
      suite's CNN at torch's momentum 0.001 validates at 1.29 and then 0.74 (0.05 with
      0.1) while it trains to 0.01.

    Either gives a warning, once.

    Args:
        no_better: The share of the first training loss the validation loss stays above.
        learned: The share of it the training loss must have fallen below.
        patience: Validations in a row that raise the warning.
        worse: How many times the training loss the validation loss must be for the
            batch norms' error to count.
    """

    name = "unlearned_validation"
    needs = frozenset({"val"})
    runs_on = frozenset({"val_norms"})
    base_interval = 1
    #: Its evidence is the validations', and the steps after it show nothing of them: an
    #: escalation would run every detector every step for nothing.
    escalates = False
    advice = "validate the model that trains: check its inference-mode layers and the data"

    def __init__(
        self,
        *,
        no_better: float = 0.9,
        learned: float = 0.5,
        patience: int = 2,
        worse: float = 1.5,
    ) -> None:
        check_fraction(self.name, "no_better", no_better)
        check_fraction(self.name, "learned", learned)
        check_positive(self.name, "patience", patience, integer=True)
        check_positive(self.name, "worse", worse)
        self.no_better, self.learned, self.patience = float(no_better), float(learned), patience
        self.worse = float(worse)
        super().__init__()

    def _initial_state(self) -> dict:
        # in_a_row: validations in a row at the start's level with training below it;
        # validated_better: some validation was below that level (that rule is done);
        # lagging: validations in a row whose batch norms normalise off the batches'
        return {"in_a_row": 0, "validated_better": False, "lagging": 0, "fired": False}

    def finished(self, step: int) -> bool:
        st = self.state
        # a model with batch norms can still validate otherwise than it trains
        return st["fired"] or (st["validated_better"] and self.setup.running_statistics is None)

    def _update(self, obs: Observation) -> list[Finding]:
        if self.state["fired"]:
            return []
        return self._lagging(obs) or self._at_the_start(obs)

    def _lagging(self, obs: Observation) -> list[Finding]:
        """The rule in part: batch norms whose running statistics are off the batches'."""
        st, lag = self.state, obs.val_running_statistics
        if lag is None:
            return []  # not measured at this validation: the count stands
        val, train = obs.val_loss, obs.train_loss
        worse = is_finite(val) and is_finite(train) and train > 0 and self.worse * train <= val
        if not (lag.lagging and worse):
            st["lagging"] = 0
            return []
        st["lagging"] += 1
        if st["lagging"] < self.patience:
            return []
        st["fired"] = True
        rms = math.sqrt(lag.error)
        return [
            self.finding(
                obs,
                "warning",
                f"The validation loss is {val:.3g}, {val / train:.3g}x the training loss "
                f"{train:.3g}, and the batch norms normalise otherwise when it validates: "
                f"the running statistics of {lag.layer} ({lag.setting}) still hold "
                f"{lag.share:.0%} of their values at the start after {lag.updates} steps, "
                f"which puts its outputs {rms:.2g} standard deviations (RMS) from where "
                f"training puts them. The model that validates is not the one that "
                f"trains: {_faster(self.setup.framework)}.",
                value=float(lag.error),
                threshold=LAGGING,
                where=lag.layer,
            )
        ]

    def _at_the_start(self, obs: Observation) -> list[Finding]:
        """The rule at the start: a validation no better than where training began."""
        st = self.state
        if st["validated_better"]:
            return []
        val, train, start = obs.val_loss, obs.train_loss, obs.start_loss
        if not (is_finite(val) and is_finite(start)) or start <= 0 or val < 0:
            return []
        if val < self.no_better * start:
            st["validated_better"] = True  # it learned something that carries over
            return []
        if not is_finite(train) or train < 0 or train >= self.learned * start:
            st["in_a_row"] = 0
            return []
        st["in_a_row"] += 1
        if st["in_a_row"] < self.patience:
            return []
        st["fired"] = True
        return [
            self.finding(
                obs,
                "warning",
                f"The validation loss is {val:.3g} after {st['in_a_row']} validations in a "
                f"row, no better than the first training loss {start:.3g}, while the "
                f"training loss fell to {train:.3g}: nothing the model learns shows when it "
                f"validates. {self._cause(obs.step + 1)}",
                value=float(val),
                threshold=self.no_better * float(start),
                where=self._where(),
            )
        ]

    def _where(self) -> str | None:
        norm = self.setup.running_statistics
        return norm.layer if norm is not None else None

    def _cause(self, steps: int) -> str:
        norm = self.setup.running_statistics
        if norm is None:
            return (
                "The model has no batch norm to validate differently, so look at the "
                "validation data: its labels against its inputs, and its preprocessing "
                "against the training data's."
            )
        share = norm.initial_share(steps)
        faster = _faster(self.setup.framework)
        half = math.log(0.5) / math.log(norm.keep) if 0 < norm.keep < 1 else math.inf
        return (
            f"Inference normalises by the batch norms' running statistics, and those of "
            f"{norm.layer} ({norm.setting}) still hold {share:.0%} of their initial values "
            f"after {steps} steps (half of them after {half:.0f}), so the model that "
            f"validates is closer to the untrained one. {faster[0].upper()}{faster[1:]}, or "
            f"check the validation data: its labels "
            f"against its inputs, and its preprocessing against the training data's."
        )


def _faster(framework: str) -> str:
    """A momentum that follows the batches within tens of steps, in the framework's terms
    (torch's is the share each batch takes, Keras' the share the statistics keep)."""
    if framework == "lightning":
        return "raise the momentum (momentum=0.1, torch's default, is each batch's share)"
    return "lower the momentum (momentum=0.9 keeps 90% of the statistics each step)"
